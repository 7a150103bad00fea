"""The CPU decode kernel against the torch path it replaces, side by side in one engine.

The same engine runs the same prompts with decode attention by kernels/decode_attention.cpp and
by the torch path (gather the context, then SDPA), alternating which goes first each round, and
reports each side's tokens/s and decode step, and the ratio, as medians and ranges. Both sides
keep everything else: weights, scheduler, sampler; and both run the decode steps' layers in
Python, since the layers in one C++ call (model/fused_decode.py) always take the kernel.

    python -m benchmarks.decode_kernel --quantization int8 --concurrency 16 --rounds 6
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
from gpu_worker_svc.engine.ngram_proposer import SpeculativeConfig
from gpu_worker_svc.model.cpu_weight_formats import CPU_WEIGHT_FORMATS
from gpu_worker_svc.model.layers.kernels import cpu_kernels

SIDES = ("kernel", "torch")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf; default: the default model")
    ap.add_argument("--quantization", default="auto", choices=CPU_WEIGHT_FORMATS)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-speculative-tokens", type=int, default=0, help="n-gram drafts per decode (0: off)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", default="results/decode_kernel.json")
    args = ap.parse_args(argv)
    kernel = cpu_kernels.paged_decode_attention()
    if kernel is None:
        print("the CPU kernels cannot be built on this machine: nothing to compare")
        return 1
    engine = LLMEngine(
        EngineConfig(
            runner=RunnerConfig(
                model=args.model, quantization=args.quantization, max_model_len=args.input_len + args.output_len + 16
            ),
            scheduler=SchedulerConfig(max_num_seqs=args.concurrency, max_num_batched_tokens=8192),
            speculative=SpeculativeConfig(num_speculative_tokens=args.num_speculative_tokens),
            enable_prefix_caching=False,
        )
    )  # each round's prompts run twice: both sides must prefill them
    vocab = engine.model_config.vocab_size
    engine.runner._shard.model.model.fused_decode = None
    paths = {"kernel": cpu_kernels.paged_decode_attention, "torch": lambda: None}
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    try:
        bench_engine(engine, random_prompts(args.concurrency, args.input_len, vocab, seed=7), 4)  # warm-up
        for r in range(args.rounds):
            prompts = random_prompts(args.concurrency, args.input_len, vocab, seed=100 + r)
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                cpu_kernels.paged_decode_attention = paths[side]  # what PagedAttention asks for, each step
                runs[side].append(bench_engine(engine, prompts, args.output_len))
    finally:
        cpu_kernels.paged_decode_attention = paths["kernel"]
        engine.shutdown()
    ratios = [k["tok_s"] / t["tok_s"] for k, t in zip(runs["kernel"], runs["torch"])]
    result = {
        "args": vars(args),
        "runs": runs,
        "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
    }
    print(
        f"concurrency {args.concurrency}, {args.input_len} in / {args.output_len} out, "
        f"quantization {args.quantization}, drafts {args.num_speculative_tokens}, {args.rounds} rounds"
    )
    for side in SIDES:
        tok_s = [run["tok_s"] for run in runs[side]]
        steps = [run["decode_step_ms_p50"] for run in runs[side] if run["decode_step_ms_p50"] is not None]
        step = f"{statistics.median(steps):.2f} ms" if steps else "-"
        print(
            f"  {side:6s} {statistics.median(tok_s):8.1f} tok/s ({min(tok_s):.1f}-{max(tok_s):.1f}), decode step {step}"
        )
    print(f"  kernel / torch: {result['ratio']['median']:.3f}x ({min(ratios):.3f}-{max(ratios):.3f})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
