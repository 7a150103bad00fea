"""The gateway's links to the tokenizer and scheduler services, and how their errors surface."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.upstream.bounded_tokenizer import BoundedTokenizer
from shardline.core.errors import (
    NO_WORKER,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    RequestIdTaken,
    ResourceExhausted,
    ShardlineError,
    Unavailable,
)
from shardline.core.grpc_server import GRPC_OPTIONS
from shardline.proto import scheduler_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from tracing.grpc_context import aio_client_interceptors

# Unary calls to a dependency; the long Subscribe stream has none.
RPC_TIMEOUT_S = 30.0
HEALTH_TIMEOUT_S = 2.0


class Backends:
    """Channels and stubs for tokenizer_svc and scheduler_svc, with the tokenizer's description cached."""

    def __init__(self, tokenizer_address: str, scheduler_address: str, max_tokenizer_calls: int = 32) -> None:
        # The interceptors put the caller's trace context on every rpc, so Submit joins the request's trace.
        self._tokenizer_channel = grpc.aio.insecure_channel(
            tokenizer_address, options=GRPC_OPTIONS, interceptors=aio_client_interceptors()
        )
        self._scheduler_channel = grpc.aio.insecure_channel(
            scheduler_address, options=GRPC_OPTIONS, interceptors=aio_client_interceptors()
        )
        self.tokenizer = BoundedTokenizer(
            tokenizer_pb2_grpc.TokenizerStub(self._tokenizer_channel), max_tokenizer_calls
        )
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self._scheduler_channel)
        self._info: tokenizer_pb2.TokenizerInfo | None = None

    async def tokenizer_info(self) -> tokenizer_pb2.TokenizerInfo:
        """The served model's tokenizer facts; fetched once, since a tokenizer service never changes model."""
        if self._info is None:
            with upstream("tokenizer"):
                self._info = await self.tokenizer.GetInfo(
                    tokenizer_pb2.GetTokenizerInfoRequest(), timeout=RPC_TIMEOUT_S
                )
        return self._info

    async def scheduler_ready(self) -> None:
        """Wait until the scheduler's channel is connected (forever, while the scheduler is down)."""
        await self._scheduler_channel.channel_ready()

    async def health(self) -> dict[str, bool]:
        """Whether each dependency answers its gRPC health check."""
        tokenizer, scheduler = await asyncio.gather(
            _serving(self._tokenizer_channel), _serving(self._scheduler_channel)
        )
        return {"tokenizer": tokenizer, "scheduler": scheduler}

    async def close(self) -> None:
        await self._tokenizer_channel.close()
        await self._scheduler_channel.close()


async def _serving(channel: grpc.aio.Channel) -> bool:
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S
        )
    except grpc.aio.AioRpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def upstream_error(service: str, exc: grpc.aio.AioRpcError) -> ShardlineError:
    """The gateway's error for a failed call to `service`, keeping the status clients act on."""
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, _, problem = details.partition(": ")
        return InvalidArgument(field, problem) if problem else InvalidArgument("request", details)
    if code == grpc.StatusCode.ALREADY_EXISTS:
        field, _, problem = details.partition(": ")
        return RequestIdTaken(field, problem) if problem else RequestIdTaken("request_id", details)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(details)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        field, _, problem = details.partition(": ")
        return FailedPrecondition(field, problem) if problem else FailedPrecondition("request", details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(details or f"{service} is at capacity; retry later")
    if code == grpc.StatusCode.UNAVAILABLE and details.startswith(NO_WORKER):  # the scheduler is fine
        return Unavailable(details)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return Unavailable(f"{service} unavailable: {details or code.name}")
    return ShardlineError(f"{service} failed: {code.name}: {details}")


@contextmanager
def upstream(service: str) -> Iterator[None]:
    """Turns a failed rpc to `service` inside the block into the matching ShardlineError."""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        raise upstream_error(service, exc) from exc
