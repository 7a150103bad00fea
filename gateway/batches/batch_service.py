"""The Batch API's rules, whatever the transport: the HTTP routes and the gRPC Batches service both call it.

Creating a batch checks its whole input first, each body with the parser the online endpoint uses,
so a line the endpoint would refuse fails the batch, naming the line and the field, before anything
runs. A batch that passes is split into chunks and queued for the batch workers through Celery.
Files and batches belong to the owner (the API key's digest) that made them; another owner's, like
an unknown id, is NotFound.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import IO, Any, BinaryIO

from celery import Celery

from gateway.http_api.openai_request import parse_request
from shardline.core.batch.batch_record import COMPLETION_WINDOWS, TERMINAL, BatchRecord, new_batch_id
from shardline.core.batch.batch_store import BatchStore
from shardline.core.batch.celery_wiring import enqueue_chunks
from shardline.core.batch.file_store import PURPOSES, FileObject, FileStore, new_file_id, now_s, read_chunks
from shardline.core.batch.input_lines import ENDPOINTS, MAX_FILE_BYTES, CheckedInput, check_input
from shardline.core.errors import FailedPrecondition, InvalidArgument, NotFound

CREATE_FIELDS = frozenset({"input_file_id", "endpoint", "completion_window", "metadata"})
# OpenAI's limits on a batch's metadata.
_METADATA_KEYS, _METADATA_KEY_LENGTH, _METADATA_VALUE_LENGTH = 16, 64, 512
LIST_LIMIT = (1, 100, 20)  # least, most and default `limit`
CANCELLABLE = ("validating", "in_progress")
# An upload is spooled in memory up to this size, then on disk.
_SPOOL_BYTES = 8 << 20


@dataclass(slots=True)
class BatchCreate:
    """A request to create a batch, its fields checked (its file is looked up at creation)."""

    input_file_id: str  # a file uploaded with purpose "batch"
    endpoint: str  # the endpoint each line is sent to
    completion_window: str  # how long the batch may take
    metadata: dict[str, str] | None = None  # the client's own tags


def parse_batch_create(body: Any) -> BatchCreate:
    """A create request's fields (OpenAI's JSON body); InvalidArgument names a bad one."""
    if not isinstance(body, dict):
        raise InvalidArgument("body", "must be a JSON object")
    if unknown := sorted(set(body) - CREATE_FIELDS):
        raise InvalidArgument(unknown[0], "unknown field")
    endpoint, window = body.get("endpoint"), body.get("completion_window")
    if endpoint not in ENDPOINTS:
        raise InvalidArgument("endpoint", f"must be one of {list(ENDPOINTS)}, got {endpoint!r}")
    if window not in COMPLETION_WINDOWS:
        raise InvalidArgument("completion_window", f"must be one of {list(COMPLETION_WINDOWS)}, got {window!r}")
    metadata = _metadata(body.get("metadata"))
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str):
        raise InvalidArgument("input_file_id", "is required: the id of a file uploaded with purpose 'batch'")
    return BatchCreate(file_id, endpoint, window, metadata)


class UploadSpool:
    """An upload's bytes as they arrive, refused past the most a file may have."""

    def __init__(self) -> None:
        self.file: IO[bytes] = tempfile.SpooledTemporaryFile(_SPOOL_BYTES)
        self.size = 0

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > MAX_FILE_BYTES:
            raise InvalidArgument("file", f"is over {MAX_FILE_BYTES} bytes, the most a file may have")
        self.file.write(chunk)

    def __enter__(self) -> UploadSpool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()


