"""`shardline bench --tenants FILE`: a multi-tenant load, reported per tenant, with fairness and goodput."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable

from shardline.bench.load import LoadSpec, SendFn, Target, model_vocab_size, run_load
from shardline.bench.openai_backend import OpenAIBackend
from shardline.bench.stack_backend import StackBackend
from shardline.bench.tenant_load import SentRequest, TenantRun, run_tenants
from shardline.bench.tenant_report import print_report, workload_report
from shardline.bench.tenant_workload import TenantSpec, TenantWorkload, load_workload
from shardline.cli.serve_extra import require_serve


class TenantFlagsError(ValueError):
    """Flags that do not make a multi-tenant run: one line, exit 2."""


def run_tenant_bench(args: argparse.Namespace) -> int:
    """Runs the workload of --tenants once against one target, prints its report (or JSON), writes --out."""
    workload = load_workload(args.tenants)
    _check_flags(args, workload)
    stack = _launch(args) if args.launch else None
    try:
        if args.backend == "openai":
            url = f"http://127.0.0.1:{stack.config.http_port}" if stack else args.base_url
        else:
            url = f"127.0.0.1:{stack.config.grpc_port}" if stack else args.url
        vocab = model_vocab_size(args.tokenizer if args.backend == "openai" else args.model)
        run, target = asyncio.run(_measure(args, workload, _backend_maker(args, url), vocab))
    finally:
        if stack is not None:
            stack.stop()
    report = workload_report(workload, run) | {"target": target}
    print_report(report)
    print(f"target: {target}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    detail = {name: [_detail(r) for r in requests] for name, requests in run.requests.items()}
    args.out.write_text(json.dumps({"workload": str(args.tenants), "report": report, "detail": detail}, indent=2))
    print(f"\nwrote {args.out}")
    return 0


def _check_flags(args: argparse.Namespace, workload: TenantWorkload) -> None:
    if args.compare_base_url or args.engine:
        raise TenantFlagsError("--tenants runs one target: not with --compare-base-url or --engine")
    if args.rounds != 1:
        raise TenantFlagsError("--tenants runs one round (benchmarks/tenant_fairness.py alternates configurations)")
    if args.backend == "openai" and bool(args.base_url) == bool(args.launch):
        raise TenantFlagsError("--tenants with --backend openai: give --base-url or --launch, one of them")
    if args.backend == "stack":
        if bool(args.url) == bool(args.launch):
            raise TenantFlagsError("--tenants with --backend stack: give --url or --launch, one of them")
        # The gRPC client sends a priority and a key, but no TTFT target (GenerateRequest has one;
        # the SDK does not set it yet): better refused than measured without.
        if any(t.ttft_target_ms is not None or t.refuse_late is not None for t in workload.tenants):
            raise TenantFlagsError("ttft_target_ms and refuse_late go over HTTP only: use --backend openai")


def _backend_maker(args: argparse.Namespace, url: str) -> Callable[[TenantSpec], Target]:
    """A function from a tenant to its own backend: its key, its extension fields."""
    if args.backend == "openai":
        return lambda t: OpenAIBackend(url, args.model, t.api_key, args.ignore_eos, extra_body=t.body_fields())
    return lambda t: StackBackend(url, t.api_key, t.priority or 0)


async def _measure(
    args: argparse.Namespace, workload: TenantWorkload, make: Callable[[TenantSpec], Target], vocab: int | None
) -> tuple[TenantRun, str]:
    backends: dict[str, Target] = {}
    try:
        for t in workload.tenants:  # inside the loop: gRPC channels belong to the loop that creates them
            backends[t.name] = make(t)
        first = backends[workload.tenants[0].name]
        if size := await first.vocab_size():  # prompts are random ids: ids the served model has
            vocab = min(vocab or size, size)
        if vocab is None:
            raise TenantFlagsError(
                "the server does not say its vocabulary size, and reading --tokenizer's needs the services "
                "(pip install 'shardline[serve]')"
            )
        target = (
            f"{first.root}, model {first.model}" if isinstance(first, OpenAIBackend) else str(args.url or "launched")
        )
        # A few requests first, each tenant's key: a server's first requests pay for its warm-up, and a
        # key the server refuses shows here rather than as a run of failures.
        for name, backend in backends.items():
            warm = LoadSpec(num_prompts=2, input_len=16, output_len=4, seed=args.seed + 100, vocab_size=vocab)
            timings, _ = await run_load(warm, backend.send, f"{name} warm-up")
            if failed := [t.error for t in timings if not t.ok]:
                print(f"{name} warm-up: {len(failed)} of {len(timings)} requests failed, first with {failed[0]}")
        senders: dict[str, SendFn] = {name: b.send for name, b in backends.items()}
        return await run_tenants(workload, senders, vocab, "tenants"), target
    finally:
        for backend in backends.values():
            await backend.close()


def _launch(args: argparse.Namespace):
    require_serve("bench --launch")
    from shardline.stack.local_stack import LocalStack, StackConfig

    model = args.tokenizer if args.backend == "openai" else args.model
    return LocalStack(StackConfig.on_free_ports(model=model)).start()


def _detail(r: SentRequest) -> dict:
    """One request as sent and seen, in ms from the run's start, so that every figure can be recomputed."""
    t = r.timing
    return {
        "sent_at_ms": round(r.sent_at * 1000, 3),
        "ended_at_ms": round(r.ended_at * 1000, 3) if r.ended_at is not None else None,
        "chunk_ms": [round(x * 1000, 3) for x in t.chunk_times],
        "input_len": t.input_len,
        "output_len": t.output_len,
        "status": t.status or None,
        "cancelled": r.cancelled,
        "error": t.error or None,
    }
