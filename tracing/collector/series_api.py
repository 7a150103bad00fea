"""The dashboard's time-view API: ``/api/series``, and ``/api/requests`` over a time window.

Both bound what one call reads: a window no longer than the series keep (or, for requests, an
hour), at most MAX_POINTS points per series, at most MAX_LIMIT requests per page. Bad input is a
400 naming the query field.
"""

import math
import time

from aiohttp import web

from tracing.collector import trace_export
from tracing.collector.dashboard_stats import summarize
from tracing.collector.series_samples import SERIES
from tracing.collector.series_store import SeriesStore
from tracing.collector.span_store import SpanStore

MAX_POINTS = 1000
# Points per series when the call gives no step.
DEFAULT_POINTS = 300
# A window without `from` ends at `to` (default now) and starts this long before it.
DEFAULT_WINDOW_S = 300
MAX_REQUESTS_WINDOW_S = 3600
# Span refs one window listing reads per index; past it the answer says truncated.
MAX_WINDOW_SPANS = 100_000
# A request running across a whole window is listed when its spans began at most this long before the
# window: the gateway's default request timeout, past which a request is aborted.
LONGEST_SPAN_S = 600
DEFAULT_LIMIT = 50
MAX_LIMIT = 1000
NAMES = tuple(SERIES)


def _bad(field: str, problem: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=f"{field}: {problem}")


def _time_s(request: web.Request, field: str, default: float) -> float:
    raw = request.query.get(field)
    if raw is None or raw == "":
        return default
    try:
        return trace_export.parse_time(raw) / 1e9
    except ValueError as exc:
        raise _bad(field, str(exc)) from None


def _int(request: web.Request, field: str, default: int | None, low: int, high: int) -> int | None:
    raw = request.query.get(field)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise _bad(field, f"must be an integer, got {raw!r}") from None
    if not low <= value <= high:
        raise _bad(field, f"must be between {low} and {high}, got {value}")
    return value


def window(request: web.Request, max_window_s: float) -> tuple[float, float]:
    """``from`` and ``to`` in unix seconds: ``to`` defaults to now, ``from`` to DEFAULT_WINDOW_S before it."""
    end_s = _time_s(request, "to", time.time())
    start_s = _time_s(request, "from", end_s - DEFAULT_WINDOW_S)
    if end_s < start_s:
        raise _bad("to", "is earlier than from")
    if end_s - start_s > max_window_s:
        raise _bad("from", f"the window is {end_s - start_s:.0f} s long; at most {max_window_s:.0f} s")
    return start_s, end_s


async def series_api(request: web.Request, series: SeriesStore) -> web.Response:
    """GET /api/series?names=a,b&from=&to=&step=."""
    raw_names = request.query.get("names", "")
    names = [name for name in raw_names.split(",") if name] or list(NAMES)
    unknown = [name for name in names if name not in NAMES]
    if unknown:
        raise _bad("names", f"unknown series {', '.join(map(repr, unknown))}; known: {', '.join(NAMES)}")
    start_s, end_s = window(request, series.max_window_s)
    step_s = _int(request, "step", None, 1, series.max_window_s)
    if step_s is None:
        step_s = max(1, math.ceil((end_s - start_s) / DEFAULT_POINTS))
    points = math.ceil((end_s - start_s) / step_s) + 1  # never fewer than the read gives
    if points > MAX_POINTS:
        raise _bad("step", f"{step_s} s gives {points} points over the window; at most {MAX_POINTS}")
    read = await series.read(names, start_s, end_s, step_s)
    return web.json_response(read.to_json())


async def window_requests_api(request: web.Request, store: SpanStore) -> web.Response:
    """GET /api/requests?from=&to=&offset=&limit=: the requests with a span that starts or ends in the
    window, or runs across it, by start, a page of rows as /api/requests gives them."""
    start_s, end_s = window(request, MAX_REQUESTS_WINDOW_S)
    offset = _int(request, "offset", 0, 0, 10**9) or 0
    limit = _int(request, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT) or DEFAULT_LIMIT
    ids, truncated = await store.requests_in_window(
        int(start_s * 1e9), int(end_s * 1e9), MAX_WINDOW_SPANS, int(LONGEST_SPAN_S * 1e9)
    )
    page = ids[offset : offset + limit]
    rows = []
    for request_id, spans in zip(page, await store.by_requests(page), strict=True):
        summary = summarize(request_id, spans)
        if summary is not None:  # None for a request of several choices (they have rows), or one trimmed since
            rows.append(summary.to_json())
    return web.json_response(
        {
            "from": start_s,
            "to": end_s,
            "total": len(ids),
            "offset": offset,
            "next_offset": offset + limit if offset + limit < len(ids) else None,
            "truncated": truncated,
            "requests": rows,
        }
    )