class BatchService:
    """Files and batches of the Batch API, for one owner at a time."""

    def __init__(
        self, store: BatchStore, files: FileStore, celery: Celery, chunk_lines: int, window_s: float | None
    ) -> None:
        self.store = store
        self._files = files
        self._celery = celery
        self._chunk_lines = chunk_lines
        self._window_s = window_s  # a setting that shortens every window (tests of expiry)

    # -- files ----------------------------------------------------------------
    async def save_file(self, owner: str, filename: str | None, purpose: str | None, spool: UploadSpool) -> FileObject:
        """Stores an upload; `filename` None: no file came with it."""
        if filename is None:
            raise InvalidArgument("file", "is required")
        if purpose not in PURPOSES:
            raise InvalidArgument("purpose", f"must be one of {list(PURPOSES)}, got {purpose!r}")
        spool.file.seek(0)
        meta = FileObject(new_file_id(), 0, now_s(), filename or "upload.jsonl", purpose, owner)
        return await asyncio.to_thread(self._files.write, meta, read_chunks(spool.file))

    async def owned_file(self, file_id: str, owner: str) -> FileObject:
        """The file's metadata if `owner` may read it; NotFound otherwise."""
        meta = await asyncio.to_thread(self._files.get, file_id) if _plausible_file(file_id) else None
        if meta is None or meta.owner != owner:
            raise NotFound(f"file_id: no file {file_id!r}")
        return meta

    async def list_files(self, owner: str, purpose: str | None) -> list[FileObject]:
        files = await asyncio.to_thread(self._files.list)
        return [f for f in files if f.owner == owner and purpose in (None, f.purpose)]

    async def delete_file(self, file_id: str, owner: str) -> FileObject:
        meta = await self.owned_file(file_id, owner)
        await asyncio.to_thread(self._files.delete, meta.id)
        return meta

    async def open_file(self, file_id: str, owner: str) -> tuple[FileObject, BinaryIO]:
        """The file's metadata and its bytes to read; the caller closes them."""
        meta = await self.owned_file(file_id, owner)
        return meta, await asyncio.to_thread(self._files.open, meta.id)

    # -- batches --------------------------------------------------------------
    async def create_batch(self, owner: str, request: BatchCreate) -> BatchRecord:
        """A new batch, its whole input checked first: a line the endpoint would refuse fails it."""
        file_id, endpoint, window = request.input_file_id, request.endpoint, request.completion_window
        try:
            meta = await self.owned_file(file_id, owner)
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
            metadata=request.metadata,
            errors=[e.to_openai() for e in checked.errors],
            total=0 if checked.errors else checked.lines,
            chunks=[] if checked.errors else [asdict(c) for c in checked.chunks],
            timestamps={"created_at": now, "expires_at": now + int(self._window_s or COMPLETION_WINDOWS[window])},
        )
        if checked.errors:
            record.timestamps["failed_at"] = now
        await self.store.create(record)
        if not checked.errors:
            await asyncio.to_thread(enqueue_chunks, self._celery, record.id, len(record.chunks))
        return record

    def _check(self, file_id: str, endpoint: str) -> CheckedInput:
        chat = endpoint == "/v1/chat/completions"
        with self._files.open(file_id) as source:
            return check_input(source, endpoint, lambda body: parse_request(body, chat), self._chunk_lines)

    async def owned_batch(self, batch_id: str, owner: str) -> BatchRecord:
        """The batch if `owner` may see it; NotFound otherwise."""
        record = await self.store.get(batch_id) if batch_id.startswith("batch_") else None
        if record is None or record.owner != owner:
            raise NotFound(f"batch_id: no batch {batch_id!r}")
        return record

    async def list_batches(self, owner: str, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """A page of the owner's batches, newest first, and whether older ones follow."""
        least, most, _ = LIST_LIMIT
        if not least <= limit <= most:
            raise InvalidArgument("limit", f"must be an integer from {least} to {most}, got {limit}")
        return await self.store.page(owner, after, limit)

    async def cancel_batch(self, batch_id: str, owner: str) -> BatchRecord:
        """Flags a validating or running batch for its workers to stop; FailedPrecondition once it ended."""
        record = await self.owned_batch(batch_id, owner)
        status = await self.store.transition(record.id, "cancelling", CANCELLABLE)
        if status in TERMINAL and status != "cancelled":
            raise FailedPrecondition("batch_id", f"the batch is {status}; only a validating or running one can be")
        if status == "finalizing":
            raise FailedPrecondition("batch_id", "the batch is finalizing its results; it can no longer be cancelled")
        return await self.owned_batch(batch_id, owner)


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


def _plausible_file(file_id: str) -> bool:
    """Whether `file_id` could name a file at all (never a path out of the store's folder)."""
    return file_id.startswith("file-") and file_id.replace("-", "").isalnum() and len(file_id) <= 64
