"""The `shardline.v1.KvTransfer` gRPC service: KV blocks in and out of this worker's prefix cache.

Exports and imports run on the engine thread between steps (EngineLoop.call). A pushed transfer
is imported only once its stream has ended whole, so a sender that dies mid-stream leaves this
worker's cache as it was. A remote prefill (PrefillBlocks) runs in the engine beside the worker's
requests, then is sent as SendBlocks sends; see docs/kv_transfer.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TypeVar

import grpc

from gpu_worker_svc.engine.kv_transfer import ImportResult, KvBlocks, KvLayout, KvLayoutMismatch, KvTransferError
from gpu_worker_svc.engine.llm_engine import LLMEngine
from gpu_worker_svc.server.engine_loop import EngineLoop, PrefillFailed
from gpu_worker_svc.server.kv_wire import KvAssembler, kv_chunks
from shardline.core.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from shardline.proto import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "shardline.v1.KvTransfer"
T = TypeVar("T")


def _refusal(exc: KvTransferError) -> Exception:
    """Another layout is a state the sender cannot fix by resending: FAILED_PRECONDITION; a bad payload
    is INVALID_ARGUMENT. Both name the field."""
    if isinstance(exc, KvLayoutMismatch):
        return FailedPrecondition(exc.field, exc.problem)
    return InvalidArgument(exc.field, exc.problem)


def _result_message(result: ImportResult) -> worker_pb2.PushBlocksResult:
    return worker_pb2.PushBlocksResult(
        imported=result.imported, already_cached=result.already_cached, no_room=result.no_room
    )


class KvTransferServicer(worker_pb2_grpc.KvTransferServicer):
    """Pushes, exports and sends KV blocks (protos/shardline/v1/worker.proto, service KvTransfer)."""

    def __init__(self, engine_loop: EngineLoop, layout: KvLayout, max_blocks: int) -> None:
        self._engine_loop = engine_loop
        self._layout = layout
        self._max_blocks = max_blocks  # this worker's KV blocks: a larger transfer could never be imported

    def _check_transferable(self) -> None:
        if self._layout.tp_size != 1:
            raise FailedPrecondition(
                "tp_size",
                f"KV transfer needs tp_size 1 (each rank holds a shard), this worker has {self._layout.tp_size}",
            )

    async def _on_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        try:
            return await asyncio.wrap_future(self._engine_loop.call(fn))
        except KvTransferError as exc:
            raise _refusal(exc) from None

    async def PushBlocks(
        self, request_iterator: AsyncIterator[worker_pb2.KvChunk], context: grpc.aio.ServicerContext
    ) -> worker_pb2.PushBlocksResult:
        self._check_transferable()
        assembler = KvAssembler(self._max_blocks, self._layout)
        received = 0
        try:
            async for chunk in request_iterator:
                assembler.add(chunk)
                received += 1
            incoming, blocks = assembler.finish()
        except KvTransferError as exc:
            log.warning("KV push from %s refused: %s", context.peer(), exc)
            raise _refusal(exc) from None
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            log.warning("KV push from %s broke after %d chunks: nothing imported", context.peer(), received)
            raise
        result: ImportResult = await self._on_engine(lambda engine: engine.import_blocks(incoming, blocks))
        log.info(
            "KV push from %s: %d blocks imported, %d held already, %d without room",
            context.peer(),
            result.imported,
            result.already_cached,
            result.no_room,
        )
        return _result_message(result)

    async def ExportBlocks(
        self, request: worker_pb2.ExportBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.KvChunk]:
        self._check_transferable()
        prompt = list(request.prompt_token_ids)
        blocks: KvBlocks = await self._on_engine(lambda engine: engine.export_prefix(prompt))
        for chunk in kv_chunks(self._layout, blocks):
            yield chunk

    async def SendBlocks(
        self, request: worker_pb2.SendBlocksRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PushBlocksResult:
        self._check_transferable()
        if not request.target_address:
            raise InvalidArgument("target_address", "required")
        blocks: KvBlocks = await self._on_engine(lambda engine: _export(engine, request))
        return await self._push(blocks, request.target_address, context)

    async def PrefillBlocks(
        self, request: worker_pb2.PrefillBlocksRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PushBlocksResult:
        self._check_transferable()
        if not request.target_address:
            raise InvalidArgument("target_address", "required")
        tokens = list(request.token_ids)
        limits = self._engine_loop.limits
        if not tokens:
            raise InvalidArgument("token_ids", "must not be empty")
        if len(tokens) >= limits.max_model_len:  # the prefill samples one token after them
            raise InvalidArgument("token_ids", f"{len(tokens)} tokens, this worker holds {limits.max_model_len - 1}")
        if max(tokens) >= limits.vocab_size:
            raise InvalidArgument("token_ids", f"must be in [0, {limits.vocab_size})")
        log.info("prefilling %d tokens of request %s for %s", len(tokens), request.request_id, request.target_address)
        job_id, future = self._engine_loop.prefill(request.request_id, tokens, request.priority)
        try:
            blocks = await asyncio.wrap_future(future)
        except asyncio.CancelledError:  # the scheduler gave up on it: the engine need not finish it
            self._engine_loop.cancel_prefill(job_id)
            raise
        except PrefillFailed as exc:
            raise Unavailable(f"prefill of request {request.request_id!r} failed: {exc}") from None
        return await self._push(blocks, request.target_address, context)

    async def _push(
        self, blocks: KvBlocks, target_address: str, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PushBlocksResult:
        # Slabs are under gRPC's default message limit: a channel with default options carries them.
        async with grpc.aio.insecure_channel(target_address) as channel:
            stub = worker_pb2_grpc.KvTransferStub(channel)
            try:
                result = await stub.PushBlocks(_aiter(kv_chunks(self._layout, blocks)))
            except grpc.aio.AioRpcError as exc:  # the receiver's own refusal, passed on with its code
                await context.abort(exc.code(), f"target {target_address}: {exc.details()}")
        log.info("KV send of %d blocks to %s: %d imported", len(blocks), target_address, result.imported)
        return result


def _export(engine: LLMEngine, request: worker_pb2.SendBlocksRequest) -> KvBlocks:
    if request.request_id:
        try:
            return engine.export_request(request.request_id)
        except KeyError:
            raise NotFound(f"request_id: {request.request_id!r} is not running on this worker") from None
    return engine.export_prefix(list(request.prompt_token_ids))


async def _aiter(chunks: Iterable[worker_pb2.KvChunk]) -> AsyncIterator[worker_pb2.KvChunk]:
    """The chunks as an async stream, built one at a time so a large transfer is never all in messages."""
    for chunk in chunks:
        yield chunk
