"""The dashboard's time-view API on a real port and a real Redis: /api/series and /api/requests?from=&to=."""

import math
import time

import aiohttp

from tests.tracing.collector.fake_request import SpanFactory
from tests.tracing.collector.series_load import at, request, worker_steps
from tests.tracing.collector.served_request import MODEL, to_otlp
from tests.tracing.collector.test_dashboard_app import dashboard
from tests.tracing.run_async import run_async
from tracing.collector.series_store import Resolution
from tracing.collector.span_store import SpanStore

RESOLUTIONS = (Resolution(1, 600), Resolution(10, 7200), Resolution(60, 86400))


async def stored(redis_url: str, now: float) -> SpanStore:
    """Three requests, 0.1 s, 2.1 s and 4.1 s after ``now - 10``, and a worker stepping through them."""
    store = SpanStore.from_url(redis_url, max_spans=100_000, max_age_s=1e9, series=RESOLUTIONS)
    f = SpanFactory()
    spans = [
        *request(f, "r-0", "acme", 40.0, at_ms=100),
        *request(f, "r-1", "acme", 60.0, at_ms=2100),
        *request(f, "r-2", "zeta", 900.0, at_ms=4100),
        *worker_steps(f, "worker-0", 0, 5000),
    ]
    await store.add(to_otlp(at(spans, now - 10)))
    return store


async def answer(http: aiohttp.ClientSession, url: str) -> tuple[int, dict | str]:
    async with http.get(url) as response:
        body = await response.json() if response.status == 200 else await response.text()
        return response.status, body


@run_async
async def test_series_api_gives_each_series_a_value_per_step(redis_url: str) -> None:
    now = float(math.floor(time.time()))  # whole seconds: each request falls in the bucket it is meant for
    store = await stored(redis_url, now)
    start = int(now - 10)
    try:
        async with dashboard(store) as (base, http):
            status, body = await answer(
                http, f"{base}/api/series?names=requests,ttft_ms,running&from={start}&to={start + 5}&step=1"
            )
            status_all, everything = await answer(http, f"{base}/api/series")
    finally:
        await store.close()
    assert status == 200 and status_all == 200, body
    assert isinstance(body, dict) and isinstance(everything, dict)
    assert body["times"] == list(range(start, start + 6)) and body["step_s"] == 1
    rows = {(s["name"], s["labels"].get("tenant", ""), s["stat"]): s["values"] for s in body["series"]}
    # Each request ends 100 ms after it starts: r-0 and r-1 in the acme series, r-2 in zeta's.
    assert sum(rows["requests", "acme", "rate"]) == 2 and sum(rows["requests", "zeta", "rate"]) == 1
    assert rows["requests", "acme", "rate"][0] == 1 and rows["requests", "acme", "rate"][2] == 1
    p99 = [v for v in rows["ttft_ms", "", "p99"] if v is not None]
    assert len(p99) == 3 and abs(max(p99) - 900) / 900 < 0.1
    # The scheduler's in-flight count, on each request's queue span (3) and dispatch span (4).
    assert rows["running", "", "mean"][:5] == [3.5, None, 3.5, None, 3.5]
    assert {s["name"] for s in body["series"]} == {"requests", "ttft_ms", "running"}
    assert {"worker_tokens", "kv_blocks_used", "mfu", "queue_depth"} <= {s["name"] for s in everything["series"]}
    assert next(s for s in body["series"] if s["name"] == "requests")["labels"] == {"model": MODEL, "tenant": "acme"}


