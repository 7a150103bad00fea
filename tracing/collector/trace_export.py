"""Which stored spans go into an exported trace: one request, the last N, or a time window.

A request's own traces hold its spans across services, but not the engine
steps that ran it: each ``engine_step`` is a root span of its own (a step
serves many requests), so it has no request id and another trace id. A
request's export therefore adds the spans that started in its time window and
belong to no other request, which brings in the per-step worker slices and
the counters (batch size, KV blocks, tokens/s, MFU/MBU) sampled on them.

Both the dashboard and ``shardline trace export`` select through here.
"""

import math
import time
from collections.abc import Iterable
from datetime import datetime

from tracing.collector.span_store import SpanStore
from tracing.collector.stored_span import StoredSpan

NS_PER_S = 1_000_000_000
# Upper bound on the spans one export reads; a time window past it is cut at its end.
MAX_EXPORT_SPANS = 200_000


def parse_time(value: str) -> int:
    """Unix nanoseconds from unix seconds (``1764000000.5``) or an ISO 8601 time.

    An ISO time without a zone is local time, as a person typing it means it.
    """
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            seconds = datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
        except ValueError:
            seconds = math.nan
    if not math.isfinite(seconds):
        raise ValueError(f"not a time: {value!r} (give unix seconds or ISO 8601, e.g. 2025-11-24T16:00:00)")
    # Through microseconds: a float holds those exactly for today's dates, not nanoseconds.
    return round(seconds * 1_000_000) * 1000


def window_bounds(since: str | None, until: str | None, now_ns: int | None = None) -> tuple[int, int]:
    """``[since, until]`` in unix ns; an open start is the epoch, an open end is now."""
    start_ns = parse_time(since) if since else 0
    end_ns = parse_time(until) if until else (now_ns if now_ns is not None else time.time_ns())
    if end_ns < start_ns:
        raise ValueError("the window ends before it starts (--until is earlier than --since)")
    return start_ns, end_ns


def with_engine_context(own: list[StoredSpan], window: Iterable[StoredSpan]) -> list[StoredSpan]:
    """``own`` (the selected requests' traces) plus the window spans of no other request, by start.

    A window span is dropped when its trace is one of ``own``'s (already
    there) or carries another request's id anywhere in the window: the
    export is about the selected requests, not every request that overlapped.
    """
    own_traces = {span.trace_id for span in own}
    window = [span for span in window if span.trace_id not in own_traces]
    foreign = {span.trace_id for span in window if span.request_id is not None}
    context = [span for span in window if span.trace_id not in foreign]
    return sorted([*own, *context], key=lambda span: (span.start_ns, -span.end_ns))


async def request_spans(store: SpanStore, request_ids: list[str]) -> list[StoredSpan]:
    """The requests' traces plus the engine steps and counters in their time span."""
    own: dict[tuple[str, str], StoredSpan] = {}
    for spans in await store.by_requests(request_ids):
        for span in spans:
            own[span.trace_id, span.span_id] = span
    if not own:
        return []
    spans = list(own.values())
    start_ns = min(span.start_ns for span in spans)
    end_ns = max(span.end_ns for span in spans)
    return with_engine_context(spans, await store.in_window(start_ns, end_ns, MAX_EXPORT_SPANS))


async def last_requests_spans(store: SpanStore, n: int) -> tuple[list[str], list[StoredSpan]]:
    """The ``n`` most recent requests' ids and their spans, as ``request_spans``."""
    request_ids = await store.recent_requests(n)
    return request_ids, await request_spans(store, request_ids)


async def window_spans(store: SpanStore, start_ns: int, end_ns: int) -> list[StoredSpan]:
    """Every span that started in ``[start_ns, end_ns]``, whatever it belongs to."""
    return await store.in_window(start_ns, end_ns, MAX_EXPORT_SPANS)
