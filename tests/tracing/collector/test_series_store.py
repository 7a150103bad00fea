"""The collector's time series against a real Redis: what spans add, reads at any step, retention."""

import math
import random
import time

import redis

from tests.tracing.collector.fake_request import SpanFactory
from tests.tracing.collector.series_load import ManualClock, at, request, worker_steps
from tests.tracing.collector.served_request import MODEL, to_otlp
from tests.tracing.run_async import run_async
from tracing import attributes as attr
from tracing.collector import latency_histogram
from tracing.collector.series_store import PREFIX, Resolution, SeriesStore
from tracing.collector.span_store import SpanStore
from tracing.collector.stored_span import StoredSpan

# A minute past the next round hour, so that buckets of every resolution start on the minute. The stores
# run on a clock of the test's; Redis expires buckets by a time to live counted from that clock.
NOW = math.ceil(time.time() / 3600) * 3600 + 60.0
RESOLUTIONS = (Resolution(1, 600), Resolution(10, 7200), Resolution(60, 86400))


def stores(redis_url: str, clock: ManualClock, resolutions=RESOLUTIONS) -> SpanStore:
    client = redis.asyncio.Redis.from_url(redis_url)
    series = SeriesStore(client, resolutions, clock=clock)
    return SpanStore(client, max_spans=1_000_000, max_age_s=1e12, series=series)


def by_key(read: dict) -> dict[tuple, list]:
    return {(s["name"], tuple(sorted(s["labels"].items())), s["stat"]): s["values"] for s in read["series"]}


async def add(store: SpanStore, spans: list[StoredSpan]) -> None:
    await store.add(to_otlp(spans))


@run_async
async def test_requests_and_steps_become_rates_latencies_and_worker_gauges(redis_url: str) -> None:
    clock = ManualClock(NOW + 5)
    store = stores(redis_url, clock)
    f = SpanFactory()
    try:
        spans = request(f, "r-1", "acme", 40.0) + request(f, "r-2", "acme", 80.0, at_ms=200)
        spans += request(f, "r-3", "zeta", 400.0, at_ms=400)
        spans += worker_steps(f, "worker-0", 0, 990) + worker_steps(f, "worker-1", 0, 490)
        await add(store, at(spans, NOW))
        assert store.series is not None
        read = (
            await store.series.read(
                ["requests", "output_tokens", "ttft_ms", "running", "kv_blocks_used", "worker_tokens", "queue_depth"],
                NOW,
                NOW + 1,
                1,
            )
        ).to_json()
    finally:
        await store.close()
    values = by_key(read)
    assert read["times"] == [NOW, NOW + 1] and read["step_s"] == 1 and read["resolution_s"] == 1
    acme, zeta = (("model", MODEL), ("tenant", "acme")), (("model", MODEL), ("tenant", "zeta"))
    assert values["requests", acme, "rate"] == [2.0, 0.0]
    assert values["requests", zeta, "rate"] == [1.0, 0.0]
    assert values["output_tokens", acme, "rate"] == [16.0, 0.0]
    p50, p99 = values["ttft_ms", (("model", MODEL),), "p50"][0], values["ttft_ms", (("model", MODEL),), "p99"][0]
    assert abs(p50 - 80) / 80 < 0.1 and abs(p99 - 400) / 400 < 0.1
    # Steps 10 ms long, counted at their end: 99 of worker-0 and 49 of worker-1 in the first second, 2 tokens each.
    assert values["worker_tokens", (("worker", "worker-0"),), "rate"] == [198.0, 0.0]
    assert values["worker_tokens", (("worker", "worker-1"),), "rate"] == [98.0, 0.0]
    # The scheduler's requests in flight, on each request's queue span (3) and dispatch span (4).
    assert values["running", (), "mean"] == [3.5, None] and values["running", (), "max"] == [4.0, None]
    assert values["kv_blocks_used", (("worker", "worker-0"),), "max"][0] == 10 + 98
    assert values["queue_depth", (), "max"] == [2.0, None]


