"""setup_tracing exporting over real OTLP/gRPC to the real receiver, into a real Redis."""

import asyncio
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry import trace
from prometheus_client import REGISTRY

from tests.tracing.run_async import run_async
from tracing import attributes as attr
from tracing.collector.otlp_receiver import serve_receiver
from tracing.grpc_context import TracingServerInterceptor, aio_client_interceptors
from tracing.otel_setup import setup_tracing
from tracing.settings import TracingSettings

FAST = TracingSettings(otlp_schedule_delay_ms=50)


def everything_since(start_ns: int) -> tuple[int, int]:
    return start_ns, time.time_ns() + 10**9


@run_async
async def test_two_services_reach_redis_as_one_trace(redis_url: str) -> None:
    receiver = await serve_receiver(0, redis_url, host="127.0.0.1", settings=FAST)
    endpoint = f"127.0.0.1:{receiver.port}"
    gateway = setup_tracing("gateway", "gateway-0", endpoint=endpoint, settings=FAST, install_global=False)
    worker = setup_tracing("gpu_worker", "worker-0", rank=1, endpoint=endpoint, settings=FAST, install_global=False)
    server = grpc.aio.server(interceptors=[TracingServerInterceptor(worker.tracer)])
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    started = time.time_ns()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=aio_client_interceptors()) as channel:
            attributes = {attr.REQUEST_ID: "req-7", attr.GEN_AI_REQUEST_MODEL: "smollm2-135m"}
            with gateway.tracer.start_as_current_span("generate", attributes=attributes):
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        with worker.tracer.start_as_current_span("decode_step", attributes={attr.BATCH_SIZE: 3}):
            pass
        # Both block until the receiver, on this loop, has answered: run them off it.
        assert await asyncio.to_thread(gateway.force_flush, 10)
        await asyncio.to_thread(worker.shutdown)
        spans = {span.name: span for span in await receiver.store.by_request("req-7")}
        window = await receiver.store.in_window(*everything_since(started))
        recent = await receiver.store.recent_requests(10)
    finally:
        await server.stop(None)
        await receiver.stop()
        await asyncio.to_thread(gateway.shutdown)

    generate, check = spans["generate"], spans["grpc.health.v1.Health/Check"]
    assert generate.resource[attr.SERVICE_NAME] == "gateway"
    assert generate.instance_id == "gateway-0" and generate.rank is None
    assert generate.attributes == {attr.REQUEST_ID: "req-7", attr.GEN_AI_REQUEST_MODEL: "smollm2-135m"}
    assert (check.service_name, check.instance_id, check.rank) == ("gpu_worker", "worker-0", 1)
    assert check.trace_id == generate.trace_id and check.parent_span_id == generate.span_id
    assert generate.start_ns <= check.start_ns <= check.end_ns <= generate.end_ns
    assert recent == ["req-7"]
    assert sorted(span.name for span in window) == ["decode_step", "generate", "grpc.health.v1.Health/Check"]
    step = next(span for span in window if span.name == "decode_step")
    assert step.attributes[attr.BATCH_SIZE] == 3 and step.trace_id != generate.trace_id


def _dropped_metric() -> float:
    return REGISTRY.get_sample_value("shardline_tracing_spans_dropped_total") or 0.0


@run_async
async def test_a_flooded_tiny_queue_counts_every_dropped_span(redis_url: str) -> None:
    receiver = await serve_receiver(0, redis_url, host="127.0.0.1")
    tiny = TracingSettings(otlp_max_queue_size=8, otlp_max_export_batch_size=8, otlp_schedule_delay_ms=50)
    handle = setup_tracing(
        "gateway", "gateway-1", endpoint=f"127.0.0.1:{receiver.port}", settings=tiny, install_global=False
    )
    metric_before = _dropped_metric()
    started = time.time_ns()
    flood = 2000

    def emit_flood() -> None:
        for index in range(flood):
            with handle.tracer.start_as_current_span("tick", attributes={attr.STEP: index}):
                pass

    try:
        await asyncio.to_thread(emit_flood)
        await asyncio.to_thread(handle.shutdown)
        stored = await receiver.store.in_window(*everything_since(started))
    finally:
        await receiver.stop()
    # Every span is either stored or counted as dropped: none vanish silently.
    assert handle.dropped_spans > 0
    assert len(stored) + handle.dropped_spans == flood
    assert _dropped_metric() - metric_before == handle.dropped_spans


def test_disabled_tracing_records_nothing_and_changes_no_global() -> None:
    provider_before = trace.get_tracer_provider()
    handle = setup_tracing("gateway", "gateway-0", enabled=False)
    with handle.tracer.start_as_current_span("generate", attributes={attr.REQUEST_ID: "r"}) as span:
        assert not span.is_recording()
        assert not span.get_span_context().is_valid
    assert not handle.enabled and handle.dropped_spans == 0
    assert handle.force_flush()
    handle.shutdown()
    assert trace.get_tracer_provider() is provider_before
