"""Remote prefills under way: a request's prompt computed on a prefill worker, its blocks sent to the
worker that runs it, before that worker gets the request.

The request is dispatched as any other (RUNNING in Redis, held on its decode worker, which keeps a
slot for it); only its NewRequest waits here. The prefill worker's KvTransfer.PrefillBlocks computes
the prompt's KV and pushes its full blocks to the decode worker, which files them in its prefix
cache; the request then arrives there and finds them as prefix hits, computing only its partial
last block. Whatever goes wrong with a prefill worker (it dies mid-prefill or mid-transfer, refuses,
or outlasts the timeout) costs the request only time: the next prefill worker is tried, and after
the last one the decode worker prefills the request itself, with the same tokens. Nothing about the
request's state changes meanwhile, so a scheduler restart re-queues it from Redis as any running one.
"""

import asyncio
import logging
from collections.abc import Callable

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from scheduler_svc.live_request import LiveRequest
from scheduler_svc.worker_registry import RegisteredWorker
from shardline.proto import worker_pb2, worker_pb2_grpc
from tracing import attributes as attr
from tracing.grpc_context import aio_client_interceptors

log = logging.getLogger(__name__)

# Called once a request's prefill is settled (its blocks sent, or every prefill worker failed), with
# the request, its decode worker and the NewRequest to send there; it checks the request still runs there.
ReadyHandler = Callable[[LiveRequest, RegisteredWorker, worker_pb2.NewRequest], None]


class RemotePrefills:
    """Runs each remote prefill as a task, with fallback; `cancel` drops one whose request went away."""

    def __init__(self, tracer: trace.Tracer, timeout_s: float, on_ready: ReadyHandler) -> None:
        self._tracer = tracer
        self._timeout_s = timeout_s
        self._on_ready = on_ready
        self._tasks: dict[str, asyncio.Task[None]] = {}  # by request id

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tasks

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        return list(self._tasks.values())

    def start(
        self,
        request: LiveRequest,
        decode: RegisteredWorker,
        new: worker_pb2.NewRequest,
        prefill_workers: list[RegisteredWorker],
        span_context: otel_context.Context,
    ) -> None:
        """Prefills `new`'s tokens on the first of `prefill_workers` that succeeds, then hands `new` to
        on_ready; its span joins `span_context` (the dispatch span's)."""
        task = asyncio.create_task(
            self._run(request, decode, new, prefill_workers, span_context), name=f"prefill-{request.request_id}"
        )
        self._tasks[request.request_id] = task
        task.add_done_callback(lambda done: self._forget(request.request_id, done))

    def _forget(self, request_id: str, task: asyncio.Task) -> None:
        # Only its own entry: a request re-dispatched meanwhile may have a newer prefill under way.
        if self._tasks.get(request_id) is task:
            del self._tasks[request_id]

    def cancel(self, request_id: str) -> bool:
        """Drops a remote prefill (its request was cancelled or moved); False when none runs for it."""
        task = self._tasks.pop(request_id, None)
        if task is None or task.done():
            return False
        task.cancel()
        return True

    async def _run(
        self,
        request: LiveRequest,
        decode: RegisteredWorker,
        new: worker_pb2.NewRequest,
        prefill_workers: list[RegisteredWorker],
        span_context: otel_context.Context,
    ) -> None:
        tokens = [*new.prompt_token_ids, *new.output_token_ids]
        span = self._tracer.start_span(
            "remote_prefill",
            context=span_context,
            attributes={
                attr.REQUEST_ID: request.request_id,
                attr.WORKER_ID: decode.worker_id,
                attr.NUM_TOKENS: len(tokens),
            },
        )
        outcome = "fallback_local"
        try:
            for prefill in prefill_workers:
                result = await self._prefill_on(prefill, decode, request, tokens, span)
                if result is not None:
                    outcome = "remote"
                    span.set_attribute(attr.PREFILL_WORKER_ID, prefill.worker_id)
                    span.set_attribute(attr.PREFILL_BLOCKS_SENT, result.imported + result.already_cached)
                    break
            if outcome != "remote":
                log.warning(
                    "request %s: no prefill worker computed its %d tokens; %s prefills it itself",
                    request.request_id,
                    len(tokens),
                    decode.worker_id,
                )
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            span.set_attribute(attr.PREFILL_OUTCOME, outcome)
            span.end()
        # Settled: from here a cancel finds the request on its worker, not here (both in this one step).
        if (this := asyncio.current_task()) is not None:
            self._forget(request.request_id, this)
        self._on_ready(request, decode, new)

    async def _prefill_on(
        self,
        prefill: RegisteredWorker,
        decode: RegisteredWorker,
        request: LiveRequest,
        tokens: list[int],
        span: trace.Span,
    ) -> worker_pb2.PushBlocksResult | None:
        """One prefill worker's try: what the decode worker imported, or None (logged, on the span) on failure."""
        prefill.prefills_in_flight += 1
        try:
            async with grpc.aio.insecure_channel(prefill.info.address, interceptors=aio_client_interceptors()) as ch:
                # The prefill worker's server span joins the request's trace; a failure is recorded below.
                with trace.use_span(span, record_exception=False, set_status_on_exception=False):
                    result = await worker_pb2_grpc.KvTransferStub(ch).PrefillBlocks(
                        worker_pb2.PrefillBlocksRequest(
                            request_id=request.request_id,
                            token_ids=tokens,
                            target_address=decode.info.address,
                            priority=request.priority,
                        ),
                        timeout=self._timeout_s,
                    )
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "request %s: remote prefill on %s failed (%s %s)",
                request.request_id,
                prefill.worker_id,
                exc.code().name,
                exc.details(),
            )
            span.add_event(
                "prefill_failed",
                {attr.PREFILL_WORKER_ID: prefill.worker_id, attr.PREFILL_ERROR: f"{exc.code().name}: {exc.details()}"},
            )
            return None
        finally:
            prefill.prefills_in_flight -= 1
        log.info(
            "request %s: %d tokens prefilled on %s, %d blocks in %s",
            request.request_id,
            len(tokens),
            prefill.worker_id,
            result.imported + result.already_cached,
            decode.worker_id,
        )
        return result