@run_async
async def test_refusals_failures_and_failovers_have_their_own_series(redis_url: str) -> None:
    clock = ManualClock(NOW + 5)
    store = stores(redis_url, clock)
    f = SpanFactory()
    try:
        refused = f.span(
            "gateway.request",
            "gateway",
            "gateway-0",
            0,
            1,
            **{attr.REQUEST_ID: "r-429", attr.TENANT: "acme", attr.HTTP_STATUS: 429},
        )
        refused.error = "over the tenant's limit"
        failed = f.span(
            "gateway.request",
            "gateway",
            "gateway-0",
            0,
            300,
            **{attr.REQUEST_ID: "r-err", attr.TENANT: "acme", attr.GEN_AI_RESPONSE_FINISH_REASONS: ["error"]},
        )
        failover = f.span(
            "dispatch",
            "scheduler",
            "scheduler",
            100,
            101,
            **{attr.REQUEST_ID: "r-err", attr.ATTEMPT: 2, attr.WORKER_ID: "worker-1", attr.QUEUE_DEPTH: 0},
        )
        first = f.span(
            "dispatch",
            "scheduler",
            "scheduler",
            10,
            11,
            **{attr.REQUEST_ID: "r-err", attr.ATTEMPT: 1, attr.WORKER_ID: "worker-0", attr.QUEUE_DEPTH: 0},
        )
        await add(store, at([refused, failed, failover, first], NOW))
        assert store.series is not None
        read = (await store.series.read(["rejected", "errors", "failovers", "requests"], NOW, NOW, 1)).to_json()
    finally:
        await store.close()
    values = by_key(read)
    assert values["rejected", (("tenant", "acme"),), "rate"] == [1.0]
    assert values["errors", (("model", ""), ("tenant", "acme")), "rate"] == [1.0]  # the 429 is not an error
    assert values["failovers", (("worker", "worker-1"),), "rate"] == [1.0]
    assert len([k for k in values if k[0] == "failovers"]) == 1  # a first dispatch is no failover
    assert values["requests", (("model", ""), ("tenant", "acme")), "rate"] == [2.0]


@run_async
async def test_a_downsampled_p99_is_the_p99_of_the_seconds_it_merges(redis_url: str) -> None:
    clock = ManualClock(NOW + 61)
    store = stores(redis_url, clock)
    f = SpanFactory()
    rng = random.Random(7)
    ttfts = [rng.lognormvariate(4, 1) for _ in range(300)]
    try:
        spans = [s for i, ttft in enumerate(ttfts) for s in request(f, f"r-{i}", "acme", ttft, at_ms=i * 199)]
        await add(store, at(spans, NOW))
        assert store.series is not None
        minutes_only = SeriesStore(redis.asyncio.Redis.from_url(redis_url), (Resolution(60, 86400),), clock=clock)
        coarse = await minutes_only.read(["ttft_ms", "requests"], NOW, NOW + 59, 60)
        seconds_only = SeriesStore(redis.asyncio.Redis.from_url(redis_url), (Resolution(1, 600),), clock=clock)
        fine = (await seconds_only.read(["ttft_ms", "requests"], NOW, NOW + 59, 60)).to_json()
    finally:
        await store.close()
    assert fine["resolution_s"] == 1 and coarse.resolution_s == 60
    fine_values, coarse_values = by_key(fine), by_key(coarse.to_json())
    key = ("ttft_ms", (("model", MODEL),), "p99")
    assert fine_values[key] == coarse_values[key]  # 60 one-second buckets merge into the minute's bucket
    exact = sorted(ttfts)[math.ceil(0.99 * len(ttfts)) - 1]
    assert abs(fine_values[key][0] - exact) / exact <= 2 ** (1 / latency_histogram.BUCKETS_PER_DOUBLING / 2) - 1
    requests = fine_values["requests", (("model", MODEL), ("tenant", "acme")), "rate"]
    assert requests == [300 / 60]


def series_keys(client: redis.Redis) -> dict[str, list[float]]:
    """Bucket starts per resolution index, read straight from Redis."""
    return {
        index.decode(): [float(s) for s in client.zrange(index, 0, -1)] for index in client.scan_iter(f"{PREFIX}*s")
    }


