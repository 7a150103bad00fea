"""Multi-LoRA serving at the engine: output tokens/s at a concurrency with 1, 4 and 16 distinct
adapters against the bare base model, side by side.

    python -m benchmarks.lora                                  # the default model (gguf), concurrency 16
    python -m benchmarks.lora --adapters 0 4 --rank 16 --rounds 2 --out lora.json

Each case runs `--concurrency` requests at once (greedy, `--output-len` tokens each, fresh random
prompts of `--prompt-len` tokens), their adapters dealt round-robin from the case's set (0: the base
model). The adapters are random, of rank `--rank` on q/k/v/o and gate/up/down, written in PEFT's
format. Every case has max_loras_per_batch slots for all its adapters, so none waits for a slot.
Rounds rotate the cases' order, so the machine's drift falls on all of them alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.engine_vs_hf import random_prompts
from gpu_worker_svc.engine.batch_scheduler import SchedulerConfig
from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.model_runner import RunnerConfig
from gpu_worker_svc.engine.sampling_params import SamplingParams
from gpu_worker_svc.model.config import ModelConfig
from gpu_worker_svc.model.lora_adapter import lora_targets

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, cfg: ModelConfig, rank: int, seed: int, alpha: float | None = None) -> None:
    """A random adapter for `cfg` in PEFT's format: every decoder layer's seven projections, scaled by
    `alpha` / `rank` (alpha None: 2 * rank)."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    targets = lora_targets(cfg)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in MODULES:
            target = targets[module]
            prefix = f"base_model.model.model.layers.{layer}.{target.layer.split('.')[0]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, target.inputs, generator=g) / target.inputs**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(target.rows, rank, generator=g) * 0.02
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    lora_alpha = 2 * rank if alpha is None else alpha
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": lora_alpha, "target_modules": list(MODULES), "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))


def run_case(engine: LLMEngine, adapters: list[str | None], prompts: list[list[int]], out_len: int) -> dict:
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"lora-{time.monotonic_ns()}-{i}", prompt, params, adapter=adapters[i % len(adapters)])
    produced, decode_s = 0, []
    t0 = time.perf_counter()
    while engine.has_unfinished:
        step = engine.step()
        produced += sum(len(o.new_token_ids) for o in step.outputs)
        if step.stats and step.stats.num_prefill_tokens == 0:
            decode_s.append(step.stats.step_time_s)
    elapsed = time.perf_counter() - t0
    return {"tok_s": produced / elapsed, "decode_step_ms_p50": 1000 * statistics.median(decode_s) if decode_s else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the default model)")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 16], help="distinct adapters per case")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    most = max(max(args.adapters), 1)
    engine = LLMEngine(
        EngineConfig(
            runner=RunnerConfig(model=args.model, quantization=args.quantization),
            scheduler=SchedulerConfig(max_num_seqs=args.concurrency, max_loras_per_batch=most),
        )
    )
    results: dict[int, list[dict]] = {n: [] for n in args.adapters}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(max(args.adapters)):
            write_adapter(Path(tmp) / f"a{i}", engine.model_config, args.rank, seed=i)
            engine.add_lora(f"a{i}", Path(tmp) / f"a{i}")
        vocab = engine.model_config.vocab_size
        run_case(engine, [None], random_prompts(2, 16, vocab, seed=999), 4)  # warm-up: first-call costs
        for r in range(args.rounds):
            order = args.adapters[r % len(args.adapters) :] + args.adapters[: r % len(args.adapters)]
            for n in order:
                names: list[str | None] = [f"a{i}" for i in range(n)] if n else [None]
                prompts = random_prompts(args.concurrency, args.prompt_len, vocab, seed=1000 * r + n)
                results[n].append(run_case(engine, names, prompts, args.output_len))
    engine.shutdown()
    base = statistics.median(x["tok_s"] for x in results[0]) if 0 in results else None
    summary = {}
    print(f"{'adapters':>8} {'tok/s':>8} {'vs base':>8} {'decode step ms':>15}")
    for n, runs in results.items():
        tok_s = statistics.median(x["tok_s"] for x in runs)
        steps = [x["decode_step_ms_p50"] for x in runs if x["decode_step_ms_p50"] is not None]
        step_ms = statistics.median(steps) if steps else float("nan")
        ratio = tok_s / base if base else float("nan")
        summary[n] = {"tok_s": tok_s, "vs_base": ratio, "decode_step_ms_p50": step_ms, "runs": runs}
        print(f"{n or 'base':>8} {tok_s:8.1f} {ratio:8.2f} {step_ms:15.1f}")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "cases": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
