"""Export selection: time parsing, and which spans a request's, the last N's, or a window's trace holds."""

from datetime import UTC, datetime

import pytest

from tests.tracing.collector.fake_request import MS, T0, SpanFactory
from tests.tracing.collector.served_request import engine_steps, served_request, to_otlp
from tests.tracing.run_async import run_async
from tracing.collector import trace_export
from tracing.collector.span_store import SpanStore

NS = 1_000_000_000
TRACE_A, TRACE_B = "a1" * 16, "b2" * 16


def test_parse_time_takes_unix_seconds_and_iso() -> None:
    assert trace_export.parse_time("1764000000") == 1_764_000_000 * NS
    assert trace_export.parse_time(" 1764000000.25 ") == 1_764_000_000 * NS + NS // 4
    assert trace_export.parse_time("2025-11-24T16:00:00Z") == 1_764_000_000 * NS
    assert trace_export.parse_time("2025-11-24T17:00:00.5+01:00") == 1_764_000_000 * NS + NS // 2
    # Without a zone: local time, as datetime reads it.
    assert trace_export.parse_time("2025-11-24T16:00:00") == int(datetime(2025, 11, 24, 16).timestamp()) * NS
    for bad in ("yesterday", "", "inf", "nan"):
        with pytest.raises(ValueError, match="not a time"):
            trace_export.parse_time(bad)


def test_window_bounds_open_ends_and_order() -> None:
    now = 1_764_000_100 * NS
    assert trace_export.window_bounds("1764000000", None, now_ns=now) == (1_764_000_000 * NS, now)
    assert trace_export.window_bounds(None, "1764000000", now_ns=now) == (0, 1_764_000_000 * NS)
    start = datetime(2025, 11, 24, 16, tzinfo=UTC).isoformat()
    assert trace_export.window_bounds(start, "1764000001")[0] == 1_764_000_000 * NS
    with pytest.raises(ValueError, match="ends before it starts"):
        trace_export.window_bounds("1764000001", "1764000000")


def _two_overlapping_requests() -> tuple[list, list, list]:
    """r-a at 0-100 ms and r-b at 50-150 ms, and the engine steps that served both."""
    f = SpanFactory()
    return served_request(f, "r-a", TRACE_A), served_request(f, "r-b", TRACE_B, at_ms=50), engine_steps(f, 0, 160)


def test_with_engine_context_adds_steps_not_other_requests() -> None:
    a, b, steps = _two_overlapping_requests()
    window = sorted(a + b + steps, key=lambda s: s.start_ns)
    picked = trace_export.with_engine_context(a, window)
    assert {s.trace_id for s in picked} == {TRACE_A} | {s.trace_id for s in steps}
    # Each of r-a's spans once, though the window holds them too.
    assert len(picked) == len(a) + len(steps)
    assert [s.start_ns for s in picked] == sorted(s.start_ns for s in picked)


@run_async
async def test_request_last_and_window_exports_from_the_store(redis_url: str) -> None:
    a, b, steps = _two_overlapping_requests()
    store = SpanStore.from_url(redis_url, max_spans=10_000, max_age_s=1e12)
    try:
        await store.add(to_otlp(a + b + steps))
        one = await trace_export.request_spans(store, ["r-a"])
        both = await trace_export.request_spans(store, ["r-a", "r-b"])
        last_ids, last = await trace_export.last_requests_spans(store, 1)
        window = await trace_export.window_spans(store, T0 + 49 * MS, T0 + 50 * MS)
        assert await trace_export.request_spans(store, ["absent"]) == []
    finally:
        await store.close()
    # r-a spans 0-100 ms: the steps that started in it, ends included (0, 10, ... 100), none of r-b's spans.
    assert {s.request_id for s in one} == {"r-a", None}
    assert sorted(s.attributes["shardline.step"] for s in one if s.name == "engine_step") == list(range(11))
    assert not any(s.trace_id == TRACE_B for s in one)
    # Both requests: the steps of 0-150 ms.
    assert {s.request_id for s in both} == {"r-a", "r-b", None}
    assert sum(s.name == "engine_step" for s in both) == 16
    assert last_ids == ["r-b"] and {s.request_id for s in last} == {"r-b", None}
    # A window holds every span that started in it, whatever it belongs to.
    assert sorted((s.name, s.request_id) for s in window) == [("engine_step", None), ("gateway.request", "r-b")]