def series_bytes(client: redis.Redis) -> int:
    return sum(client.memory_usage(key) or 0 for key in client.scan_iter(f"{PREFIX}*"))


@run_async
async def test_ten_minutes_of_load_keep_memory_bounded_and_drop_old_buckets(redis_url: str) -> None:
    """10 minutes of simulated load, a span batch per second: 4 workers stepping every 100 ms, 5
    requests a second of 2 tenants. The clock moves with the load; nothing waits."""
    short = (Resolution(1, 60), Resolution(10, 300), Resolution(60, 3600))
    clock = ManualClock(NOW)
    store = stores(redis_url, clock, short)
    sync = redis.Redis.from_url(redis_url)
    f = SpanFactory()
    sizes: dict[int, int] = {}
    try:
        for second in range(600):
            clock.now_s = NOW + second + 1
            spans = [s for w in range(4) for s in worker_steps(f, f"worker-{w}", 0, 1000, step_ms=100)]
            for r in range(5):
                spans += request(f, f"r-{second}-{r}", ("acme", "zeta")[r % 2], 50.0 + r, at_ms=r * 150)
            await add(store, at(spans, NOW + second))
            if (second + 1) % 60 == 0:
                sizes[(second + 1) // 60] = series_bytes(sync)
        # A late span older than every retention is left out, not written into a dropped bucket.
        assert store.series is not None
        late = request(f, "r-late", "acme", 10.0)
        await add(store, at(late, NOW - 7200))
        kept = series_keys(sync)
        read = (await store.series.read(["requests"], clock.now_s - 30, clock.now_s, 1)).to_json()
    finally:
        await store.close()
        sync.close()
    now = clock.now_s
    for resolution in short:
        starts = kept[f"{PREFIX}{resolution.step_s}s"]
        assert len(starts) <= resolution.retention_s / resolution.step_s + 2
        assert min(starts) >= now - resolution.retention_s - resolution.step_s
    assert min(kept[f"{PREFIX}60s"]) == NOW  # its hour is not over: nothing dropped
    # The 1 s and 10 s resolutions are full after 5 minutes; only the 60 s one grows, a bucket a minute.
    print("series bytes by minute:", sizes)
    assert sizes[10] < sizes[6] * 1.25, sizes
    assert sizes[10] < 3_000_000, sizes
    values = by_key(read)
    assert values["requests", (("model", MODEL), ("tenant", "acme")), "rate"][-2] == 3.0


@run_async
async def test_a_read_picks_the_finest_resolution_that_still_holds_its_start(redis_url: str) -> None:
    clock = ManualClock(NOW + 3600)
    store = SeriesStore(redis.asyncio.Redis.from_url(redis_url), RESOLUTIONS, clock=clock)
    try:
        assert store.resolution_for(clock.now_s - 60).step_s == 1
        assert store.resolution_for(clock.now_s - 3000).step_s == 10
        assert store.resolution_for(clock.now_s - 9000).step_s == 60
        assert store.resolution_for(clock.now_s - 10 * 86400).step_s == 60
        # A minute read as one step that does not start on the minute holds exactly that minute.
        minute = await store.read(["requests"], clock.now_s - 89.5, clock.now_s - 30.5, 60)
        assert (minute.resolution_s, minute.step_s, minute.times) == (1, 60, [int(clock.now_s - 90)])
        read = await store.read(["requests"], clock.now_s - 3000, clock.now_s, 25)
        assert (read.step_s, read.resolution_s) == (30, 10)  # the step rounded up to whole buckets
    finally:
        await store._redis.aclose()


@run_async
async def test_a_label_value_holding_a_separator_reads_back_without_it(redis_url: str) -> None:
    clock = ManualClock(NOW + 5)
    store = stores(redis_url, clock)
    f = SpanFactory()
    try:
        await add(store, at(request(f, "r-1", "a\x1fb\x1ec", 40.0), NOW))
        assert store.series is not None
        read = (await store.series.read(["requests"], NOW, NOW, 1)).to_json()
    finally:
        await store.close()
    assert by_key(read) == {("requests", (("model", MODEL), ("tenant", "abc")), "rate"): [1.0]}
