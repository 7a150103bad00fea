"""`shardline bench`: vLLM-style serving benchmark of a stack, side by side with the in-process engine."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from shardline.bench.load import LoadSpec, run_load
from shardline.bench.metrics import summarize


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="serving benchmark: TTFT, TPOT, ITL, E2EL, throughput, goodput")
    p.add_argument("--url", default=None, help="gateway gRPC address of a running stack")
    p.add_argument("--launch", action="store_true", help="start a private stack for the run (free ports)")
    p.add_argument("--engine", action="store_true", help="also run the same load on the engine in-process")
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson rate (req/s); inf: all at t=0")
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/bench.json"))
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=run)


async def _measure(make_backend, spec: LoadSpec, label: str, args: argparse.Namespace) -> dict:
    backend = make_backend()  # inside the loop: grpc.aio channels belong to the loop that creates them
    warm = LoadSpec(num_prompts=min(4, spec.num_prompts), input_len=spec.input_len, output_len=4,
                    max_concurrency=spec.max_concurrency, seed=spec.seed + 100, vocab_size=spec.vocab_size)
    await run_load(warm, backend.send, f"{label} warm-up")
    timings, wall = await run_load(spec, backend.send, label)
    await backend.close()
    return summarize(timings, wall, args.slo_ttft_ms, args.slo_tpot_ms)


def run(args: argparse.Namespace) -> int:
    # Imported here: they pull in torch, which would slow every other subcommand's start.
    from shardline.bench.backends import EngineBackend, StackBackend
    from gpu_worker_svc.model.loader import load_config
    from gpu_worker_svc.server.main import engine_config
    from gpu_worker_svc.server.settings import WorkerSettings

    spec = LoadSpec(args.num_prompts, args.input_len, args.output_len, args.request_rate, args.max_concurrency,
                    args.seed, load_config(args.model).vocab_size)
    results: dict[str, dict] = {}
    if args.url or args.launch:
        stack = None
        url = args.url
        if args.launch:
            from shardline.stack import LocalStack, StackConfig

            stack = LocalStack(StackConfig.on_free_ports(model=args.model)).start()
            url = f"127.0.0.1:{stack.config.grpc_port}"
        try:
            results["stack"] = asyncio.run(_measure(lambda: StackBackend(url), spec, "stack", args))
        finally:
            if stack is not None:
                stack.stop()
    if args.engine:
        # The worker's own settings (its defaults and any SHARDLINE_* variables, as a launched stack's
        # worker reads them), so the engine runs exactly as it does inside the stack.
        settings = WorkerSettings(model=args.model, tracing=False)
        config, gap = engine_config(settings), settings.resolved_admission_gap_s
        results["engine"] = asyncio.run(_measure(lambda: EngineBackend(config, gap), spec, "engine", args))
    if not results:
        print("give --url, --launch and/or --engine")
        return 2
    _print(results, spec)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"load": vars(args) | {"out": str(args.out)}, "results": results}, indent=2,
                                   default=str))
    print(f"\nwrote {args.out}")
    return 0


def _print(results: dict[str, dict], spec: LoadSpec) -> None:
    names = list(results)
    print(f"\n{spec.num_prompts} prompts, {spec.input_len} in / {spec.output_len} out, "
          f"rate {spec.request_rate}, max concurrency {spec.max_concurrency}")
    print(f"{'metric':<28}" + "".join(f"{n:>14}" for n in names))
    rows = [("completed", "completed", None), ("failed", "failed", None),
            ("request throughput (req/s)", "request_throughput", None),
            ("output throughput (tok/s)", "output_throughput", None),
            ("total throughput (tok/s)", "total_token_throughput", None), ("goodput (req/s)", "goodput", None)]
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        rows += [(f"{metric[:-3].upper()} {stat} (ms)", metric, stat) for stat in ("mean", "median", "p99")]
    for label, key, stat in rows:
        vals = [results[n][key][stat] if stat else results[n][key] for n in names]
        print(f"{label:<28}" + "".join(f"{v:>14.2f}" if isinstance(v, float) else f"{v:>14}" for v in vals))
    for name, r in results.items():
        for error, count in r["errors"].items():
            print(f"{name}: {count} failed with {error}")
    if "stack" in results and "engine" in results:
        s, e = results["stack"], results["engine"]
        print(f"\nstack/engine output throughput: {s['output_throughput'] / e['output_throughput']:.3f}; "
              f"added TTFT p50: {s['ttft_ms']['median'] - e['ttft_ms']['median']:+.1f} ms")
