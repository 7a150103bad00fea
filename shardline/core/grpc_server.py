"""The one way every Shardline service runs its grpc.aio server.

It adds the standard health service (grpc.health.v1) and server reflection,
maps ShardlineError (and ValueError) to status codes instead of tracebacks,
and stops gracefully on SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shardline.core.errors import ShardlineError
from shardline.proto import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # A port in use is an error, not a share: with SO_REUSEPORT a second server on it would take
    # part of the first one's connections.
    ("grpc.so_reuseport", 0),
    # Between the services: a restarted peer is reconnected to within 2 s, not grpc's default of up
    # to 120 s of backoff, for calls that wait for the channel to be ready (the gateway's Detokenize).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # grpc's own backlog of calls the application has not picked up yet: past 1,000 (its default)
    # it sheds calls at random as a bare CANCELLED, which a client cannot tell from its own cancel
    # (224 of 2,000 calls at once). A burst waits there instead, and each service answers overload
    # with its own status: the gateway's 429 / RESOURCE_EXHAUSTED, the scheduler's full queue.
    ("grpc.server.max_pending_requests", 20_000),
    ("grpc.server.max_pending_requests_hard_limit", 40_000),
]


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns ShardlineError/ValueError raised by a handler into a proper status, never a traceback,
    and a request that is no valid message (bad UTF-8 in a string, say) into INVALID_ARGUMENT: grpc
    itself answers UNKNOWN with a Python exception's text."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary), _tolerant(handler.request_deserializer), handler.response_serializer
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream), _tolerant(handler.request_deserializer), handler.response_serializer
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary), handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(handler.stream_stream), handler.request_deserializer, handler.response_serializer
            )
        return handler


@dataclass(frozen=True, slots=True)
class _Undecodable:
    """Stands in for a request message that failed to parse, so its rpc can answer INVALID_ARGUMENT."""

    problem: str


def _tolerant(parse: Callable[[bytes], object] | None) -> Callable[[bytes], object] | None:
    if parse is None:
        return None

    def parse_or_flag(raw: bytes) -> object:
        try:
            return parse(raw)
        except DecodeError as exc:
            return _Undecodable(str(exc))

    return parse_or_flag


async def _refuse_undecodable(request: object, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, _Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid message ({request.problem})")


async def _abort_for(exc: Exception, context: grpc.aio.ServicerContext) -> None:
    if isinstance(exc, ShardlineError):
        await context.abort(exc.code, str(exc))
    if isinstance(exc, ValueError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    log.exception("unhandled error in rpc")
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


def _wrap_unary(fn):
    async def wrapper(request, context):
        await _refuse_undecodable(request, context)
        try:
            return await fn(request, context)
        except grpc.aio.AbortError:
            raise  # the handler chose its own status
        except Exception as exc:
            await _abort_for(exc, context)

    return wrapper


def _wrap_stream(fn):
    async def wrapper(request, context):
        await _refuse_undecodable(request, context)
        try:
            async for item in fn(request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort_for(exc, context)

    return wrapper


@dataclass
class GrpcService:
    """A servicer, the function that registers it, and its full service name (for health and reflection)."""

    servicer: object
    add_to_server: Callable[[object, grpc.aio.Server], None]
    full_name: str


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)

    async def set_serving(self, serving: bool, names: Iterable[str] = ("",)) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in names:
            await self.health.set(name, status)

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.set_serving(False)
        await self.server.stop(grace_s)
        self._stopping.set()

    async def wait_for_signal(
        self,
        on_stop: Callable[[], Awaitable[None]] | None = None,
        grace_s: float = 5.0,
        stop: asyncio.Event | None = None,
    ) -> None:
        """Block until SIGTERM/SIGINT, then run `on_stop` and stop the server gracefully.

        `stop`: the event a caller's own signal handlers set before this was called (a signal that
        came in between is not lost); an event already set stops the server at once.
        """
        loop = asyncio.get_running_loop()
        stop = stop or asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        waiter = asyncio.create_task(self._stopping.wait())
        signal_task = asyncio.create_task(stop.wait())
        await asyncio.wait({waiter, signal_task}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        signal_task.cancel()
        if not self._stopping.is_set():
            log.info("signal received: shutting down")
            await self.set_serving(False)
            if on_stop is not None:
                await on_stop()
            await self.stop(grace_s)


async def start_grpc_server(
    services: list[GrpcService],
    port: int,
    host: str = "0.0.0.0",
    interceptors: list[grpc.aio.ServerInterceptor] | None = None,
) -> RunningServer:
    """Start a server with health + reflection; port 0 picks a free port."""
    server = grpc.aio.server(interceptors=[*(interceptors or []), ErrorMappingInterceptor()], options=GRPC_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for svc in services:
        svc.add_to_server(svc.servicer, server)
    names = [svc.full_name for svc in services]
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:  # grpc's way of saying the bind failed (most often: the port is in use)
        raise OSError(f"cannot bind gRPC port {host}:{port} (in use?)") from exc
    if bound == 0:
        raise OSError(f"cannot bind gRPC port {host}:{port}")
    await server.start()
    running = RunningServer(server, bound, health_servicer)
    await running.set_serving(True, ["", *names])
    return running