@run_async
async def test_series_api_answers_bad_input_with_400_naming_the_field(redis_url: str) -> None:
    now = float(math.floor(time.time()))  # whole seconds: each request falls in the bucket it is meant for
    store = await stored(redis_url, now)
    try:
        async with dashboard(store) as (base, http):
            answers = {
                query: await answer(http, f"{base}/api/series?{query}")
                for query in (
                    "names=requests,nope",
                    "from=soon",
                    f"from={now}&to={now - 60}",
                    f"from={now - 2 * 86400}&to={now}",
                    "step=0",
                    "step=x",
                    f"from={now - 7200}&to={now}&step=1",
                )
            }
    finally:
        await store.close()
    fields = {query: body.split(":")[0] for query, (status, body) in answers.items() if isinstance(body, str)}
    assert {status for status, _ in answers.values()} == {400}, answers
    assert list(fields.values()) == ["names", "from", "to", "from", "step", "step", "step"], answers
    assert "'nope'" in str(answers["names=requests,nope"][1]) and "running" in str(answers["names=requests,nope"][1])


@run_async
async def test_window_lists_exactly_the_requests_with_a_span_in_it_a_page_at_a_time(redis_url: str) -> None:
    now = float(math.floor(time.time()))  # whole seconds: each request falls in the bucket it is meant for
    store = await stored(redis_url, now)
    t0 = now - 10
    try:
        async with dashboard(store) as (base, http):
            _, middle = await answer(http, f"{base}/api/requests?from={t0 + 2.0}&to={t0 + 2.15}")
            _, first_page = await answer(http, f"{base}/api/requests?from={t0}&to={t0 + 5}&limit=2")
            _, second_page = await answer(http, f"{base}/api/requests?from={t0}&to={t0 + 5}&limit=2&offset=2")
            _, none = await answer(http, f"{base}/api/requests?from={t0 + 6}&to={t0 + 7}")
            bad = [
                await answer(http, f"{base}/api/requests?{q}")
                for q in ("from=x", f"from={t0 - 7200}&to={t0}", f"from={t0}&offset=-1", f"from={t0}&limit=0")
            ]
    finally:
        await store.close()
    assert isinstance(middle, dict) and isinstance(first_page, dict) and isinstance(second_page, dict)
    assert isinstance(none, dict)
    assert [r["request_id"] for r in middle["requests"]] == ["r-1"]
    assert middle["requests"][0]["tenant"] == "acme" and middle["total"] == 1
    assert [r["request_id"] for r in first_page["requests"]] == ["r-0", "r-1"] and first_page["next_offset"] == 2
    assert [r["request_id"] for r in second_page["requests"]] == ["r-2"] and second_page["next_offset"] is None
    assert none["requests"] == [] and none["truncated"] is False
    assert [status for status, _ in bad] == [400] * 4
    assert [str(body).split(":")[0] for _, body in bad] == ["from", "from", "offset", "limit"]


@run_async
async def test_window_inside_a_request_lists_it(redis_url: str) -> None:
    """A window that r-1 (2.1 s to 2.2 s) runs across, none of its spans starting or ending in it: its
    gateway.request, decode and detokenize spans start before it and end after it."""
    now = float(math.floor(time.time()))
    store = await stored(redis_url, now)
    t0 = now - 10
    start_ns, end_ns = int((t0 + 2.13) * 1e9), int((t0 + 2.16) * 1e9)
    try:
        async with dashboard(store) as (base, http):
            status, inside = await answer(http, f"{base}/api/requests?from={t0 + 2.13}&to={t0 + 2.16}")
        # The bound: spans that began further back than `longest_ns` before the window are not looked for.
        bounded = await store.requests_in_window(start_ns, end_ns, 1000, longest_ns=1_000_000)
        truncated = await store.requests_in_window(start_ns, end_ns, 2, longest_ns=600 * 10**9)
    finally:
        await store.close()
    assert status == 200 and isinstance(inside, dict), inside
    assert [r["request_id"] for r in inside["requests"]] == ["r-1"] and inside["truncated"] is False
    assert bounded == ([], False)
    assert truncated[1] is True  # more spans matched than the limit read: some may be missing


@run_async
async def test_a_collector_without_series_says_so(redis_url: str) -> None:
    store = SpanStore.from_url(redis_url, max_spans=100, max_age_s=1e9)
    try:
        async with dashboard(store) as (base, http):
            status, body = await answer(http, f"{base}/api/series")
    finally:
        await store.close()
    assert status == 404 and "no time series" in str(body)
