"""What batch-invariant attention costs (`--batch-invariant`, gpu_worker_svc/model/layers/invariant_attention.py).

Where the CPU decode kernel takes every query (float32 KV, head_dim a multiple of 16), the flag adds
only rank-ordered tensor-parallel sums and start-up checks; elsewhere it swaps torch's attention for
invariant_attention.

Two engines on the same model and weight format, one without the flag and one with it, alternate
rounds on fresh random prompts (ignore_eos, greedy), so the machine's
drift moves both sides of each round's ratio alike; medians and ranges are reported.

    python -m benchmarks.batch_invariance --quantization int8
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
from gpu_worker_svc.model.cpu_weight_formats import CPU_WEIGHT_FORMATS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder, .gguf, or dummy:<shape>; default: the default model")
    ap.add_argument("--quantization", default="auto", choices=CPU_WEIGHT_FORMATS)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("results/batch_invariance.json"))
    args = ap.parse_args(argv)
    engines = {
        mode: LLMEngine(
            EngineConfig(
                runner=RunnerConfig(
                    model=args.model,
                    quantization=args.quantization,
                    batch_invariant=mode == "invariant",
                    max_model_len=args.input_len + args.output_len + 16,
                ),
                scheduler=SchedulerConfig(max_num_seqs=max(args.concurrency), max_num_batched_tokens=8192),
            )
        )
        for mode in ("fused", "invariant")
    }
    vocab = engines["fused"].model_config.vocab_size
    rows = []
    try:
        for c in args.concurrency:
            for engine in engines.values():  # warm-up at this batch size, on prompts of its own
                bench_engine(engine, random_prompts(c, args.input_len, vocab, seed=1000 + c), 3)
            rounds = []
            for r in range(args.rounds):
                prompts = random_prompts(c, args.input_len, vocab, seed=100 * c + r)
                order = ("fused", "invariant") if r % 2 == 0 else ("invariant", "fused")
                result = {mode: bench_engine(engines[mode], prompts, args.output_len)["tok_s"] for mode in order}
                rounds.append({**result, "ratio": result["invariant"] / result["fused"]})
            ratios = [x["ratio"] for x in rounds]
            rows.append(
                {
                    "concurrency": c,
                    "rounds": rounds,
                    "ratio": statistics.median(ratios),
                    "ratio_range": (min(ratios), max(ratios)),
                    **{mode: statistics.median(x[mode] for x in rounds) for mode in engines},
                }
            )
    finally:
        for engine in engines.values():
            engine.shutdown()
    print(
        f"\nmodel={args.model or 'default'} quantization={args.quantization} "
        f"in={args.input_len} out={args.output_len}, medians of {args.rounds} alternating rounds"
    )
    print(f"{'conc':>5} {'fused tok/s':>12} {'invariant tok/s':>16} {'ratio':>7} {'range':>11}")
    for row in rows:
        low, high = row["ratio_range"]
        print(
            f"{row['concurrency']:>5} {row['fused']:>12.1f} {row['invariant']:>16.1f} {row['ratio']:>7.3f} "
            f"{low:.2f}-{high:.2f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
