"""OpenAI's Batch API: create, retrieve, list and cancel batches; the batch workers (batch_svc) run them.

Creating a batch checks its whole input first, each body with the parser the online endpoint uses,
so a line the endpoint would refuse fails the batch, naming the line and the field, before anything
runs. A batch that passes is split into chunks and queued for the batch workers through Celery.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from celery import Celery

from gateway.files_http import FilesApi
from gateway.openai_request import parse_request
from shardline.batch.batch_record import COMPLETION_WINDOWS, TERMINAL, BatchRecord, new_batch_id
from shardline.batch.batch_store import BatchStore
from shardline.batch.celery_wiring import enqueue_chunks
from shardline.batch.file_store import FileStore
from shardline.batch.input_lines import ENDPOINTS, CheckedInput, check_input
from shardline.errors import FailedPrecondition, InvalidArgument, NotFound

_CREATE_FIELDS = frozenset({"input_file_id", "endpoint", "completion_window", "metadata"})
# OpenAI's limits on a batch's metadata.
_METADATA_KEYS, _METADATA_KEY_LENGTH, _METADATA_VALUE_LENGTH = 16, 64, 512
_LIST_LIMIT = (1, 100, 20)  # least, most and default `limit`
CANCELLABLE = ("validating", "in_progress")


class BatchesApi:
    """Routes of /v1/batches."""

    def __init__(
        self,
        store: BatchStore,
        files: FileStore,
        files_api: FilesApi,
        celery: Celery,
        chunk_lines: int,
        window_s: float | None,
        read_json: Callable[[web.Request], Awaitable[Any]],
    ) -> None:
        self._read_json = read_json  # the online endpoints' body reader: same limits, same errors
        self._store = store
        self._files = files
        self._files_api = files_api
        self._celery = celery
        self._chunk_lines = chunk_lines
        self._window_s = window_s

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/batches", self.create)
        app.router.add_get("/v1/batches", self.list)
        app.router.add_get("/v1/batches/{batch_id}", self.retrieve)
        app.router.add_post("/v1/batches/{batch_id}/cancel", self.cancel)

    async def create(self, request: web.Request) -> web.Response:
        body = await self._read_json(request)
        if not isinstance(body, dict):
            raise InvalidArgument("body", "must be a JSON object")
        if unknown := sorted(set(body) - _CREATE_FIELDS):
            raise InvalidArgument(unknown[0], "unknown field")
        endpoint, window = body.get("endpoint"), body.get("completion_window")
        if endpoint not in ENDPOINTS:
            raise InvalidArgument("endpoint", f"must be one of {list(ENDPOINTS)}, got {endpoint!r}")
        if window not in COMPLETION_WINDOWS:
            raise InvalidArgument("completion_window", f"must be one of {list(COMPLETION_WINDOWS)}, got {window!r}")
        metadata = _metadata(body.get("metadata"))
        owner = self._files_api.owner(request)
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise InvalidArgument("input_file_id", "is required: the id of a file uploaded with purpose 'batch'")
        try:
            meta = await self._files_api.owned(file_id, owner)
        except NotFound:
            raise InvalidArgument("input_file_id", f"no file {file_id!r}") from None
        if meta.purpose != "batch":
            raise InvalidArgument("input_file_id", f"file {file_id!r} has purpose {meta.purpose!r}, not 'batch'")
        checked = await asyncio.to_thread(self._check, file_id, endpoint)
        now = int(time.time())
        record = BatchRecord(
            id=new_batch_id(),
            endpoint=endpoint,
            input_file_id=file_id,
            completion_window=window,
            status="failed" if checked.errors else "validating",
            owner=owner,
            metadata=metadata,
            errors=[e.to_openai() for e in checked.errors],
            total=0 if checked.errors else checked.lines,
            chunks=[] if checked.errors else [vars_of(c) for c in checked.chunks],
            timestamps={"created_at": now, "expires_at": now + int(self._window_s or COMPLETION_WINDOWS[window])},
        )
        if checked.errors:
            record.timestamps["failed_at"] = now
        await self._store.create(record)
        if not checked.errors:
            await asyncio.to_thread(enqueue_chunks, self._celery, record.id, len(record.chunks))
        return web.json_response(record.to_openai())

    def _check(self, file_id: str, endpoint: str) -> CheckedInput:
        chat = endpoint == "/v1/chat/completions"
        with self._files.open(file_id) as source:
            return check_input(source, endpoint, lambda body: parse_request(body, chat), self._chunk_lines)

    async def owned(self, request: web.Request) -> BatchRecord:
        batch_id = request.match_info["batch_id"]
        record = await self._store.get(batch_id) if batch_id.startswith("batch_") else None
        if record is None or record.owner != self._files_api.owner(request):
            raise NotFound(f"batch_id: no batch {batch_id!r}")
        return record

    async def retrieve(self, request: web.Request) -> web.Response:
        return web.json_response((await self.owned(request)).to_openai())

    async def list(self, request: web.Request) -> web.Response:
        least, most, default = _LIST_LIMIT
        try:
            limit = int(request.query.get("limit", default))
        except ValueError:
            raise InvalidArgument("limit", f"must be an integer from {least} to {most}") from None
        if not least <= limit <= most:
            raise InvalidArgument("limit", f"must be an integer from {least} to {most}, got {limit}")
        records, more = await self._store.list(self._files_api.owner(request), request.query.get("after"), limit)
        data = [r.to_openai() for r in records]
        first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
        return web.json_response({"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more})

    async def cancel(self, request: web.Request) -> web.Response:
        record = await self.owned(request)
        status = await self._store.transition(record.id, "cancelling", CANCELLABLE)
        if status in TERMINAL and status != "cancelled":
            raise FailedPrecondition("batch_id", f"the batch is {status}; only a validating or running one can be")
        if status == "finalizing":
            raise FailedPrecondition("batch_id", "the batch is finalizing its results; it can no longer be cancelled")
        return web.json_response((await self.owned(request)).to_openai())


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > _METADATA_KEYS:
        raise InvalidArgument("metadata", f"must be an object of at most {_METADATA_KEYS} string pairs")
    for key, item in value.items():
        if len(key) > _METADATA_KEY_LENGTH or not isinstance(item, str) or len(item) > _METADATA_VALUE_LENGTH:
            raise InvalidArgument(
                f"metadata.{key}",
                f"keys have at most {_METADATA_KEY_LENGTH} characters, values are strings of at most "
                f"{_METADATA_VALUE_LENGTH}",
            )
    return value


def vars_of(chunk: object) -> dict:
    return {name: getattr(chunk, name) for name in chunk.__slots__}  # type: ignore[attr-defined]
