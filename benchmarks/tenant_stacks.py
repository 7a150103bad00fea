"""What the tenant benchmarks share: a private stack per queue order with a tenants file, its capacity,
and one multi-tenant run on it through `shardline bench`'s tenant load."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import yaml

from shardline.bench.openai_backend import OpenAIBackend
from shardline.bench.stack_backend import StackBackend
from shardline.bench.tenant_load import TenantRun, run_tenants
from shardline.bench.tenant_report import workload_report
from shardline.bench.tenant_workload import TenantSpec, TenantWorkload
from shardline.stack.local_stack import LocalStack, StackConfig

logger = logging.getLogger("tenant_stacks")


@dataclass(slots=True)
class StackTenant:
    """A tenant as the server's tenants file knows it; its key is made here and only its digest written."""

    name: str
    weight: float = 1.0
    priority: int = 0
    key: str = field(default_factory=lambda: f"sk-{secrets.token_hex(16)}")


def write_results(out: Path, result: dict, table: str) -> None:
    """The run's JSON and its table (.md beside it), and the table on the console."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    print(f"\nwrote {out} and {out.with_suffix('.md')}")


def write_tenants_file(path: Path, tenants: list[StackTenant]) -> None:
    """SHARDLINE_TENANTS_FILE as gateway/tenancy/tenants.py documents it: keys as sha256 hex digests."""
    entries = {
        t.name: {"weight": t.weight, "priority": t.priority, "keys": [hashlib.sha256(t.key.encode()).hexdigest()]}
        for t in tenants
    }
    path.write_text(yaml.safe_dump({"tenants": entries}))


def start_stack(tmp: Path, name: str, tenants_file: Path, queue_order: str, env: dict[str, object]) -> LocalStack:
    """A private stack whose scheduler orders its queue by `queue_order` (fair or fifo)."""
    settings = {"TENANTS_FILE": str(tenants_file), "QUEUE_ORDER": queue_order, **env}
    config = StackConfig.on_free_ports(
        data_dir=tmp / name, log_dir=tmp / name / "logs", env={k: str(v) for k, v in settings.items()}
    )
    t0 = time.perf_counter()
    stack = LocalStack(config).start(timeout_s=300)
    logger.info("%s stack (queue order %s) up in %.1f s", name, queue_order, time.perf_counter() - t0)
    return stack


def wait_idle(stack: LocalStack, timeout_s: float = 120.0) -> float:
    """Waits until the scheduler has nothing queued or running (the requests a cancelled round left are
    gone), so that the next round starts on an idle stack; returns how long that took."""
    from shardline.proto import scheduler_pb2, scheduler_pb2_grpc

    t0 = time.perf_counter()
    with grpc.insecure_channel(f"127.0.0.1:{stack.config.scheduler_port}") as channel:
        scheduler = scheduler_pb2_grpc.SchedulerStub(channel)
        while time.perf_counter() - t0 < timeout_s:
            stats = scheduler.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
            if not sum(stats.queue_depth.values()) and not stats.running:
                return time.perf_counter() - t0
            time.sleep(0.5)
    raise TimeoutError(f"the stack still had requests {timeout_s:.0f} s after a round")


async def _vocab(stack: LocalStack, key: str | None) -> int:
    backend = StackBackend(f"127.0.0.1:{stack.config.grpc_port}", key)
    try:
        return await backend.vocab_size()
    finally:
        await backend.close()


async def _run(stack: LocalStack, workload: TenantWorkload, label: str) -> TenantRun:
    url = f"http://127.0.0.1:{stack.config.http_port}"
    vocab = await _vocab(stack, workload.tenants[0].api_key)
    backends = {t.name: OpenAIBackend(url, None, t.api_key, extra_body=t.body_fields()) for t in workload.tenants}
    try:
        for backend in backends.values():  # names the model (GET /v1/models) before the clock starts
            await backend.vocab_size()
        return await run_tenants(workload, {n: b.send for n, b in backends.items()}, vocab, label)
    finally:
        for backend in backends.values():
            await backend.close()


def run_workload(stack: LocalStack, workload: TenantWorkload, label: str) -> dict:
    """One run of `workload` on `stack`, then a wait until the stack is idle; returns the tenant report."""
    run = asyncio.run(_run(stack, workload, label))
    report = workload_report(workload, run)
    report["idle_after_s"] = wait_idle(stack)
    return report


def capacity(stack: LocalStack, key: str, input_len: int, output_len: int, concurrency: int, seconds: float) -> float:
    """Requests per second the stack serves saturated (a closed loop of `concurrency`), from the VTC
    tokens it served in the run's second half, over one request's."""
    tenant = TenantSpec("probe", key, concurrency=concurrency, input_len=input_len, output_len=output_len)
    workload = TenantWorkload([tenant], duration_s=seconds, measure_from_s=seconds / 2, drain=False)
    report = run_workload(stack, workload, "capacity")
    return report["tenants"]["probe"]["weighted_throughput"] / (input_len + 2 * output_len)


def with_seed(workload: TenantWorkload, seed: int) -> TenantWorkload:
    """The same workload on fresh arrivals and prompts: each round its own, the same for both sides."""
    return replace(workload, seed=seed)


def median_range(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"
