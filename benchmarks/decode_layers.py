"""A plain decode step's layers in one C++ call (model/fused_decode.py) against the Python layers.

One engine with the default settings (gguf weights on CPU); each round runs the same fresh prompts
once with the fused layers and once without, in an order that alternates round by round, so the
machine's drift falls on both alike. Both give the same tokens, bit for bit (tested); only the
decode step's time differs.

    python -m benchmarks.decode_layers --concurrency 1 16 --rounds 4
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf; default: the default model")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default="results/decode_layers.json")
    args = ap.parse_args(argv)
    engine = LLMEngine(
        EngineConfig(
            runner=RunnerConfig(model=args.model, max_model_len=args.input_len + args.output_len + 16),
            scheduler=SchedulerConfig(max_num_seqs=max(args.concurrency), max_num_batched_tokens=8192),
            enable_prefix_caching=False,  # each side prefills the round's prompts itself
        )
    )
    model = engine.runner._shard.model.model
    fused = model.fused_decode
    if fused is None:
        engine.shutdown()
        raise SystemExit("the fused decode layers do not apply to this model here (see model/fused_decode.py)")
    sides = {"fused": fused, "python": None}
    result: dict = {"args": vars(args), "runs": {}}
    try:
        vocab = engine.model_config.vocab_size
        bench_engine(engine, random_prompts(2, args.input_len, vocab, seed=7), 4)  # warm-up
        for c in args.concurrency:
            runs: dict[str, list[dict]] = {side: [] for side in sides}
            for r in range(args.rounds):
                prompts = random_prompts(c, args.input_len, vocab, seed=200 + r)
                for side in list(sides) if r % 2 == 0 else list(sides)[::-1]:
                    model.fused_decode = sides[side]
                    runs[side].append(bench_engine(engine, prompts, args.output_len))
            result["runs"][str(c)] = runs
    finally:
        model.fused_decode = fused
        engine.shutdown()
    print(f"{args.input_len} in / {args.output_len} out, {args.rounds} rounds, alternating")
    for c, runs in result["runs"].items():
        steps = {side: [r["decode_step_ms_p50"] for r in rs] for side, rs in runs.items()}
        ratios = [p / f for f, p in zip(steps["fused"], steps["python"])]
        print(
            f"  concurrency {c}: decode step fused {statistics.median(steps['fused']):.2f} ms, "
            f"python {statistics.median(steps['python']):.2f} ms: {statistics.median(ratios):.3f}x "
            f"({min(ratios):.3f}-{max(ratios):.3f})"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
