"""`shardline bench`: vLLM-style serving benchmark of a stack, side by side with the in-process engine."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path

from shardline.bench.load import LoadSpec, run_load
from shardline.bench.metrics import Slos, median_of_rounds, summarize
from shardline.cli.arg_types import at_least_one
from shardline.cli.one_line_errors import one_line_errors


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="serving benchmark: TTFT, TPOT, ITL, E2EL, throughput, goodput")
    p.add_argument("--url", default=None, help="gateway gRPC address of a running stack")
    p.add_argument("--launch", action="store_true", help="start a private stack for the run (free ports)")
    p.add_argument("--engine", action="store_true", help="also run the same load on the engine in-process")
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="mean arrival rate (req/s); inf: every request arrives at t=0 (and waits for a slot)",
    )
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="with a finite --request-rate: the gamma shape of the gaps between arrivals, as in "
        "vLLM (1: Poisson; below 1: burstier; above 1: more even)",
    )
    p.add_argument(
        "--max-concurrency",
        type=at_least_one,
        default=16,
        help="requests in flight at once (default 16; vLLM's default is no limit)",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: time to first token at most this")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: time per output token at most this")
    p.add_argument("--slo-e2el-ms", type=float, default=None, help="goodput: end-to-end latency at most this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternate the backends this many times, on fresh prompts each round, and report medians "
        "(on a shared machine either side's speed drifts from minute to minute)",
    )
    p.add_argument("--out", type=Path, default=Path("results/bench.json"))
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=one_line_errors("bench", run))


async def _measure(
    makers: dict[str, Callable[[], object]], spec: LoadSpec, args: argparse.Namespace
) -> dict[str, list[dict]]:
    """Each backend's summary per round; rounds alternate which backend goes first."""
    backends = {}
    slos = Slos(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2el_ms)
    try:
        for name, make in makers.items():
            backends[name] = make()  # inside the loop: grpc.aio channels belong to the loop that creates them
        if "stack" in backends:  # prompts are random ids: ids the served model has, not the local one
            spec = dataclasses.replace(spec, vocab_size=min(spec.vocab_size, await backends["stack"].vocab_size()))
        for name, backend in backends.items():
            warm = LoadSpec(
                num_prompts=min(4, spec.num_prompts),
                input_len=spec.input_len,
                output_len=4,
                max_concurrency=spec.max_concurrency,
                seed=spec.seed + 100,
                vocab_size=spec.vocab_size,
            )
            timings, _ = await run_load(warm, backend.send, f"{name} warm-up")
            if failed := [t.error for t in timings if not t.ok]:
                print(f"{name} warm-up: {len(failed)} of {len(timings)} requests failed, first with {failed[0]}")
        rounds: dict[str, list[dict]] = {name: [] for name in backends}
        for r in range(args.rounds):
            # Fresh prompts each round, the same for every backend within it.
            round_spec = dataclasses.replace(spec, seed=spec.seed + r)
            order = list(backends) if r % 2 == 0 else list(reversed(backends))
            for name in order:
                label = name if args.rounds == 1 else f"{name} {r + 1}/{args.rounds}"
                timings, wall = await run_load(round_spec, backends[name].send, label)
                rounds[name].append(summarize(timings, wall, slos))
        return rounds
    finally:
        for backend in backends.values():
            await backend.close()


