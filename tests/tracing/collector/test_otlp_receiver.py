"""The OTLP receiver without its Redis: no start, and exports refused as UNAVAILABLE once it is gone."""

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from redis.exceptions import ConnectionError as RedisConnectionError

from shardline.stack.redis_server import EmbeddedRedis
from tests.tracing.collector.fake_request import otlp_export
from tests.tracing.run_async import run_async
from tracing.collector.otlp_receiver import serve_receiver


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_no_redis_at_start_is_a_failed_start() -> None:
    """A receiver that could store nothing must not start and answer SERVING to health checks."""

    async def start() -> None:
        await serve_receiver(0, f"redis://127.0.0.1:{closed_port()}/0", host="127.0.0.1")

    with pytest.raises(RedisConnectionError):
        asyncio.run(start())


@run_async
async def test_export_once_redis_is_gone_is_unavailable_so_exporters_retry(tmp_path) -> None:
    redis_server = EmbeddedRedis(tmp_path / "redis").start()
    receiver = await serve_receiver(0, redis_server.url, host="127.0.0.1")
    redis_server.stop()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{receiver.port}") as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            request = trace_service_pb2.ExportTraceServiceRequest(
                resource_spans=[otlp_export("gateway-0", [(1, 1, "g", 1, "r")])]
            )
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await trace_service_pb2_grpc.TraceServiceStub(channel).Export(request, timeout=30)
    finally:
        await receiver.stop()
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "span store unavailable" in failed.value.details()


@run_async
async def test_a_malformed_export_is_invalid_argument(tmp_path) -> None:
    redis_server = EmbeddedRedis(tmp_path / "redis").start()
    receiver = await serve_receiver(0, redis_server.url, host="127.0.0.1")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{receiver.port}") as channel:
            export = channel.unary_unary(
                "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
                request_serializer=None,
                response_deserializer=None,
            )
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await export(b"\x0a\x02\xff\xfe")  # no ExportTraceServiceRequest: truncated field 1
    finally:
        await receiver.stop()
        redis_server.stop()
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failed.value.details()
