"""The gateway's /metrics: its request metrics, per model and per tenant, and the scheduler's, read at scrape time.

The scheduler and workers export their gauges on metrics ports of their own (compose
sets them), but `shardline up` opens none, and a gateway exporting those gauges
from its own registry would show zeros it never sets. So the gateway leaves them
out of its registry and asks the scheduler for the live figures on each scrape:
its /metrics is then the whole stack's page, in the manner of vLLM's one /metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

import grpc
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.tenancy.tenants import DEFAULT_TENANT
from shardline.core.errors import ShardlineError
from shardline.proto import scheduler_pb2, scheduler_pb2_grpc
from tracing.metrics import (
    AUTOSCALER_DESIRED,
    AUTOSCALER_FORECAST,
    AUTOSCALER_READY,
    FAILOVERS,
    KV_BLOCKS_USED,
    KV_CACHE_USAGE,
    MODEL_BANDWIDTH_UTILIZATION,
    MODEL_FLOPS_UTILIZATION,
    MODEL_LABEL,
    QUEUE_DEPTH,
    RUNNING_REQUESTS,
    STEP_DURATION,
    TOKENS_PER_SECOND,
)

# Token and request counts per scheduler request (each of n choices is one), as vLLM's
# vllm:prompt_tokens_total, vllm:generation_tokens_total and vllm:request_success_total.
PROMPT_TOKENS = Counter("shardline_prompt_tokens", "Prompt tokens of ended requests.", [MODEL_LABEL])
GENERATION_TOKENS = Counter("shardline_generation_tokens", "Tokens generated for ended requests.", [MODEL_LABEL])
REQUESTS = Counter(
    "shardline_requests",
    "Requests ended, by finish reason (stop, length, abort, timeout, error).",
    [MODEL_LABEL, "finish_reason"],
)

# The same per tenant, the tenant a request counts against (gateway/tenancy/tenants.py): names from the tenants
# file, or "default", so the label stays bounded. The TTFT histogram and the SLO outcomes (met,
# missed, refused; gateway/runner/request_metrics.py) give a tenant's attainment of its TTFT targets.
TENANT_REQUESTS = Counter(
    "shardline_tenant_requests", "Requests ended, per tenant, by finish reason.", ["tenant", "finish_reason"]
)
TENANT_PROMPT_TOKENS = Counter("shardline_tenant_prompt_tokens", "Prompt tokens of ended requests.", ["tenant"])
TENANT_GENERATION_TOKENS = Counter(
    "shardline_tenant_generation_tokens", "Tokens generated for ended requests.", ["tenant"]
)
TENANT_TIME_TO_FIRST_TOKEN = Histogram(
    "shardline_tenant_time_to_first_token_seconds",
    "Time from request arrival to the first generated token, per tenant.",
    ["tenant"],
    # gen_ai_server_time_to_first_token_seconds's buckets, so the two read alike
    buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
)
TENANT_SLO_REQUESTS = Counter(
    "shardline_tenant_slo_requests",
    "Ended requests that had a TTFT target, by outcome: met, missed, or refused as late (SLO_UNMET).",
    ["tenant", "outcome"],
)

SCRAPE_TIMEOUT_S = 2.0
# Gauges the scheduler and workers set in their own processes; here they come from the scheduler.
_SCALE_GAUGES = (AUTOSCALER_DESIRED, AUTOSCALER_READY, AUTOSCALER_FORECAST)
# The engine steps' and the dispatcher's own, which only workers and the scheduler export: a gateway's would read 0.
_NOT_HERE = (KV_BLOCKS_USED, STEP_DURATION, MODEL_FLOPS_UTILIZATION, MODEL_BANDWIDTH_UTILIZATION, FAILOVERS)
_ELSEWHERE = frozenset(
    next(iter(g.describe())).name
    for g in (QUEUE_DEPTH, RUNNING_REQUESTS, KV_CACHE_USAGE, TOKENS_PER_SECOND, *_SCALE_GAUGES, *_NOT_HERE)
)


class _OwnMetrics(Collector):
    """This process's registry without the gauges that other services set."""

    def collect(self) -> Iterator[Metric]:
        return (metric for metric in REGISTRY.collect() if metric.name not in _ELSEWHERE)


