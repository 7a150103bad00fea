"""Trace-context propagation through real gRPC calls, recorded by the real OTel SDK."""

import asyncio
import contextvars
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.tracing.run_async import run_async
from tracing.grpc_context import (
    TracingClientInterceptor,
    TracingServerInterceptor,
    _traced,
    aio_client_interceptors,
    extract_context,
    inject_metadata,
    start_http_server_span,
)

CHECK = "grpc.health.v1.Health/Check"


@pytest.fixture
def recorded() -> tuple[trace.Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {span.name: span for span in exporter.get_finished_spans()}


def assert_child(child: ReadableSpan, parent: ReadableSpan) -> None:
    assert child.context.trace_id == parent.context.trace_id
    assert child.parent is not None and child.parent.span_id == parent.context.span_id


def test_inject_then_extract_round_trips(recorded: tuple[trace.Tracer, InMemorySpanExporter]) -> None:
    tracer, _ = recorded
    assert inject_metadata() == []
    with tracer.start_as_current_span("root") as root:
        metadata = inject_metadata()
    assert [key for key, _ in metadata] == ["traceparent"]
    extracted = trace.get_current_span(extract_context(metadata)).get_span_context()
    assert (extracted.trace_id, extracted.span_id) == (
        root.get_span_context().trace_id,
        root.get_span_context().span_id,
    )
    assert extracted.is_remote


def test_http_traceparent_is_honoured_case_insensitively(recorded: tuple[trace.Tracer, InMemorySpanExporter]) -> None:
    tracer, exporter = recorded
    headers = {"Traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "Accept": "*/*"}
    with start_http_server_span(tracer, "POST /v1/completions", headers):
        pass
    with start_http_server_span(tracer, "no parent", {"traceparent": "garbage"}):
        pass
    spans = by_name(exporter)
    served = spans["POST /v1/completions"]
    assert served.kind == trace.SpanKind.SERVER
    assert served.context.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
    assert served.parent.span_id == 0x00F067AA0BA902B7
    assert spans["no parent"].parent is None


async def _stream(request: bytes, _context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    for index in range(3):
        yield request + bytes([index])


def _sync_stream(request: bytes, _context: grpc.ServicerContext) -> Iterator[bytes]:
    yield from (request, request)


async def _join(requests: AsyncIterator[bytes], _context: grpc.aio.ServicerContext) -> bytes:
    return b"".join([request async for request in requests])


async def _echo_each(requests: AsyncIterator[bytes], _context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    async for request in requests:
        yield request


async def _not_found(_request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    context.set_code(grpc.StatusCode.NOT_FOUND)
    context.set_details("no such model")
    return b""


async def _abort(_request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad temperature")


async def _start_server(tracer: trace.Tracer) -> tuple[grpc.aio.Server, int]:
    # The thread pool lets grpc.aio run the sync handlers (the sync health servicer, _sync_stream).
    server = grpc.aio.server(
        interceptors=[TracingServerInterceptor(tracer)], migration_thread_pool=ThreadPoolExecutor(2)
    )
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "test.Echo",
                {
                    "Stream": grpc.unary_stream_rpc_method_handler(_stream),
                    "SyncStream": grpc.unary_stream_rpc_method_handler(_sync_stream),
                    "Join": grpc.stream_unary_rpc_method_handler(_join),
                    "EchoEach": grpc.stream_stream_rpc_method_handler(_echo_each),
                    "NotFound": grpc.unary_unary_rpc_method_handler(_not_found),
                    "Abort": grpc.unary_unary_rpc_method_handler(_abort),
                    "SyncCheck": grpc.unary_unary_rpc_method_handler(
                        lambda request, context: health.HealthServicer().Check(request, context),
                        request_deserializer=health_pb2.HealthCheckRequest.FromString,
                        response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
                    ),
                },
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


@run_async
async def test_aio_client_and_server_interceptors_join_one_trace(
    recorded: tuple[trace.Tracer, InMemorySpanExporter],
) -> None:
    tracer, exporter = recorded
    server, port = await _start_server(tracer)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=aio_client_interceptors()) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            with tracer.start_as_current_span("caller"):
                reply = await stub.Check(health_pb2.HealthCheckRequest())
                chunks = [chunk async for chunk in channel.unary_stream("/test.Echo/Stream")(b"x")]
                sync_chunks = [chunk async for chunk in channel.unary_stream("/test.Echo/SyncStream")(b"y")]
                joined = await channel.stream_unary("/test.Echo/Join")(iter([b"a", b"b"]))
                echoed = [chunk async for chunk in channel.stream_stream("/test.Echo/EchoEach")(iter([b"c", b"d"]))]
                sync_check = channel.unary_unary(
                    "/test.Echo/SyncCheck",
                    request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                    response_deserializer=health_pb2.HealthCheckResponse.FromString,
                )
                await sync_check(health_pb2.HealthCheckRequest(), metadata=[("traceparent", "stale")])
                for rpc, code in (("NotFound", grpc.StatusCode.NOT_FOUND), ("Abort", grpc.StatusCode.INVALID_ARGUMENT)):
                    with pytest.raises(grpc.aio.AioRpcError) as failed:
                        await channel.unary_unary(f"/test.Echo/{rpc}")(b"")
                    assert failed.value.code() == code
            # Outside any span the client sends no context, so the server span is a new root.
            await stub.Check(health_pb2.HealthCheckRequest())
    finally:
        await server.stop(None)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert chunks == [b"x\x00", b"x\x01", b"x\x02"] and sync_chunks == [b"y", b"y"]
    assert joined == b"ab" and echoed == [b"c", b"d"]
    spans = exporter.get_finished_spans()
    caller = next(span for span in spans if span.name == "caller")
    checks = [span for span in spans if span.name == CHECK]
    assert len(checks) == 2
    assert_child(checks[0], caller)
    assert checks[0].kind == trace.SpanKind.SERVER
    assert dict(checks[0].attributes) == {
        "rpc.system": "grpc",
        "rpc.service": "grpc.health.v1.Health",
        "rpc.method": "Check",
        "rpc.grpc.status_code": 0,
    }
    assert checks[1].parent is None and checks[1].context.trace_id != caller.context.trace_id
    named = by_name(exporter)
    for rpc in ("test.Echo/Stream", "test.Echo/SyncStream", "test.Echo/Join", "test.Echo/EchoEach"):
        assert_child(named[rpc], caller)
    # The client's current context replaces a stale traceparent the caller passed in.
    assert_child(named["test.Echo/SyncCheck"], caller)
    assert named["test.Echo/SyncCheck"].attributes["rpc.grpc.status_code"] == 0
    # A handler that fails its rpc fails its span, whether it returns or aborts.
    for rpc, code, message in (("NotFound", 5, "no such model"), ("Abort", 3, "bad temperature")):
        failed = named[f"test.Echo/{rpc}"]
        assert failed.status.status_code == trace.StatusCode.ERROR
        assert failed.attributes["rpc.grpc.status_code"] == code
        assert message in failed.status.description


@run_async
async def test_sync_client_interceptor_propagates(recorded: tuple[trace.Tracer, InMemorySpanExporter]) -> None:
    tracer, exporter = recorded
    server, port = await _start_server(tracer)

    def call_from_a_sync_thread() -> health_pb2.HealthCheckResponse:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as plain:
            stub = health_pb2_grpc.HealthStub(grpc.intercept_channel(plain, TracingClientInterceptor()))
            with tracer.start_as_current_span("sync caller"):
                return stub.Check(health_pb2.HealthCheckRequest(), timeout=10)

    try:
        # A thread, because a blocking call on the loop would starve the aio server it calls.
        reply = await asyncio.to_thread(call_from_a_sync_thread)
    finally:
        await server.stop(None)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    spans = by_name(exporter)
    assert_child(spans[CHECK], spans["sync caller"])


@run_async
async def test_a_stream_abandoned_at_a_yield_closes_cleanly_from_another_context(
    recorded: tuple[trace.Tracer, InMemorySpanExporter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # grpc abandons a response stream at a yield when its client leaves mid-write; the event loop then
    # closes the generator from another context. The rpc span must end, with nothing logged.
    tracer, exporter = recorded
    current_in_handler = []

    async def handler(request: bytes, context: object) -> AsyncIterator[bytes]:
        for chunk in (b"a", b"b"):
            current_in_handler.append(trace.get_current_span().get_span_context().span_id)
            yield chunk

    class Context:
        def code(self) -> None:
            return None

    stream = _traced(handler, lambda: tracer.start_span("test.Echo/Stream"))(b"", Context())
    assert await anext(stream) == b"a"
    assert trace.get_current_span() is trace.INVALID_SPAN  # the rpc span is not left current in the caller
    with caplog.at_level("ERROR"):
        await asyncio.create_task(stream.aclose(), context=contextvars.Context())
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []
    [span] = exporter.get_finished_spans()
    assert current_in_handler == [span.context.span_id]  # current while the handler ran
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