def run(args: argparse.Namespace) -> int:
    # Imported here: they pull in torch, which would slow every other subcommand's start.
    from gpu_worker_svc.model.loader import load_config
    from gpu_worker_svc.server.main import engine_config
    from gpu_worker_svc.server.settings import WorkerSettings
    from shardline.bench.backends import EngineBackend, StackBackend
    from shardline.host_memory import reexec_with_malloc_env

    if args.rounds < 1:
        print("--rounds must be at least 1")
        return 2
    if not args.request_rate > 0:
        print("--request-rate must be above 0 (inf: all at once)")
        return 2
    gap_scale = args.request_rate * args.burstiness  # the gamma scale is its inverse
    if not 0 < args.burstiness < math.inf or (args.request_rate < math.inf and not math.isfinite(gap_scale)):
        print("--burstiness must be a finite number above 0")
        return 2
    # With --url the served model's vocabulary may be smaller: _measure asks the stack.
    spec = LoadSpec(
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.request_rate,
        args.max_concurrency,
        args.seed,
        load_config(args.model).vocab_size,
        args.burstiness,
    )
    if not (args.url or args.launch or args.engine):
        print("give --url, --launch and/or --engine")
        return 2
    # The worker's own settings (its defaults and any SHARDLINE_* variables, as a launched stack's
    # worker reads them), so the engine runs exactly as it does inside the stack. Read before
    # anything starts: a bad variable must not leave a launched stack behind.
    settings = WorkerSettings(model=args.model, tracing=False)
    if args.engine and settings.resolved_device == "cpu" and getattr(args, "own_process", False):
        reexec_with_malloc_env()  # the engine then runs under a CPU worker's malloc settings
    makers: dict[str, Callable[[], object]] = {}
    stack = None
    try:
        if args.launch:
            from shardline.stack import LocalStack, StackConfig

            env: dict[str, object] = {}
            if args.engine and settings.resolved_device != "cpu":
                # Both hold the GPU for the whole run: the stack's worker takes half the share, and the
                # engine's sizing counts the worker's memory as used by others.
                env["GPU_MEMORY_UTILIZATION"] = settings.gpu_memory_utilization / 2
            stack = LocalStack(StackConfig.on_free_ports(model=args.model, env=env)).start()
        url = f"127.0.0.1:{stack.config.grpc_port}" if stack is not None else args.url
        if url:
            makers["stack"] = lambda: StackBackend(url)
        if args.engine:
            config, gap = engine_config(settings), settings.resolved_admission_gap_s
            makers["engine"] = lambda: EngineBackend(config, gap, settings.torch_threads)
        rounds = asyncio.run(_measure(makers, spec, args))
    finally:
        if stack is not None:
            stack.stop()
    results = {name: median_of_rounds(r) for name, r in rounds.items()}
    _print(results, spec, args.rounds)
    comparison = _compare(rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "load": vars(args) | {"out": str(args.out)},
                "results": results,
                "rounds": rounds,
                "comparison": comparison,
            },
            indent=2,
            default=str,
        )
    )
    print(f"\nwrote {args.out}")
    return 0


def _compare(rounds: dict[str, list[dict]]) -> dict | None:
    """Stack against engine, round by round (each round's pair ran minutes apart at most), then medians."""
    if "stack" not in rounds or "engine" not in rounds:
        return None
    # A round where either side completed nothing has no ratio (its failures are in the table).
    pairs = [(s, e) for s, e in zip(rounds["stack"], rounds["engine"]) if s["completed"] and e["completed"]]
    if not pairs:
        print("\nno round completed requests on both sides: nothing to compare")
        return None
    ratios = [s["output_throughput"] / e["output_throughput"] for s, e in pairs]
    added = [s["ttft_ms"]["median"] - e["ttft_ms"]["median"] for s, e in pairs]
    if len(ratios) > 1:
        for i, (ratio, ms) in enumerate(zip(ratios, added)):
            print(f"round {i + 1}: stack/engine output throughput {ratio:.3f}; added TTFT p50 {ms:+.1f} ms")
    print(
        f"\nstack/engine output throughput: {statistics.median(ratios):.3f} (range {min(ratios):.3f}-"
        f"{max(ratios):.3f}); added TTFT p50: {statistics.median(added):+.1f} ms (range {min(added):+.1f} to "
        f"{max(added):+.1f})"
    )
    return {
        "output_throughput_ratio": statistics.median(ratios),
        "ratios": ratios,
        "added_ttft_p50_ms": statistics.median(added),
        "added_ttft_p50_ms_rounds": added,
    }


def _print(results: dict[str, dict], spec: LoadSpec, rounds: int) -> None:
    names = list(results)
    print(
        f"\n{spec.num_prompts} prompts, {spec.input_len} in / {spec.output_len} out, "
        f"rate {spec.request_rate}"
        + (f" (burstiness {spec.burstiness})" if spec.burstiness != 1 else "")
        + f", max concurrency {spec.max_concurrency}"
        + (f"; medians of {rounds} alternating rounds" if rounds > 1 else "")
    )
    print(f"{'metric':<28}" + "".join(f"{n:>14}" for n in names))
    rows = [
        ("completed", "completed", None),
        ("failed", "failed", None),
        ("request throughput (req/s)", "request_throughput", None),
        ("output throughput (tok/s)", "output_throughput", None),
        ("total throughput (tok/s)", "total_token_throughput", None),
    ]
    if any(results[n]["goodput"] is not None for n in names):
        rows.append(("goodput (req/s)", "goodput", None))
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        rows += [(f"{metric[:-3].upper()} {stat} (ms)", metric, stat) for stat in ("mean", "std", "median", "p99")]
    for label, key, stat in rows:
        vals = [results[n][key][stat] if stat else results[n][key] for n in names]
        print(f"{label:<28}" + "".join(f"{v:>14.2f}" if isinstance(v, float) else f"{v:>14}" for v in vals))
    for name, r in results.items():
        for error, count in r["errors"].items():
            print(f"{name}: {count} failed with {error}")
        if r["cached_prompt_tokens"]:
            print(
                f"{name}: the prefix cache served {r['cached_prompt_tokens']:.0f} prompt tokens per round: these "
                "prompts were seen before (give another --seed to measure cold prefills)"
            )
