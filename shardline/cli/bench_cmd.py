"""`shardline bench`: vLLM-style serving benchmark of a stack or any OpenAI-compatible server, side by side."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from shardline.bench.load import LoadSpec, Target, model_vocab_size, run_load
from shardline.bench.metrics import Slos, median_of_rounds, summarize
from shardline.bench.openai_backend import OpenAIBackend
from shardline.cli.arg_types import at_least_one
from shardline.cli.one_line_errors import one_line_errors
from shardline.cli.serve_extra import require_serve


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="serving benchmark: TTFT, TPOT, ITL, E2EL, throughput, goodput")
    _target_flags(p.add_argument_group("targets: where the load goes"))
    _load_flags(p.add_argument_group("the load"))
    _slo_flags(p.add_argument_group("goodput: the SLOs a request must meet"))
    _report_flags(p.add_argument_group("the report"))
    p.set_defaults(func=one_line_errors("bench", run))


def _target_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--url", default=None, help="gateway gRPC address of a running stack")
    g.add_argument("--launch", action="store_true", help="start a private stack for the run (free ports)")
    g.add_argument("--engine", action="store_true", help="also run the same load on the engine in-process")
    g.add_argument(
        "--model",
        default=None,
        help="the model to run (a path, a name or dummy:<shape>); with --backend openai, the model the "
        "requests name (default: the first of each server's GET /v1/models)",
    )
    g.add_argument(
        "--backend",
        choices=("stack", "openai"),
        default="stack",
        help="stack: the gateway's gRPC API (--url, --launch); openai: streamed /v1/completions of any "
        "OpenAI-compatible server (--base-url, or --launch for a private stack's HTTP API)",
    )
    g.add_argument("--base-url", default=None, help="--backend openai: the server, e.g. http://127.0.0.1:8080")
    g.add_argument(
        "--compare-base-url",
        default=None,
        help="--backend openai: a second server, alternated with the first round by round",
    )
    g.add_argument("--api-key", default=None, help="--backend openai: sent as 'Authorization: Bearer <key>'")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="--backend openai: the local model whose vocabulary the random prompts come from (and which "
        "--launch runs); default: Shardline's default model",
    )
    g.add_argument(
        "--prompt-format",
        choices=("ids", "text"),
        default="ids",
        help="--backend openai: send prompts as token-id lists (vLLM, SGLang, llama-server, Shardline), or "
        "as their text under --tokenizer, for servers that take only text",
    )
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--backend openai: send ignore_eos (a vLLM and llama.cpp extension) so every request makes "
        "--output-len tokens; --no-ignore-eos for servers that refuse the field",
    )


def _load_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="mean arrival rate (req/s); inf: every request arrives at t=0 (and waits for a slot)",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="with a finite --request-rate: the gamma shape of the gaps between arrivals, as in "
        "vLLM (1: Poisson; below 1: burstier; above 1: more even)",
    )
    g.add_argument(
        "--max-concurrency",
        type=at_least_one,
        default=16,
        help="requests in flight at once (default 16; vLLM's default is no limit)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternate the backends this many times, on fresh prompts each round, and report medians "
        "(on a shared machine either side's speed drifts from minute to minute)",
    )
    g.add_argument(
        "--tenants",
        type=Path,
        default=None,
        help="a multi-tenant workload (YAML or JSON: tenants with keys, rates, lengths, SLOs; docs/benchmarks.md): "
        "reported per tenant, with Jain's fairness index and goodput; replaces the single-load flags",
    )


def _slo_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: time to first token at most this")
    g.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: time per output token at most this")
    g.add_argument("--slo-e2el-ms", type=float, default=None, help="goodput: end-to-end latency at most this")


def _report_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--json", action="store_true", help="print the results as JSON on stdout (the table goes to stderr)")
    g.add_argument("--out", type=Path, default=Path("results/bench.json"))
    g.add_argument("-v", "--verbose", action="store_true")


async def _measure(
    makers: dict[str, Callable[[], Target]], spec: LoadSpec, args: argparse.Namespace, targets: dict[str, str]
) -> dict[str, list[dict]]:
    """Each backend's summary per round; rounds alternate which backend goes first. `targets` gets
    what each OpenAI-compatible backend is: its server and model."""
    backends: dict[str, Target] = {}
    slos = Slos(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2el_ms)
    try:
        for name, make in makers.items():
            backends[name] = make()  # inside the loop: grpc.aio channels belong to the loop that creates them
        for name, backend in backends.items():  # prompts are random ids: ids every served model has
            if size := await backend.vocab_size():
                spec = dataclasses.replace(spec, vocab_size=min(spec.vocab_size or size, size))
            if isinstance(backend, OpenAIBackend):
                targets[name] = f"{backend.root}, model {backend.model}"
        if spec.vocab_size is None:
            raise _FlagsError(
                "no server says its vocabulary size, so prompts of random ids cannot be drawn: reading "
                "--tokenizer's needs the services (pip install 'shardline[serve]')"
            )
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
    if not args.json:
        return _run(args)
    stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):  # the table to stderr: stdout holds one JSON document
        rc = _run(args)
    if rc == 0:  # what --out holds, less the per-request detail
        doc = json.loads(args.out.read_text())
        print(json.dumps({k: v for k, v in doc.items() if k not in ("rounds", "detail")}, indent=2), file=stdout)
    return rc


def _run(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        print("--rounds must be at least 1")
        return 2
    if args.tenants is not None:
        from shardline.cli.bench_tenants import TenantFlagsError, run_tenant_bench

        try:
            return run_tenant_bench(args)
        except TenantFlagsError as exc:
            print(exc)
            return 2
    if (problem := _arrival_problem(args)) is not None:
        print(problem)
        return 2
    # A served model's vocabulary may be smaller: _measure asks the servers that say.
    spec = LoadSpec(
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.request_rate,
        args.max_concurrency,
        args.seed,
        model_vocab_size(args.tokenizer if args.backend == "openai" else args.model),
        args.burstiness,
    )
    makers: dict[str, Callable[[], Target]] = {}
    targets: dict[str, str] = {}
    stack = None
    try:
        stack = (_openai_targets if args.backend == "openai" else _stack_targets)(args, makers)
        rounds = asyncio.run(_measure(makers, spec, args, targets))
    except _FlagsError as exc:
        print(exc)
        return 2
    finally:
        if stack is not None:
            stack.stop()
    _report(args, spec, rounds, targets)
    return 0


def _arrival_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the arrival flags, or None."""
    if not args.request_rate > 0:
        return "--request-rate must be above 0 (inf: all at once)"
    gap_scale = args.request_rate * args.burstiness  # the gamma scale is its inverse
    if not 0 < args.burstiness < math.inf or (args.request_rate < math.inf and not math.isfinite(gap_scale)):
        return "--burstiness must be a finite number above 0"
    return None


