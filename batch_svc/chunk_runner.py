"""One chunk of a batch: its lines not yet done, sent through the gateway, each result kept once.

A chunk may run more than once (its worker died, Redis redelivered it): the lines already in the
batch's done-set are skipped, and those that were in flight attach to their running requests at the
gateway (line_client.py). A cancel or the end of the window stops the chunk within a second: the
lines in flight are cancelled at the gateway and keep no result.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import grpc
from opentelemetry import trace

from batch_svc.aimd import AimdLimit
from batch_svc.finalize import finalize
from batch_svc.line_client import LineClient, LineResult, Stopped
from batch_svc.metrics import CHUNKS, IN_FLIGHT, LINES
from batch_svc.settings import BatchSettings
from shardline.core.batch.batch_record import TERMINAL, BatchRecord
from shardline.core.batch.batch_store import BatchStore
from shardline.core.batch.file_store import FileStore
from shardline.core.batch.input_lines import BatchLine, LineChunk, read_chunk
from shardline.core.batch.output_lines import error_line, output_line
from shardline.proto import common_pb2, generation_pb2_grpc
from tracing import attributes as attr

logger = logging.getLogger(__name__)

# How often a running chunk looks for a cancel or the end of its batch's window.
STOP_CHECK_S = 0.5


class ChunkRunner:
    """Runs chunks for one worker thread: its own event loop, HTTP session and gRPC channel."""

    def __init__(self, settings: BatchSettings, store: BatchStore, files: FileStore, tracer: trace.Tracer) -> None:
        self._settings = settings
        self._store = store
        self._files = files
        self._tracer = tracer

    async def run(self, batch_id: str, chunk_index: int) -> int:
        """Runs the chunk; returns how many of its lines this run kept a result for."""
        record = await self._store.get(batch_id)
        if record is None or record.status in TERMINAL:
            return 0
        with self._tracer.start_as_current_span(
            "batch.chunk", attributes={attr.BATCH_ID: batch_id, attr.BATCH_CHUNK: chunk_index}
        ) as span:
            kept = 0
            if _stopping(record):
                await self._mark_expired(record)
            else:
                await self._store.transition(batch_id, "in_progress", ("validating",))
                kept = await self._run_lines(record, LineChunk(**record.chunks[chunk_index]))
            span.set_attribute(attr.BATCH_LINES_KEPT, kept)
        CHUNKS.inc()
        if await self._store.chunk_done(batch_id, chunk_index) >= len(record.chunks):
            record = await self._store.get(batch_id)
            if record is not None:
                await finalize(self._store, self._files, record)
        return kept

    async def _run_lines(self, record: BatchRecord, chunk: LineChunk) -> int:
        lines = await asyncio.to_thread(self._read, record, chunk)
        done = await self._store.done_lines(record.id, chunk.first_line, chunk.lines)
        todo = [line for line in lines if line.index not in done]
        if not todo:
            return 0
        stop = asyncio.Event()
        watcher = asyncio.create_task(self._watch(record.id, stop))
        limit = AimdLimit(self._settings.batch_max_in_flight)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                client = LineClient(
                    self._settings.gateway_url, self._settings.batch_api_key, self._settings.batch_priority, session
                )
                tasks = {asyncio.create_task(self._line(record, line, client, limit, stop)): line for line in todo}
                stopper = asyncio.create_task(stop.wait())
                pending = set(tasks)
                while pending and not stop.is_set():
                    _, pending = await asyncio.wait(pending | {stopper}, return_when=asyncio.FIRST_COMPLETED)
                    pending.discard(stopper)
                if pending:  # cancelled or expired: what is in flight is abandoned, and cancelled upstream
                    for task in pending:
                        task.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
                    await self._cancel_upstream(record, [tasks[t] for t in pending])
                stopper.cancel()
                return sum(1 for t in tasks if not t.cancelled() and t.exception() is None and t.result())
        finally:
            watcher.cancel()

    def _read(self, record: BatchRecord, chunk: LineChunk) -> list[BatchLine]:
        with self._files.open(record.input_file_id) as source:
            return read_chunk(source, chunk, record.endpoint)

    async def _line(
        self, record: BatchRecord, line: BatchLine, client: LineClient, limit: AimdLimit, stop: asyncio.Event
    ) -> bool:
        request_id = line_request_id(record.id, line.index)
        IN_FLIGHT.inc()
        attributes = {attr.BATCH_ID: record.id, attr.REQUEST_ID: request_id}
        try:
            with self._tracer.start_as_current_span("batch.line", attributes=attributes) as span:
                result = await client.send(line, record.endpoint, request_id, limit, stop.is_set)
                span.set_attribute("http.response.status_code", result.status or 0)
        except Stopped:
            return False
        finally:
            IN_FLIGHT.dec()
        ok = result.status == 200
        kept = await self._store.record_line(record.id, line.index, ok, _result_line(record.id, line, result))
        if kept:
            LINES.labels(result="completed" if ok else "failed").inc()
        return kept

    async def _watch(self, batch_id: str, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(STOP_CHECK_S)
            try:
                record = await self._store.get(batch_id)
            except Exception as exc:  # Redis away for a moment: the chunk goes on, and looks again
                logger.warning("%s: could not read the batch (%s)", batch_id, exc)
                continue
            if record is None or _stopping(record):
                if record is not None:
                    await self._mark_expired(record)
                stop.set()

    async def _mark_expired(self, record: BatchRecord) -> None:
        """A batch stopped by its window, not a cancel, ends expired."""
        if record.status != "cancelling" and not record.expired:
            await self._store.set_fields(record.id, expired="1")

    async def _cancel_upstream(self, record: BatchRecord, lines: list[BatchLine]) -> None:
        """Cancels the requests of lines in flight: a named request outlives its client's leaving."""
        key = self._settings.batch_api_key
        metadata = [("authorization", f"Bearer {key}")] if key else None
        async with grpc.aio.insecure_channel(self._settings.gateway_grpc_address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            ids = [rid for line in lines for rid in choice_ids(line_request_id(record.id, line.index), line.body)]
            results = await asyncio.gather(
                *(stub.Cancel(common_pb2.CancelRequest(request_id=rid), metadata=metadata, timeout=5) for rid in ids),
                return_exceptions=True,
            )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            logger.info("%s: %d of %d cancels not done (%s)", record.id, len(failed), len(ids), failed[0])


def line_request_id(batch_id: str, index: int) -> str:
    return f"{batch_id}-{index}"


def choice_ids(request_id: str, body: dict) -> list[str]:
    """The gateway's request ids for a line: its own, or `<id>-<k>` for each of several choices."""
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    choices = prompts * int(body.get("n") or 1)
    return [request_id] if choices == 1 else [f"{request_id}-{k}" for k in range(choices)]


def _stopping(record: BatchRecord) -> bool:
    expires_at = record.timestamps.get("expires_at")
    past_window = expires_at is not None and time.time() >= expires_at
    return record.status == "cancelling" or record.expired or past_window


def _result_line(batch_id: str, line: BatchLine, result: LineResult) -> str:
    if result.status is None:
        return error_line(batch_id, line.index, line.custom_id, "no_response", result.error)
    return output_line(batch_id, line.index, line.custom_id, result.status, result.request_id, result.body)
