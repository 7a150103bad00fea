"""Shardline's engine against HF transformers `generate()`, side by side in one run.

Random token prompts of a fixed length, a fixed number of output tokens
(ignore_eos), greedy, at each concurrency. Both sides prefill every prompt.
Engine and HF runs alternate for --rounds rounds, on fresh prompts each round,
and the table gives medians. Prints a table and writes JSON.

    python -m benchmarks.engine_vs_hf                       # CPU, default model
    python -m benchmarks.engine_vs_hf --device cuda --model dummy:llama-3.2-1b --concurrency 1 64
    python -m benchmarks.engine_vs_hf --quantization int8 --num-speculative-tokens 0 4   # n-gram drafts or not

With several --num-speculative-tokens values, each round runs the engine once per value (same
prompts, alternating with HF), and each gets its row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from gpu_worker_svc.engine.batch_scheduler import SchedulerConfig
from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.model_runner import RunnerConfig
from gpu_worker_svc.engine.ngram_proposer import SpeculativeConfig
from gpu_worker_svc.engine.sampling_params import SamplingParams
from gpu_worker_svc.model.cpu_weight_formats import CPU_WEIGHT_FORMATS
from gpu_worker_svc.model.dummy import dummy_config, is_dummy
from shardline.core.model_path import resolve_model_path

PEAK_BANDWIDTH = {"cuda": 4.8e12}  # H200 HBM3e, bytes/s


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (n, length), generator=g).tolist()


def bench_engine(engine: LLMEngine, prompts: list[list[int]], out_len: int) -> dict:
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", p, params)
    decode_times: list[float] = []
    produced = cached = drafts = accepted = 0
    t0 = time.perf_counter()
    while engine.has_unfinished:
        step = engine.step()
        produced += sum(len(o.new_token_ids) for o in step.outputs)
        cached += step.stats.prefix_cache_hit_tokens if step.stats else 0
        drafts += step.stats.num_draft_tokens if step.stats else 0
        accepted += step.stats.num_accepted_tokens if step.stats else 0
        if step.stats and step.stats.num_prefill_tokens == 0:
            decode_times.append(step.stats.step_time_s)
    if engine.runner.config.device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    decode_times.sort()
    return {
        "tok_s": produced / elapsed,
        "seconds": elapsed,
        "tokens": produced,
        "prefix_cache_hit_tokens": cached,
        "decode_step_ms_p50": 1000 * decode_times[len(decode_times) // 2] if decode_times else None,
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
    }


def load_hf(model: str | None, device: str, dtype: torch.dtype):
    import transformers

    if is_dummy(model):
        c = dummy_config(str(model))
        cfg = transformers.LlamaConfig(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_layers,
            num_attention_heads=c.num_heads,
            num_key_value_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            rms_norm_eps=c.rms_norm_eps,
            rope_theta=c.rope_theta,
            rope_scaling=c.rope_scaling,
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=c.tie_word_embeddings,
        )
        with torch.device(device):
            return transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    path = resolve_model_path(model)
    if path.is_dir():  # a Hugging Face folder
        return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    return (
        transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        .to(device)
        .eval()
    )


@torch.inference_mode()
def bench_hf(hf, prompts: list[list[int]], out_len: int, device: str) -> dict:
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(
        max_new_tokens=out_len,
        min_new_tokens=out_len,
        do_sample=False,
        pad_token_id=0,
        attention_mask=torch.ones_like(ids),
    )
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = hf.generate(ids, **kwargs)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    produced = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"tok_s": produced / elapsed, "seconds": elapsed, "tokens": produced}


def mbu(engine: LLMEngine, step_ms: float, context: int, device: str) -> float | None:
    """(weight bytes + KV bytes read) / step time / peak bandwidth, for one sequence's decode step."""
    if device not in PEAK_BANDWIDTH or not step_ms:
        return None
    cfg = engine.model_config
    itemsize = engine.runner._shard.dtype.itemsize
    weights = cfg.num_params * itemsize
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * context * itemsize
    return (weights + kv) / (step_ms / 1000) / PEAK_BANDWIDTH[device]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder, .gguf, or dummy:<shape>; default: the default model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument(
        "--quantization",
        default="auto",
        choices=CPU_WEIGHT_FORMATS,
        help="a CPU weight format (gpu_worker_svc/model/layers/quantize.py); auto: the worker's default",
    )
    ap.add_argument(
        "--num-speculative-tokens",
        type=int,
        nargs="+",
        default=[0],
        help="n-gram speculation's draft tokens per decode (0: off); several: a row each",
    )
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    ap.add_argument("--rounds", type=int, default=3, help="engine/HF alternations per concurrency (medians reported)")
    ap.add_argument("--out", default="results/engine_vs_hf.json")
    args = ap.parse_args(argv)
    dtype_name = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")

    engine = LLMEngine(
        EngineConfig(
            runner=RunnerConfig(
                model=args.model,
                device=args.device,
                dtype=dtype_name,
                quantization=args.quantization,
                max_model_len=args.input_len + args.output_len + 16,
            ),
            scheduler=SchedulerConfig(max_num_seqs=max(args.concurrency), max_num_batched_tokens=8192),
            # Each speculation setting runs a round's prompts again: none may come from the prefix cache.
            enable_prefix_caching=len(args.num_speculative_tokens) == 1,
        )
    )
    vocab = engine.model_config.vocab_size
    hf = None if args.no_hf else load_hf(args.model, args.device, getattr(torch, dtype_name))
    rows = []
    bench_engine(engine, random_prompts(2, args.input_len, vocab, seed=99), 4)  # warm-up (and graph capture)
    for c in args.concurrency:
        # Warm up at this batch size on prompts of its own: HF prefills every prompt, so must the
        # engine (a prompt seen before would hit the prefix cache and skip its prefill).
        bench_engine(engine, random_prompts(c, args.input_len, vocab, seed=1000 + c), 3)
        if hf is not None:
            bench_hf(hf, random_prompts(c, args.input_len, vocab, seed=1000 + c), 3, args.device)
        # Rounds alternate engine and HF on fresh prompts, so a machine that speeds up or slows
        # down mid-run (shared cores) moves both sides of each round's ratio alike.
        by_k: dict[int, list[dict]] = {k: [] for k in args.num_speculative_tokens}
        for r in range(args.rounds):
            prompts = random_prompts(c, args.input_len, vocab, seed=100 * c + r)
            results = {}
            for k in args.num_speculative_tokens:
                engine.config.speculative = SpeculativeConfig(num_speculative_tokens=k)
                results[k] = {"shardline": bench_engine(engine, prompts, args.output_len)}
                if results[k]["shardline"]["prefix_cache_hit_tokens"]:
                    raise RuntimeError("benchmark prompts hit the prefix cache: the engine skipped prefill work")
            hf_result = bench_hf(hf, prompts, args.output_len, args.device) if hf is not None else None
            for k, result in results.items():
                if hf_result is not None:
                    result["hf"], result["ratio"] = hf_result, result["shardline"]["tok_s"] / hf_result["tok_s"]
                by_k[k].append(result)
        rows += [_row(engine, c, k, rounds, args) for k, rounds in by_k.items()]
    engine.shutdown()

    print(
        f"\nmodel={args.model or 'default'} device={args.device} dtype={dtype_name} "
        f"quantization={args.quantization} "
        f"in={args.input_len} out={args.output_len}"
    )
    print(f"medians of {args.rounds} alternating rounds")
    print(
        f"{'conc':>5} {'drafts':>6} {'shardline tok/s':>16} {'HF tok/s':>10} {'ratio':>7} {'ratio range':>13} "
        f"{'decode step ms':>15} {'MBU':>6} {'accepted':>9}"
    )
    for r in rows:
        hf_tok = f"{r['hf']['tok_s']:.1f}" if "hf" in r else "-"
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
        spread = f"{r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}" if "ratio_range" in r else "-"
        step = r["shardline"]["decode_step_ms_p50"]
        m = r.get("mbu")
        accepted = f"{r['acceptance']:.0%}" if r["acceptance"] is not None else "-"
        print(
            f"{r['concurrency']:>5} {r['num_speculative_tokens']:>6} {r['shardline']['tok_s']:>16.1f} {hf_tok:>10} "
            f"{ratio:>7} {spread:>13} {step if step is None else round(step, 2)!s:>15} "
            f"{'-' if m is None else f'{m:.1%}':>6} {accepted:>9}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


def _row(engine: LLMEngine, c: int, k: int, rounds: list[dict], args: argparse.Namespace) -> dict:
    """Medians over the rounds of one concurrency and speculation setting."""
    drafts = sum(x["shardline"]["draft_tokens"] for x in rounds)
    row = {
        "concurrency": c,
        "num_speculative_tokens": k,
        "rounds": rounds,
        "shardline": {
            "tok_s": statistics.median([x["shardline"]["tok_s"] for x in rounds]),
            "decode_step_ms_p50": statistics.median([x["shardline"]["decode_step_ms_p50"] or 0 for x in rounds])
            or None,
        },
        "acceptance": sum(x["shardline"]["accepted_tokens"] for x in rounds) / drafts if drafts else None,
    }
    if "hf" in rounds[0]:
        row["hf"] = {"tok_s": statistics.median([x["hf"]["tok_s"] for x in rounds])}
        row["ratio"] = statistics.median([x["ratio"] for x in rounds])
        row["ratio_range"] = (min(x["ratio"] for x in rounds), max(x["ratio"] for x in rounds))
    if c == 1:
        row["mbu"] = mbu(
            engine, row["shardline"]["decode_step_ms_p50"], args.input_len + args.output_len // 2, args.device
        )
    return row


if __name__ == "__main__":
    raise SystemExit(main())
