"""SpanStore against a real Redis: queries and the retention bounds."""

import time

import pytest
import redis

from tests.tracing.collector.fake_request import otlp_export
from tests.tracing.run_async import run_async
from tracing import attributes as attr
from tracing.collector import span_store
from tracing.collector.span_store import SpanStore

S = 1_000_000_000


def store(url: str, max_spans: int = 1000, max_age_s: float = 1e9) -> SpanStore:
    return SpanStore.from_url(url, max_spans=max_spans, max_age_s=max_age_s)


@run_async
async def test_queries_by_request_trace_recency_and_window(redis_url: str) -> None:
    now = int(time.time())
    spans = store(redis_url)
    try:
        # Exports arrive out of order: r1's later span first.
        await spans.add([otlp_export("scheduler-0", [(1, 2, "queue", now + 2, "r1")])])
        await spans.add(
            [
                otlp_export("gateway-0", [(1, 1, "generate", now + 1, "r1"), (2, 3, "generate", now + 3, "r2")]),
                otlp_export(
                    "tokenizer-0", [(1, 4, "Tokenizer/Encode", now + 1.1, None), (3, 5, "generate", now + 5, "r3")]
                ),
            ]
        )
        r1 = await spans.by_request("r1")
        trace_2 = await spans.by_trace(f"{2:032x}")
        recent = await spans.recent_requests(2)
        window = await spans.in_window((now + 2) * S, (now + 3) * S)
        assert await spans.by_request("absent") == []
    finally:
        await spans.close()
    # The request's trace includes its spans without a request id.
    assert [(s.name, s.instance_id) for s in r1] == [
        ("generate", "gateway-0"),
        ("Tokenizer/Encode", "tokenizer-0"),
        ("queue", "scheduler-0"),
    ]
    assert r1[0].start_ns == (now + 1) * S and r1[0].end_ns == r1[0].start_ns + S // 2
    assert r1[1].resource[attr.SERVICE_NAME] == "tokenizer" and r1[1].attributes == {attr.NUM_TOKENS: 4}
    assert r1[2].span_id == f"{2:016x}" and r1[2].request_id == "r1"
    assert [s.request_id for s in trace_2] == ["r2"]
    assert recent == ["r3", "r2"]
    assert [s.name for s in window] == ["queue", "generate"]


@run_async
async def test_many_requests_at_once_match_one_at_a_time(redis_url: str) -> None:
    """by_requests (the dashboard's list, exports) past the connection pool's 100: two round trips."""
    now = int(time.time())
    spans = store(redis_url, max_spans=10_000)
    try:
        # 150 requests; q2 shares q1's trace, q5 q4's, and so on.
        await spans.add(
            [
                otlp_export(
                    "gateway-0", [(i - i % 3 // 2, i + 1, "generate", now + i / 100, f"q{i}") for i in range(1, 151)]
                )
            ]
        )
        ids = [f"q{i}" for i in range(1, 151)] + ["absent"]
        together = await spans.by_requests(ids)
        alone = [await spans.by_request(request_id) for request_id in ids]
    finally:
        await spans.close()
    assert together == alone
    assert together[-1] == [] and all(together[:-1])
    assert {s.request_id for s in together[1]} == {"q1", "q2"}  # the shared trace, whole
    assert {s.request_id for s in together[2]} == {"q3"}


@run_async
async def test_count_bound_removes_the_oldest_spans_from_every_index(redis_url: str) -> None:
    now = int(time.time())
    spans = store(redis_url, max_spans=5)
    try:
        for n in range(8):
            await spans.add([otlp_export("gateway-0", [(n + 1, n + 1, "generate", now + n, f"r{n}")])])
        recent = await spans.recent_requests(100)
        oldest = await spans.by_request("r0")
        kept = await spans.in_window(0, (now + 100) * S)
    finally:
        await spans.close()
    assert recent == [f"r{n}" for n in range(7, 2, -1)]
    assert oldest == [] and [s.request_id for s in kept] == ["r3", "r4", "r5", "r6", "r7"]
    client = redis.Redis.from_url(redis_url)
    keys = {key.decode() for key in client.keys("shardline:trace:*")}
    client.close()
    assert keys == {"shardline:trace:by_time", "shardline:trace:by_end", "shardline:trace:requests"} | {
        f"shardline:trace:{kind}:{key}"
        for n in range(3, 8)
        for kind, key in (("req", f"r{n}"), ("span", f"{n + 1:032x}"))
    }


@run_async
async def test_age_bound_and_bounded_trim_batches(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    now = int(time.time())
    unbounded = store(redis_url)
    bounded = store(redis_url, max_age_s=600)
    monkeypatch.setattr(span_store, "TRIM_BATCH", 3)
    try:
        old = [(1, n + 1, "step", now - 3600 + n, None) for n in range(7)]
        await unbounded.add([otlp_export("worker-0", old + [(2, 99, "step", now, "fresh")])])
        removed = [await bounded.trim() for _ in range(4)]
        left = await bounded.in_window(0, (now + 1) * S)
    finally:
        await unbounded.close()
        await bounded.close()
    # Each call deletes at most TRIM_BATCH spans, so a backlog never blocks Redis for long.
    assert removed == [3, 3, 1, 0]
    assert [s.request_id for s in left] == ["fresh"]


@run_async
async def test_a_request_that_just_finished_keeps_its_root_under_the_bounds(redis_url: str) -> None:
    # A request's root starts first and ends (arrives) last: trimming by start time removed it the
    # moment it arrived, leaving the newest request without its row. Trimming is by end time.
    now = time.time()
    spans = store(redis_url, max_spans=10, max_age_s=5)
    try:
        children = [(1, n + 2, "step", now - 10 + n, "long") for n in range(12)]  # ended 10 s ago .. now
        await spans.add([otlp_export("worker-0", children)])
        root = otlp_export("gateway-0", [(1, 1, "gateway.request", now - 10.5, "long")])
        root.scope_spans[0].spans[0].end_time_unix_nano = int((now + 0.5) * S)  # a 11 s request ends now
        await spans.add([root])
        kept = await spans.by_request("long")
    finally:
        await spans.close()
    assert "gateway.request" in [s.name for s in kept]
    assert len(kept) <= 10 and all(s.end_ns >= (now - 5) * S for s in kept)
