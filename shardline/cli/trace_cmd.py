"""`shardline trace export|view`: .pftrace files from the span store, and a local Perfetto UI to read them.

Both run the tracing service's own code (its span store, its Perfetto writer and UI), which comes
with the serve extra: it is imported when a command runs, so that `shardline --help` works without.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import webbrowser
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web
from redis.exceptions import RedisError

from shardline.cli.serve_extra import require_serve

if TYPE_CHECKING:
    from tracing.collector.span_store import SpanStore
    from tracing.collector.stored_span import StoredSpan

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="export traces as .pftrace, or view one in a local Perfetto UI")
    actions = p.add_subparsers(metavar="action", required=True)

    export = actions.add_parser("export", help="write a .pftrace from the span store (default: the last request)")
    export.add_argument("--request", action="append", metavar="ID", help="a request id (repeatable)")
    export.add_argument("--last", type=int, metavar="N", help="the N most recent requests")
    export.add_argument("--since", help="window start: unix seconds or ISO 8601 (local time without a zone)")
    export.add_argument("--until", help="window end (default: now)")
    export.add_argument(
        "-o", "--output", type=Path, default=None, help="file to write (default: named after the selection)"
    )
    export.add_argument("--redis-url", default=None, help="the span store's Redis (default: SHARDLINE_REDIS_URL)")
    export.set_defaults(func=run_export)

    view = actions.add_parser("view", help="open a .pftrace in the Perfetto UI, served from this machine")
    view.add_argument("file", type=Path)
    view.add_argument("--host", default="127.0.0.1", help="interface to serve on")
    view.add_argument("--port", type=int, default=0, help="port to serve on (default: a free one)")
    view.add_argument("--no-browser", action="store_true", help="only print the URL")
    view.set_defaults(func=run_view)


@dataclass(slots=True)
class Selection:
    """What to export: request ids, the last N requests, or a time window (unix ns)."""

    request_ids: list[str]
    last: int | None = None
    window: tuple[int, int] | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Selection:
        """Validates the export flags; raises ValueError with what to fix."""
        windowed = args.since is not None or args.until is not None
        chosen = sum((bool(args.request), args.last is not None, windowed))
        if chosen > 1:
            raise ValueError("give one of --request, --last, or --since/--until")
        if args.last is not None and args.last < 1:
            raise ValueError("--last must be at least 1")
        if windowed:
            from tracing.collector import trace_export

            return cls([], window=trace_export.window_bounds(args.since, args.until))
        return cls(list(args.request or []), last=None if args.request else (args.last or 1))

    def default_name(self, request_ids: list[str]) -> str:
        if self.window is not None:
            return f"window-{self.window[0] // 1_000_000_000}-{self.window[1] // 1_000_000_000}.pftrace"
        if len(request_ids) == 1:
            return f"{request_ids[0]}.pftrace"
        return f"last-{self.last}.pftrace" if self.last else "requests.pftrace"


async def select_spans(store: SpanStore, selection: Selection) -> tuple[list[str], list[StoredSpan]]:
    """The selected requests' ids (empty for a window) and the spans to export."""
    from tracing.collector import trace_export

    if selection.window is not None:
        return [], await trace_export.window_spans(store, *selection.window)
    if selection.last is not None:
        return await trace_export.last_requests_spans(store, selection.last)
    return selection.request_ids, await trace_export.request_spans(store, selection.request_ids)


def run_export(args: argparse.Namespace) -> int:
    require_serve("trace export")
    from tracing.collector.perfetto_writer import write_pftrace
    from tracing.collector.span_store import SpanStore
    from tracing.settings import TracingSettings

    try:
        selection = Selection.from_args(args)
    except ValueError as exc:
        print(f"shardline trace export: {exc}", file=sys.stderr)
        return 2
    settings = TracingSettings()
    store = SpanStore.from_url(
        args.redis_url or settings.redis_url, max_spans=settings.trace_max_spans, max_age_s=settings.trace_max_age_s
    )

    async def read() -> tuple[list[str], list[StoredSpan]]:
        try:
            return await select_spans(store, selection)
        finally:
            await store.close()

    try:
        request_ids, spans = asyncio.run(read())
    except RedisError as exc:
        print(f"shardline trace export: the span store is unreachable: {exc}", file=sys.stderr)
        return 1
    if not spans:
        print("shardline trace export: no stored spans match", file=sys.stderr)
        return 1
    output = args.output or Path(selection.default_name(request_ids))
    try:
        stats = write_pftrace(spans, output)
    except OSError as exc:
        print(f"shardline trace export: cannot write {output}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {output}: {len(spans)} spans as {stats.slices} slices on {stats.processes} processes, "
        f"{stats.request_tracks} request tracks, {stats.flows} flows, {stats.counter_samples} counter samples "
        f"({stats.bytes} bytes)"
    )
    if request_ids:
        print("requests: " + ", ".join(request_ids))
    return 0


def build_view_app(trace: Path) -> web.Application:
    """The Perfetto UI under /perfetto/ and ``trace`` under /trace/<its name>."""
    from tracing.collector import perfetto_ui

    app = web.Application()
    perfetto_ui.add_routes(app)

    async def serve_trace(_request: web.Request) -> web.StreamResponse:
        return web.FileResponse(trace, headers={"Content-Type": "application/octet-stream"})

    app.router.add_get(f"/trace/{trace.name}", serve_trace)
    return app


def view_url(host: str, port: int, trace: Path) -> str:
    """The URL that opens ``trace`` in the UI served by ``build_view_app``."""
    from tracing.collector import perfetto_ui

    base = f"http://{host}:{port}"
    return perfetto_ui.viewer_url(f"{base}{perfetto_ui.PREFIX}", f"{base}/trace/{trace.name}")


def run_view(args: argparse.Namespace) -> int:
    require_serve("trace view")
    trace = args.file.resolve()
    if not trace.is_file():
        print(f"shardline trace view: no such file: {args.file}", file=sys.stderr)
        return 2
    asyncio.run(_serve_view(trace, args.host, args.port, not args.no_browser))
    return 0


def _warn_if_not_opened(opener: asyncio.Task[bool]) -> None:
    if not opener.cancelled() and not opener.result():
        logger.warning("found no browser to open; open the URL above yourself")


async def _serve_view(trace: Path, host: str, port: int, open_browser: bool) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(build_view_app(trace), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1]
        url = view_url(host, bound, trace)
        print(f"Perfetto UI with {trace.name}:\n  {url}\nCtrl-C stops the server.", flush=True)
        if open_browser:
            # In a thread: a console browser (lynx, w3m) would block, and the loop must keep serving.
            opener = asyncio.create_task(asyncio.to_thread(webbrowser.open, url))
            opener.add_done_callback(_warn_if_not_opened)
        await stop.wait()
    finally:
        await runner.cleanup()
