"""The OTLP receiver's answers when its Redis is gone."""

import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.tracing.fake_request import otlp_export
from tests.tracing.run_async import run_async
from tracing.otlp_receiver import serve_receiver


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@run_async
async def test_export_without_redis_is_unavailable_so_exporters_retry() -> None:
    receiver = await serve_receiver(0, f"redis://127.0.0.1:{closed_port()}/0", host="127.0.0.1")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{receiver.port}") as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            request = trace_service_pb2.ExportTraceServiceRequest(resource_spans=[otlp_export("gateway-0", [(1, 1, "g", 1, "r")])])
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await trace_service_pb2_grpc.TraceServiceStub(channel).Export(request, timeout=30)
    finally:
        await receiver.stop()
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "span store unavailable" in failed.value.details()
