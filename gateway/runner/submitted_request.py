"""A submitted request as its front end follows it: its chunks within its deadline, and its end recorded."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from opentelemetry import trace

from gateway.output.collected_output import CollectedOutput
from gateway.output.request_stream import RequestStream, StreamChunk
from gateway.output.stream_hub import StreamHub
from gateway.runner.generation_spec import PreparedRequest
from gateway.runner.request_metrics import RequestEnd, record_end
from gateway.tenancy.tenant_limiter import Hold, TenantLimiter
from shardline.core.errors import DeadlineExceeded

logger = logging.getLogger(__name__)

# The scheduler aborts a request at its deadline; the gateway gives it this long to say so.
DEADLINE_GRACE_S = 5.0
# An abort that arrives this close to the deadline (or later) is the scheduler's deadline cancel;
# the scheduler's clock is another machine's, so allow some skew.
DEADLINE_SKEW_S = 1.0


class SubmittedRequest:
    """A submitted request: its chunks, and the bookkeeping when its consumer is done."""

    def __init__(
        self,
        prepared: PreparedRequest,
        model: str,
        stream: RequestStream,
        deadline_s: float,
        hub: StreamHub,
        limiter: TenantLimiter | None,
        tracer: trace.Tracer,
        hold: Hold | None = None,
    ) -> None:
        spec = prepared.spec
        self.request_id = spec.request_id
        self.model = model
        self.prompt_tokens = stream.prompt_tokens
        self.prompt = spec.prompt  # as the client sent it
        self.prompt_ids = prepared.prompt_ids  # as the model reads it
        self._tenant, self._ttft_target_s = prepared.tenant.name, prepared.slo.ttft_target_s
        self._spec = spec
        self._stream = stream
        self._span = prepared.span
        self._deadline_s = deadline_s
        self._hub = hub
        self._limiter = limiter
        self._tracer = tracer
        self._last: StreamChunk | None = None
        self._hold = hold  # its charge to its tenant's limits, ended when the request ends
        self.rate_limit_headers = hold.headers if hold is not None else {}  # OpenAI's x-ratelimit-*

    async def chunks(self) -> AsyncIterator[StreamChunk]:
        """The output as it is produced; the last chunk has finish_reason and usage."""
        while self._last is None or self._last.finish_reason is None:
            try:
                async with asyncio.timeout(max(0.0, self._deadline_s - time.perf_counter()) + DEADLINE_GRACE_S):
                    chunk = await self._stream.queue.get()
                if chunk.finish_reason == "abort" and time.perf_counter() > self._deadline_s - DEADLINE_SKEW_S:
                    chunk.error = self._timed_out()  # the scheduler ends a request at its deadline by cancelling it
            except TimeoutError:
                logger.warning("%s: no end from the scheduler past the deadline; aborting", self.request_id)
                self._hub.release(self.request_id)
                completed = self._stream.next_offset
                chunk = StreamChunk(
                    "", [], completed, finish_reason="abort", error=self._timed_out(), usage=self._stream.usage()
                )
            self._last = chunk
            if chunk.finish_reason is not None and self._hold is not None and self._limiter is not None:
                await self._limiter.settle(self._hold, chunk)  # before the client has it: its slot is free
            yield chunk

    def _timed_out(self) -> str:
        return f"request timed out after {self._deadline_s - self._spec.arrival_s:g} s"

    async def collect(self) -> CollectedOutput:
        """The whole output, once the request finishes."""
        completion = CollectedOutput()
        async for chunk in self.chunks():
            completion.add(chunk)
        return completion

    def close(self, grace_s: float = 0.0) -> None:
        """The consumer is done or gone: cancel upstream if unfinished (after `grace_s`, unless the
        request is resumed meanwhile), record metrics and spans."""
        self._hub.release(self.request_id, cancel=not self._spec.idempotent, grace_s=grace_s)
        last = self._last if self._last is not None and self._last.finish_reason is not None else None
        if last is None and self._hold is not None and self._limiter is not None:
            self._limiter.detach(self._hold)  # it still holds its slot until it ends
        end = RequestEnd(
            request_id=self.request_id,
            model=self.model,
            tenant=self._tenant,
            ttft_target_s=self._ttft_target_s,
            arrival_s=self._spec.arrival_s,
            timing=self._stream.timing,
            end_s=time.perf_counter(),
            usage=last.usage if last is not None and last.usage is not None else self._stream.usage(),
            finish_reason=last.finish_reason if last is not None and last.finish_reason else "abort",
            timed_out=last is not None and isinstance(last.failure(), DeadlineExceeded),
            error=last.error if last is not None else "",
        )
        record_end(end, self._span, self._tracer)
