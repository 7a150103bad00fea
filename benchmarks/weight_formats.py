"""CPU weight formats side by side: tokens/s, the decode step, and the weight bytes it reads.

One engine per format (fp32 oneDNN-packed, int8, gguf, ...) on the same model; each round gives
every format the same fresh random prompts, in an order that rotates round by round, so the
machine's drift falls on all of them alike. At batch 1 a decode step reads every linear weight
and the LM head once, so the bytes per step, and the bandwidth they imply, explain the step time.

    python -m benchmarks.weight_formats --formats fp32 int8 gguf --concurrency 1 16 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.engine_vs_hf import bench_engine, random_prompts
from gpu_worker_svc.engine.batch_scheduler import SchedulerConfig
from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.model_runner import RunnerConfig
from gpu_worker_svc.model.config import ModelConfig
from gpu_worker_svc.model.cpu_weight_formats import CPU_WEIGHT_FORMATS
from gpu_worker_svc.model.layers.gguf import GGUFWeight

# Bytes per weight of the formats that re-quantize every layer (int8's per-channel scales are
# negligible; int4 has a bf16 scale and zero per 32).
_BYTES_PER_WEIGHT = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5 + 4 / 32}


def linear_weights(cfg: ModelConfig) -> int:
    """Weights of the linear layers and the LM head: what a batch-1 decode step multiplies by."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    return cfg.num_layers * per_layer + cfg.vocab_size * h


def weight_bytes_per_step(engine: LLMEngine, fmt: str) -> int:
    """Bytes of weight a batch-1 decode step streams: gguf's blocks as held, fp32 for the rest."""
    fmt = fmt.removesuffix("+bi")
    if fmt != "gguf":
        return int(linear_weights(engine.model_config) * _BYTES_PER_WEIGHT[fmt])
    blocks = [
        m.quant for m in engine.runner._shard.model.modules() if isinstance(getattr(m, "quant", None), GGUFWeight)
    ]
    in_blocks = sum(b.in_features * b.out_features for b in blocks)
    return sum(b.panels.numel() for b in blocks) + 4 * (linear_weights(engine.model_config) - in_blocks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf; default: the default model")
    formats = ["fp32", *CPU_WEIGHT_FORMATS]
    ap.add_argument(
        "--formats",
        nargs="+",
        default=["fp32", "int8", "gguf"],
        choices=[*formats, *(f"{fmt}+bi" for fmt in formats)],
        help="FORMAT+bi: with batch-invariant attention (--batch-invariant)",
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default="results/weight_formats.json")
    args = ap.parse_args(argv)
    engines = {
        fmt: LLMEngine(
            EngineConfig(
                runner=RunnerConfig(
                    model=args.model,
                    quantization=None if fmt.removesuffix("+bi") == "fp32" else fmt.removesuffix("+bi"),
                    batch_invariant=fmt.endswith("+bi"),
                    max_model_len=args.input_len + args.output_len + 16,
                ),
                scheduler=SchedulerConfig(max_num_seqs=max(args.concurrency), max_num_batched_tokens=8192),
                enable_prefix_caching=False,  # every format prefills each round's prompts itself
            )
        )
        for fmt in args.formats
    }
    result: dict = {"args": vars(args), "bytes_per_step": {}, "runs": {}}
    try:
        vocab = next(iter(engines.values())).model_config.vocab_size
        for fmt, engine in engines.items():
            result["bytes_per_step"][fmt] = weight_bytes_per_step(engine, fmt)
            bench_engine(engine, random_prompts(2, args.input_len, vocab, seed=7), 4)  # warm-up
        for c in args.concurrency:
            runs: dict[str, list[dict]] = {fmt: [] for fmt in engines}
            for r in range(args.rounds):
                prompts = random_prompts(c, args.input_len, vocab, seed=100 + r)
                order = list(engines)[r % len(engines) :] + list(engines)[: r % len(engines)]
                for fmt in order:
                    runs[fmt].append(bench_engine(engines[fmt], prompts, args.output_len))
            result["runs"][str(c)] = runs
    finally:
        for engine in engines.values():
            engine.shutdown()
    print(f"{args.input_len} in / {args.output_len} out, {args.rounds} rounds, formats in rotating order")
    for c, runs in result["runs"].items():
        print(f"  concurrency {c}:")
        for fmt, rs in runs.items():
            steps = [r["decode_step_ms_p50"] for r in rs]
            tok_s = [r["tok_s"] for r in rs]
            mb = result["bytes_per_step"][fmt] / 1e6
            step = statistics.median(steps)
            print(
                f"    {fmt:8s} decode step {step:6.2f} ms ({min(steps):.2f}-{max(steps):.2f}), "
                f"{statistics.median(tok_s):6.1f} tok/s; weights {mb:6.1f} MB/step = {mb / step:.1f} GB/s"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
