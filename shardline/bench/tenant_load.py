"""Runs a multi-tenant workload: every tenant's arrivals at once, each through its own sender (its key)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from shardline.bench.load import SendFn
from shardline.bench.metrics import RequestTiming
from shardline.bench.tenant_workload import TenantSpec, TenantWorkload


@dataclass(slots=True)
class SentRequest:
    """One request of a tenant: when it left, relative to the run's start, and what it saw."""

    sent_at: float  # seconds from the run's start to just before it was sent
    timing: RequestTiming  # its chunks' times count from sent_at
    cancelled: bool = False  # still in flight at duration_s with drain off: the benchmark ended it
    ended_at: float | None = None  # seconds from the run's start to its end: finished, failed or cancelled

    @property
    def first_token_at(self) -> float | None:
        return self.sent_at + self.timing.ttft if self.timing.chunk_times else None


@dataclass(slots=True)
class TenantRun:
    """What a workload's run sent, per tenant in the workload's order, and how long it took."""

    requests: dict[str, list[SentRequest]] = field(default_factory=dict)
    wall_s: float = 0.0  # from the start to the last request's end (or to duration_s, when cancelled)


def arrival_offsets(tenant: TenantSpec, duration_s: float, seed: int) -> list[float]:
    """An open-loop tenant's send times within [0, duration_s): gamma gaps of shape `burstiness` with
    mean 1 / request_rate, as vLLM's benchmark draws them; capped at max_requests."""
    assert tenant.request_rate is not None
    rng = random.Random(seed)
    scale = 1.0 / (tenant.request_rate * tenant.burstiness)
    cap = tenant.max_requests or float("inf")
    t, out = 0.0, list[float]()
    while t < duration_s and len(out) < cap:
        out.append(t)
        t += rng.gammavariate(tenant.burstiness, scale)
    return out


def tenant_seed(workload: TenantWorkload, index: int) -> int:
    """A tenant's own seed: its arrivals and prompts stay the same whatever the other tenants do, so
    two runs of one workload (FIFO and fair, say) offer exactly the same load."""
    return workload.seed * 1009 + index * 7919


async def run_tenants(
    workload: TenantWorkload, senders: dict[str, SendFn], vocab_size: int, label: str = ""
) -> TenantRun:
    """Every tenant's load at once, through `senders[tenant name]`; returns every request sent."""
    loads = _TenantLoads(workload, senders, vocab_size, tqdm(desc=label, unit="req", leave=False))
    try:
        await loads.run()
    finally:
        loads.bar.close()
    loads.result.wall_s = time.perf_counter() - loads.t0
    return loads.result


class _TenantLoads:
    """One run of a workload: each tenant's open or closed loop, and what each request did."""

    def __init__(self, workload: TenantWorkload, senders: dict[str, SendFn], vocab_size: int, bar: tqdm) -> None:
        self.workload = workload
        self.senders = senders
        self.vocab_size = vocab_size
        self.bar = bar
        self.result = TenantRun({t.name: [] for t in workload.tenants})
        self.t0 = time.perf_counter()

    async def run(self) -> None:
        workload = self.workload
        loads = [
            asyncio.create_task(self._open_loop(t, i) if t.request_rate is not None else self._closed_loop(t, i))
            for i, t in enumerate(workload.tenants)
        ]
        if workload.drain:
            await asyncio.gather(*loads)
            return
        done, _ = await asyncio.wait(loads, timeout=max(0.0, self.t0 + workload.duration_s - time.perf_counter()))
        for task in loads:  # cancels the requests in flight too: each load passes it on
            task.cancel()
        await asyncio.gather(*loads, return_exceptions=True)
        for task in done:
            task.result()  # a load that crashed (not one that was cancelled) says so

    async def _one(self, tenant: TenantSpec, rng: random.Random) -> None:
        # Random ids above the lowest, where special tokens live; each request its own, so that no
        # prefix cache serves one request's prompt from another's.
        prompt = [rng.randrange(100, self.vocab_size) for _ in range(tenant.input_len)]
        sent = SentRequest(time.perf_counter() - self.t0, RequestTiming(input_len=tenant.input_len))
        self.result.requests[tenant.name].append(sent)
        try:
            await self.senders[tenant.name](prompt, tenant.output_len, sent.timing)
        except asyncio.CancelledError:
            sent.cancelled = True
            raise
        except Exception as exc:  # a failed request is a result of the benchmark, not a crash of it
            sent.timing.ok, sent.timing.error = False, f"{type(exc).__name__}: {exc}"
        finally:
            sent.ended_at = time.perf_counter() - self.t0
        self.bar.update(1)

    async def _open_loop(self, tenant: TenantSpec, index: int) -> None:
        seed = tenant_seed(self.workload, index)
        rng = random.Random(seed + 1)
        tasks: list[asyncio.Task] = []
        try:
            for offset in arrival_offsets(tenant, self.workload.duration_s, seed):
                await asyncio.sleep(max(0.0, self.t0 + offset - time.perf_counter()))
                tasks.append(asyncio.create_task(self._one(tenant, rng)))
            await asyncio.gather(*tasks)
        finally:
            await _cancel(tasks)

    async def _closed_loop(self, tenant: TenantSpec, index: int) -> None:
        rng = random.Random(tenant_seed(self.workload, index) + 1)
        budget = [tenant.max_requests or float("inf")]

        async def client() -> None:
            while time.perf_counter() - self.t0 < self.workload.duration_s and budget[0] > 0:
                budget[0] -= 1
                await self._one(tenant, rng)

        clients = [asyncio.create_task(client()) for _ in range(tenant.concurrency or 1)]
        try:
            await asyncio.gather(*clients)
        finally:
            await _cancel(clients)


async def _cancel(tasks: list[asyncio.Task]) -> None:
    """Ends the tasks still running (a cancelled load's requests, so that the server stops them too)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
