"""The OTLP/gRPC trace receiver: services export spans here, it stores them in Redis."""

import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from redis.exceptions import RedisError

from shardline.core.grpc_server import ErrorMappingInterceptor
from shardline.core.service_main import redacted
from tracing.collector.series_store import Resolution
from tracing.collector.span_store import SpanStore
from tracing.settings import TracingSettings

logger = logging.getLogger(__name__)


def series_resolutions(settings: TracingSettings) -> tuple[Resolution, ...]:
    """The time series' resolutions and how long each is kept, from the settings."""
    return (
        Resolution(1, settings.series_1s_retention_s),
        Resolution(10, settings.series_10s_retention_s),
        Resolution(60, settings.series_60s_retention_s),
    )


class OtlpTraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Implements OTLP ``TraceService.Export`` on top of a SpanStore."""

    def __init__(self, store: SpanStore) -> None:
        self._store = store

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.aio.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        try:
            await self._store.add(request.resource_spans)
        except RedisError as exc:
            logger.warning("span store unavailable: %s", exc)
            # OTLP exporters retry UNAVAILABLE with backoff, so spans survive a Redis blip.
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"span store unavailable: {exc}")
        return trace_service_pb2.ExportTraceServiceResponse()


@dataclass(slots=True)
class RunningReceiver:
    """A started receiver: its server, the port it listens on, and its store."""

    server: grpc.aio.Server
    # The bound port; differs from the requested one when that was 0.
    port: int
    store: SpanStore

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Stops accepting exports, lets running ones finish, closes Redis."""
        await self.server.stop(grace_s)
        await self.store.close()


async def serve_receiver(
    port: int, redis_url: str, *, host: str = "[::]", settings: TracingSettings | None = None
) -> RunningReceiver:
    """Starts the OTLP receiver on ``host:port`` (0 picks a free port), storing into ``redis_url``.

    The server also answers the standard gRPC health check. Await
    ``running.server.wait_for_termination()`` to serve until stopped.
    """
    settings = settings or TracingSettings()
    store = SpanStore.from_url(
        redis_url,
        max_spans=settings.trace_max_spans,
        max_age_s=settings.trace_max_age_s,
        series=series_resolutions(settings),
    )
    try:  # a receiver that could store nothing must not answer SERVING
        await store.ping()
    except BaseException:
        await store.close()
        raise
    # The same error mapping as every service's server: a malformed export is INVALID_ARGUMENT.
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor()])
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(OtlpTraceReceiver(store), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    logger.info("OTLP receiver on port %d, storing into %s", bound, redacted(redis_url))
    return RunningReceiver(server=server, port=bound, store=store)