class _SchedulerView(Collector):
    def __init__(self, stats: scheduler_pb2.SchedulerStats, pool: scheduler_pb2.ListWorkersResponse) -> None:
        self._stats, self._pool = stats, pool

    def collect(self) -> Iterator[Metric]:
        yield _gauge(QUEUE_DEPTH, sum(self._stats.queue_depth.values()))
        yield _gauge(RUNNING_REQUESTS, self._stats.running)
        yield _tenant_queue_depth(self._stats)
        yield GaugeMetricFamily(
            "shardline_workers_alive", "Live workers in the scheduler's registry.", self._stats.workers
        )
        kv = _gauge(KV_CACHE_USAGE, labels=["worker_id"])
        for state in self._pool.workers:
            if state.alive:
                kv.add_metric([state.worker.worker_id], state.kv_blocks_used / max(1, state.worker.kv_blocks_total))
        yield kv
        yield from _autoscaler(self._stats)


def _autoscaler(stats: scheduler_pb2.SchedulerStats) -> Iterator[GaugeMetricFamily]:
    """The autoscaler's desired and ready workers and forecast per model, as the scheduler's own
    /metrics has them (what a KEDA ScaledObject follows); nothing while autoscaling is off."""
    families = [_gauge(gauge, labels=["model"]) for gauge in _SCALE_GAUGES]
    for scale in stats.scale:
        for family, value in zip(families, (scale.desired, scale.ready, scale.forecast_rps)):
            family.add_metric([scale.model], value)
    yield from families


def _tenant_queue_depth(stats: scheduler_pb2.SchedulerStats) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        "shardline_tenant_queue_depth", "Requests waiting in the scheduler's queue, per tenant.", labels=["tenant"]
    )
    depths: dict[str, int] = {}
    for tenant, depth in stats.queue_depth_by_tenant.items():
        # A request from a gateway that names no tenant is the default tenant's, as the gateway names it.
        name = tenant or DEFAULT_TENANT.name
        depths[name] = depths.get(name, 0) + depth
    for name, depth in sorted(depths.items()):
        family.add_metric([name], depth)
    return family


def _gauge(like: Gauge, value: float | None = None, labels: list[str] | None = None) -> GaugeMetricFamily:
    """A family named and documented as `like`, one of the gauges the scheduler and workers set."""
    described = next(iter(like.describe()))
    return GaugeMetricFamily(described.name, described.documentation, value, labels)


class _Batches(Collector):
    def __init__(self, counts: dict[str, int]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("shardline_batches", "Batches of the Batch API, by status.", labels=["status"])
        for status, count in sorted(self._counts.items()):
            family.add_metric([status], count)
        yield family


def metrics_handler(
    scheduler: scheduler_pb2_grpc.SchedulerStub, batch_counts: Callable[[], Awaitable[dict[str, int]]] | None = None
):
    """aiohttp handler for the gateway's /metrics; without the scheduler it serves its own metrics alone.
    `batch_counts`: the batches by status, when the Batch API is on."""

    async def handle(_request: web.Request) -> web.Response:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_OwnMetrics())
        if batch_counts is not None:
            try:
                registry.register(_Batches(await asyncio.wait_for(batch_counts(), SCRAPE_TIMEOUT_S)))
            except (ShardlineError, TimeoutError):
                pass  # Redis away: the page goes out without them
        try:
            stats, pool = await asyncio.gather(
                scheduler.GetStats(scheduler_pb2.GetStatsRequest(), timeout=SCRAPE_TIMEOUT_S),
                scheduler.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=SCRAPE_TIMEOUT_S),
            )
            registry.register(_SchedulerView(stats, pool))
        except grpc.aio.AioRpcError:
            pass
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handle
