"""The gateway's Batch API, wired from its settings: the BatchService, and its HTTP routes /v1/files
and /v1/batches (the gRPC Batches service takes the same BatchService).

It needs Redis (batch records, Celery's broker) and the file store's folder; a gateway started
without SHARDLINE_REDIS_URL answers those routes 503, naming the setting (OFF_MESSAGE).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from gateway.batches.batch_service import BatchService
from gateway.batches.batches_http import BatchesApi
from gateway.batches.files_http import FilesApi
from gateway.settings import GatewaySettings
from gateway.tenancy.auth import ApiKeys
from shardline.core.batch.batch_store import BatchStore
from shardline.core.batch.celery_wiring import celery_app
from shardline.core.batch.file_store import LocalFileStore
from shardline.core.errors import Unavailable

OFF_MESSAGE = "the Batch API is off on this gateway: it needs Redis; set SHARDLINE_REDIS_URL"
_PATHS = ("/v1/files", "/v1/files/{tail:.*}", "/v1/batches", "/v1/batches/{tail:.*}")


class BatchFront:
    """The Batch API's service and routes, and what they hold open."""

    def __init__(self, settings: GatewaySettings, keys: ApiKeys) -> None:
        self.service: BatchService | None = None  # None: the Batch API is off (no Redis)
        self._files: FilesApi | None = None
        self._batches: BatchesApi | None = None
        if not settings.redis_url:
            return
        self.service = BatchService(
            BatchStore(settings.redis_url),
            LocalFileStore(Path(settings.files_dir)),
            celery_app(settings.redis_url),
            settings.batch_chunk_lines,
            settings.batch_window_s,
        )
        self._files = FilesApi(self.service, keys)
        self._batches = BatchesApi(self.service, self._files)

    @property
    def status_counts(self) -> Callable[[], Awaitable[dict[str, int]]] | None:
        """The batches by status, for /metrics; None while the Batch API is off."""
        return self.service.store.status_counts if self.service is not None else None

    def add_routes(self, app: web.Application) -> None:
        app.on_cleanup.append(lambda _: self.close())
        if self._files is None or self._batches is None:
            for path in _PATHS:
                app.router.add_route("*", path, _off)
            return
        self._files.add_routes(app)
        self._batches.add_routes(app)

    async def close(self) -> None:
        if self.service is not None:
            await self.service.store.close()


async def _off(request: web.Request) -> web.Response:
    raise Unavailable(OFF_MESSAGE)