def _report(args: argparse.Namespace, spec: LoadSpec, rounds: dict[str, list[dict]], targets: dict[str, str]) -> None:
    """The table on stdout, and every round's figures in --out."""
    results = {name: median_of_rounds(r) for name, r in rounds.items()}
    _print(results, spec, args.rounds)
    for name, target in targets.items():
        print(f"{name}: {target}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "load": vars(args) | {"out": str(args.out)},
                "results": results,
                "rounds": rounds,
                "comparison": _compare(rounds),
                "targets": targets,
            },
            indent=2,
            default=str,
        )
    )
    print(f"\nwrote {args.out}")


class _FlagsError(Exception):
    """Flags that do not make a run: said in one line, exit 2."""


def _stack_targets(args: argparse.Namespace, makers: dict[str, Callable[[], Target]]):
    """The gRPC stack (--url or --launch) and the in-process engine; returns the launched stack, if any."""
    from shardline.bench.stack_backend import StackBackend

    if args.base_url or args.compare_base_url:
        raise _FlagsError("--base-url and --compare-base-url need --backend openai")
    if not (args.url or args.launch or args.engine):
        raise _FlagsError("give --url, --launch and/or --engine")
    stack, engine = None, None
    if args.launch or args.engine:
        require_serve("bench --launch" if args.launch else "bench --engine")
        from gpu_worker_svc.server.serving import engine_config
        from gpu_worker_svc.server.settings import WorkerSettings
        from shardline.bench.engine_backend import EngineBackend
        from shardline.core.host_memory import reexec_with_malloc_env

        # The worker's own settings (its defaults and any SHARDLINE_* variables, as a launched stack's
        # worker reads them), so the engine runs exactly as it does inside the stack. Read before
        # anything starts: a bad variable must not leave a launched stack behind.
        settings = WorkerSettings(model=args.model, tracing=False)
        if args.engine and settings.resolved_device == "cpu" and getattr(args, "own_process", False):
            reexec_with_malloc_env()  # the engine then runs under a CPU worker's malloc settings
        if args.launch:
            env: dict[str, object] = {}
            if args.engine and settings.resolved_device != "cpu":
                # Both hold the GPU for the whole run: the stack's worker takes half the share, and the
                # engine's sizing counts the worker's memory as used by others.
                env["GPU_MEMORY_UTILIZATION"] = settings.gpu_memory_utilization / 2
            stack = _launch(args.model, env)
        if args.engine:
            config, gap = engine_config(settings), settings.resolved_admission_gap_s
            engine = lambda: EngineBackend(config, gap, settings.torch_threads)  # noqa: E731
    url = f"127.0.0.1:{stack.config.grpc_port}" if stack is not None else args.url
    if url:
        makers["stack"] = lambda: StackBackend(url)
    if engine is not None:
        makers["engine"] = engine
    return stack


