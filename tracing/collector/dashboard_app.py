"""The trace dashboard: recent requests with their latency breakdown, trace downloads, Perfetto UI.

Routes:

- ``/``                          the page (tracing/collector/dashboard/): the time view's charts, the
                                 recent requests and the tenants, all read from the JSON API;
- ``/api/requests?limit=N``      the N most recent requests, with TTFT, TPOT, E2E and stages;
- ``/api/requests?from=&to=``    the requests with a span in a window, paged (``offset``, ``limit``);
- ``/api/series?names=&from=&to=&step=``  the time series (series_api.py; docs/dashboard.md);
- ``/api/tenants?limit=N``       those requests summed by tenant: tokens, TTFT p50/p99, SLO outcomes;
- ``/api/trace?request=ID``      a request's .pftrace (repeat ``request`` for several);
- ``/api/trace?last=N``          the N most recent requests' .pftrace;
- ``/api/trace?since=&until=``   every span in a window (unix seconds or ISO 8601);
- ``/perfetto/``                 the Perfetto UI, local; open a trace with its ``#!/viewer?url=``;
- ``/health``                    200 while the span store answers.
"""

import asyncio
import logging
from pathlib import Path

from aiohttp import web
from redis.exceptions import RedisError

from tracing.collector import perfetto_ui, series_api, trace_export
from tracing.collector.dashboard_stats import RequestSummary, summarize
from tracing.collector.perfetto_writer import encode_pftrace
from tracing.collector.span_store import SpanStore
from tracing.collector.stored_span import StoredSpan
from tracing.collector.tenant_stats import by_tenant

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "dashboard"
DEFAULT_LIMIT = 50
# The tenants view sums more requests than the page lists, so that its percentiles mean something.
DEFAULT_TENANTS_LIMIT = 500
MAX_LIMIT = 1000
STORE = web.AppKey("store", SpanStore)
PFTRACE_TYPE = "application/octet-stream"


def _positive_int(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name} must be an integer, got {raw!r}") from None
    if not 1 <= value <= MAX_LIMIT:
        raise web.HTTPBadRequest(text=f"{name} must be between 1 and {MAX_LIMIT}")
    return value


async def index(_request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC_DIR / "index.html")


async def health(request: web.Request) -> web.Response:
    try:
        await request.app[STORE].recent_requests(1)
    except RedisError as exc:
        return web.json_response({"status": "unavailable", "error": str(exc)}, status=503)
    return web.json_response({"status": "ok"})


async def _recent_summaries(store: SpanStore, limit: int) -> list[RequestSummary]:
    request_ids = await store.recent_requests(limit)
    traces = await store.by_requests(request_ids)
    rows = []
    for request_id, spans in zip(request_ids, traces, strict=True):
        summary = summarize(request_id, spans)
        # None when a trim removed the request's spans between the two reads.
        if summary is not None:
            rows.append(summary)
    return rows


async def requests_api(request: web.Request) -> web.Response:
    if "from" in request.query or "to" in request.query:
        return await series_api.window_requests_api(request, request.app[STORE])
    rows = await _recent_summaries(request.app[STORE], _positive_int(request, "limit", DEFAULT_LIMIT))
    return web.json_response({"requests": [row.to_json() for row in rows]})


async def tenants_api(request: web.Request) -> web.Response:
    rows = await _recent_summaries(request.app[STORE], _positive_int(request, "limit", DEFAULT_TENANTS_LIMIT))
    return web.json_response({"requests": len(rows), "tenants": [t.to_json() for t in by_tenant(rows)]})


async def series(request: web.Request) -> web.Response:
    store = request.app[STORE].series
    if store is None:
        raise web.HTTPNotFound(text="this collector keeps no time series")
    return await series_api.series_api(request, store)


async def trace_api(request: web.Request) -> web.Response:
    store = request.app[STORE]
    query = request.query
    request_ids = query.getall("request", [])
    if request_ids:
        spans, name = await trace_export.request_spans(store, request_ids), request_ids[0]
    elif "last" in query:
        _ids, spans = await trace_export.last_requests_spans(store, _positive_int(request, "last", 1))
        name = f"last-{query['last']}"
    elif "since" in query or "until" in query:
        try:
            start_ns, end_ns = trace_export.window_bounds(query.get("since"), query.get("until"))
        except ValueError as exc:
            raise web.HTTPBadRequest(text=str(exc)) from None
        spans = await trace_export.window_spans(store, start_ns, end_ns)
        name = f"window-{start_ns // 1_000_000_000}-{end_ns // 1_000_000_000}"
    else:
        raise web.HTTPBadRequest(text="give request=ID, last=N, or since= and/or until=")
    if not spans:
        raise web.HTTPNotFound(text="no stored spans match")
    return await _pftrace_response(spans, name)


async def _pftrace_response(spans: list[StoredSpan], name: str) -> web.Response:
    # Encoding a large window takes a while: keep the loop free for exports.
    data, stats = await asyncio.to_thread(encode_pftrace, spans)
    logger.info(
        "trace %s: %d slices, %d counter samples, %d bytes", name, stats.slices, stats.counter_samples, stats.bytes
    )
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return web.Response(
        body=data, content_type=PFTRACE_TYPE, headers={"Content-Disposition": f'attachment; filename="{safe}.pftrace"'}
    )


async def _redis_unavailable(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RedisError as exc:
        logger.warning("span store unavailable: %s", exc)
        raise web.HTTPServiceUnavailable(text=f"span store unavailable: {exc}") from None


def build_app(store: SpanStore) -> web.Application:
    """The dashboard on ``store``; the caller owns (and closes) the store."""
    app = web.Application(middlewares=[web.middleware(_redis_unavailable)])
    app[STORE] = store
    app.router.add_get("/", index)
    app.router.add_get("/health", health)
    app.router.add_get("/api/requests", requests_api)
    app.router.add_get("/api/tenants", tenants_api)
    app.router.add_get("/api/series", series)
    app.router.add_get("/api/trace", trace_api)
    app.router.add_static("/static/", STATIC_DIR)
    perfetto_ui.add_routes(app)
    return app
