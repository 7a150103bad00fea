"""What tracing costs: the same load on a private stack with tracing off, then on, alternating.

    python -m benchmarks.tracing_overhead                 # 32 prompts, 64 in / 32 out, concurrency 16, 2 rounds
    python -m benchmarks.tracing_overhead --rounds 3 --num-prompts 64

Each round starts a fresh stack per mode (off first, then on), warms it up, runs
the load through the gateway's gRPC streaming API, and stops it; alternating
spreads drift of a shared machine over both modes. With tracing on, the stack
also runs the tracing service and every service exports its spans to it; the
report counts the spans stored and the exports that failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
from pathlib import Path

import redis

from shardline.bench.load import LoadSpec, run_load
from shardline.bench.metrics import summarize
from shardline.bench.stack_backend import StackBackend
from shardline.stack.local_stack import LocalStack, StackConfig
from tracing.collector.span_store import PREFIX

logger = logging.getLogger("tracing_overhead")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="off/on pairs")
    p.add_argument("--out", type=Path, default=Path("results/tracing_overhead.json"))
    return p.parse_args()


async def _measure(url: str, spec: LoadSpec) -> dict:
    backend = StackBackend(url)
    try:
        warm = LoadSpec(
            num_prompts=4,
            input_len=spec.input_len,
            output_len=4,
            max_concurrency=4,
            seed=spec.seed + 100,
            vocab_size=spec.vocab_size,
        )
        await run_load(warm, backend.send, "warm-up")
        timings, wall = await run_load(spec, backend.send, "load")
    finally:
        await backend.close()
    return summarize(timings, wall)


def run_once(tracing: bool, spec: LoadSpec, model: str | None, log_dir: Path) -> dict:
    config = StackConfig.on_free_ports(model=model, tracing=tracing, log_dir=log_dir / ("on" if tracing else "off"))
    stack = LocalStack(config).start()
    try:
        result = asyncio.run(_measure(f"127.0.0.1:{config.grpc_port}", spec))
        if tracing:
            result["spans_stored"] = redis.Redis.from_url(stack.redis_url).zcard(f"{PREFIX}by_time")
    finally:
        stack.stop()
    if tracing:
        logs = "".join(path.read_text() for path in (log_dir / "on").glob("*.log"))
        # Exports the OTLP exporter gave up on after its retries.
        result["failed_exports"] = logs.count("Failed to export")
    return result


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    from gpu_worker_svc.model.loader import load_config

    spec = LoadSpec(
        args.num_prompts,
        args.input_len,
        args.output_len,
        float("inf"),
        args.max_concurrency,
        0,
        load_config(args.model).vocab_size,
    )
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="tracing-overhead-") as tmp:
        for round_no in range(args.rounds):
            for mode in ("off", "on"):
                result = run_once(mode == "on", spec, args.model, Path(tmp) / str(round_no))
                runs[mode].append(result)
                print(
                    f"round {round_no + 1} tracing {mode:>3}: {result['output_throughput']:8.1f} tok/s, "
                    f"TTFT p50 {result['ttft_ms']['median']:7.1f} ms, TPOT p50 {result['tpot_ms']['median']:6.1f} ms"
                    + (f", {result['spans_stored']} spans stored" if mode == "on" else ""),
                    flush=True,
                )
    summary = {
        mode: {
            "output_throughput": statistics.mean(r["output_throughput"] for r in results),
            "ttft_p50_ms": statistics.mean(r["ttft_ms"]["median"] for r in results),
            "tpot_p50_ms": statistics.mean(r["tpot_ms"]["median"] for r in results),
            "failed": sum(r["failed"] for r in results),
        }
        for mode, results in runs.items()
    }
    ratio = summary["on"]["output_throughput"] / summary["off"]["output_throughput"]
    print(
        f"\n{spec.num_prompts} prompts, {spec.input_len} in / {spec.output_len} out, concurrency "
        f"{spec.max_concurrency}, {args.rounds} round(s) per mode"
    )
    print(
        f"output throughput: off {summary['off']['output_throughput']:.1f} tok/s, "
        f"on {summary['on']['output_throughput']:.1f} tok/s; on/off {ratio:.3f} "
        f"(tracing costs {100 * (1 - ratio):+.1f}%)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"load": vars(args) | {"out": str(args.out)}, "summary": summary, "on_off_ratio": ratio, "runs": runs},
            indent=2,
            default=str,
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