def _openai_targets(args: argparse.Namespace, makers: dict[str, Callable[[], Target]]):
    """`base` (--base-url, or a launched stack's HTTP API) and `compare` (--compare-base-url), both
    through the same OpenAI client; returns the launched stack, if any."""

    if args.url or args.engine:
        raise _FlagsError("--backend openai takes --base-url, --compare-base-url and --launch, not --url or --engine")
    if bool(args.base_url) == bool(args.launch):
        raise _FlagsError(
            "--backend openai: give --base-url or --launch (a private stack as the base target), not both"
        )
    if args.launch:
        require_serve("bench --launch")
    detokenize = None
    if args.prompt_format == "text":
        require_serve("bench --prompt-format text (it reads the tokenizer)")
        from shardline.core.model_path import resolve_model_path
        from shardline.core.text.tokenizer import Tokenizer

        detokenize = Tokenizer.from_model_path(resolve_model_path(args.tokenizer)).decode
    stack = _launch(args.tokenizer) if args.launch else None
    urls = {"base": f"http://127.0.0.1:{stack.config.http_port}" if stack else args.base_url}
    if args.compare_base_url:
        urls["compare"] = args.compare_base_url
    for name, url in urls.items():
        makers[name] = functools.partial(OpenAIBackend, url, args.model, args.api_key, args.ignore_eos, detokenize)
    return stack


def _launch(model: str | None, env: dict[str, object] | None = None):
    from shardline.stack.local_stack import LocalStack, StackConfig

    return LocalStack(StackConfig.on_free_ports(model=model, env=env or {})).start()


def _compare(rounds: dict[str, list[dict]]) -> dict | None:
    """Stack against engine, or base against compare, round by round (each round's pair ran minutes
    apart at most), then the medians of the rounds' ratios."""
    pair = next((p for p in (("stack", "engine"), ("base", "compare")) if all(n in rounds for n in p)), None)
    if pair is None:
        return None
    a, b = pair
    # A round where either side completed nothing has no ratio (its failures are in the table).
    pairs = [(i, x, y) for i, (x, y) in enumerate(zip(rounds[a], rounds[b])) if x["completed"] and y["completed"]]
    if not pairs:
        print("\nno round completed requests on both sides: nothing to compare")
        return None
    ratios = [x["output_throughput"] / y["output_throughput"] for _, x, y in pairs]
    added = [x["ttft_ms"]["median"] - y["ttft_ms"]["median"] for _, x, y in pairs]
    tpot = [x["tpot_ms"]["median"] / y["tpot_ms"]["median"] if y["tpot_ms"]["median"] else None for _, x, y in pairs]
    if len(ratios) > 1:
        for (i, _, _), ratio, ms, t in zip(pairs, ratios, added, tpot):
            print(
                f"round {i + 1}: {a}/{b} output throughput {ratio:.3f}; added TTFT p50 {ms:+.1f} ms"
                + (f"; TPOT p50 ratio {t:.3f}" if t is not None else "")
            )
    print(
        f"\n{a}/{b} output throughput: {statistics.median(ratios):.3f} (range {min(ratios):.3f}-"
        f"{max(ratios):.3f}); added TTFT p50: {statistics.median(added):+.1f} ms (range {min(added):+.1f} to "
        f"{max(added):+.1f})"
    )
    tpots = [t for t in tpot if t is not None]
    if tpots:
        print(f"{a}/{b} TPOT p50: {statistics.median(tpots):.3f} (range {min(tpots):.3f}-{max(tpots):.3f})")
    return {
        "sides": [a, b],
        "output_throughput_ratio": statistics.median(ratios),
        "ratios": ratios,
        "added_ttft_p50_ms": statistics.median(added),
        "added_ttft_p50_ms_rounds": added,
        "tpot_p50_ratio": statistics.median(tpots) if tpots else None,
        "tpot_p50_ratios": tpot,
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
    rows: list[tuple[str, str, str | None]] = [
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
