"""The gateway's Batch API, /v1/files and /v1/batches, wired from its settings.

It needs Redis (batch records, Celery's broker) and the file store's folder; a gateway started
without SHARDLINE_REDIS_URL answers those routes 503, naming the setting.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.auth import ApiKeys
from gateway.batches_http import BatchesApi
from gateway.files_http import FilesApi
from gateway.settings import GatewaySettings
from shardline.batch.batch_store import BatchStore
from shardline.batch.celery_wiring import celery_app
from shardline.batch.file_store import LocalFileStore
from shardline.errors import Unavailable

_PATHS = ("/v1/files", "/v1/files/{tail:.*}", "/v1/batches", "/v1/batches/{tail:.*}")


class BatchFront:
    """The Batch API's routes, and what they hold open."""

    def __init__(
        self, settings: GatewaySettings, keys: ApiKeys, read_json: Callable[[web.Request], Awaitable[Any]]
    ) -> None:
        self._store: BatchStore | None = None
        self._files: FilesApi | None = None
        self._batches: BatchesApi | None = None
        if not settings.redis_url:
            return
        files = LocalFileStore(Path(settings.files_dir))
        self._store = BatchStore(settings.redis_url)
        self._files = FilesApi(files, keys)
        self._batches = BatchesApi(
            self._store,
            files,
            self._files,
            celery_app(settings.redis_url),
            settings.batch_chunk_lines,
            settings.batch_window_s,
            read_json,
        )

    def add_routes(self, app: web.Application) -> None:
        if self._files is None or self._batches is None:
            for path in _PATHS:
                app.router.add_route("*", path, _off)
            return
        self._files.add_routes(app)
        self._batches.add_routes(app)

    async def close(self) -> None:
        if self._store is not None:
            await self._store.close()


async def _off(request: web.Request) -> web.Response:
    raise Unavailable("the Batch API is off on this gateway: it needs Redis; set SHARDLINE_REDIS_URL")
