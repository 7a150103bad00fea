"""Wiring: the store, the dispatcher, the gRPC server and the metrics endpoint of one scheduler."""

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

from opentelemetry import trace

from scheduler_svc.autoscale.driver import ScaleDriver
from scheduler_svc.dispatcher import Dispatcher
from scheduler_svc.relay import Relay
from scheduler_svc.service import SchedulerService
from scheduler_svc.settings import SchedulerSettings
from shardline.core.grpc_server import GrpcService, RunningServer, start_grpc_server
from shardline.core.service_main import redacted, started
from shardline.core.store.request_store import RequestStore
from shardline.proto import scheduler_pb2, scheduler_pb2_grpc
from tracing.grpc_context import TracingServerInterceptor
from tracing.metrics import start_metrics_server
from tracing.otel_setup import setup_tracing

if TYPE_CHECKING:
    from scheduler_svc.pool_scaler import PoolScaler

log = logging.getLogger(__name__)

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


@dataclass(slots=True)
class SchedulerServer:
    """A running scheduler."""

    grpc: RunningServer  # the gRPC server (Scheduler, health, reflection)
    dispatcher: Dispatcher  # queue, workers and the dispatch loop
    relay: Relay  # the gateways' Subscribe streams
    store: RequestStore  # request state in Redis
    metrics: WSGIServer | None  # the /metrics endpoint, when enabled
    scaler: "PoolScaler | None" = None  # the autoscaler, unless its policy is static
    scaling: asyncio.Task | None = None  # its loop

    @property
    def port(self) -> int:
        return self.grpc.port

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stops serving; unfinished requests stay in Redis, and the next start re-queues them."""
        # Subscribe streams never end by themselves: close them so the grace period is not spent waiting.
        self.relay.close_all()
        if self.scaling is not None:
            self.scaling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.scaling
        await self.grpc.server.stop(grace_s)
        await self.dispatcher.stop()
        await self.store.close()
        if self.metrics is not None:
            self.metrics.shutdown()
            self.metrics.server_close()
            self.metrics = None


async def start_scheduler(settings: SchedulerSettings, tracer: trace.Tracer | None = None) -> SchedulerServer:
    """Starts a scheduler: recovers unfinished requests from Redis, then serves on settings.port."""
    # A no-op tracer still passes the callers' trace context on to the workers.
    tracer = tracer or trace.NoOpTracer()
    store = RequestStore(settings.redis_url, retention_s=settings.request_retention_s)
    relay = Relay(settings.subscriber_queue_size)
    dispatcher = Dispatcher(settings, store, relay, tracer)
    await dispatcher.start()
    scaler = None
    if settings.autoscale_policy != "static":
        # Imported only when on: the forecasters pull in statsmodels, a second of start-up.
        from scheduler_svc.pool_scaler import PoolScaler

        scaler = PoolScaler(settings, dispatcher, driver_for(settings), tracer)
    servicer = SchedulerService(settings, dispatcher, store, relay, scaler)
    running = await start_grpc_server(
        [GrpcService(servicer, scheduler_pb2_grpc.add_SchedulerServicer_to_server, SERVICE_NAME)],
        settings.port,
        settings.host,
        interceptors=[TracingServerInterceptor(tracer)],
    )
    # Not serving while Redis does not answer: a load balancer or the gateway's /health then looks
    # elsewhere, and every call that needs Redis answers UNAVAILABLE meanwhile.
    dispatcher.on_store_health = lambda up: running.set_serving(up, ["", SERVICE_NAME])
    metrics = start_metrics_server(settings.metrics_port) if settings.metrics_port > 0 else None
    log.info(
        "scheduler serving on port %d (redis %s, queue capacity %d)",
        running.port,
        redacted(settings.redis_url),
        settings.queue_capacity,
    )
    scaling = None if scaler is None else asyncio.create_task(scaler.run(), name="autoscale")
    return SchedulerServer(running, dispatcher, relay, store, metrics, scaler, scaling)


def driver_for(settings: SchedulerSettings) -> ScaleDriver | None:
    """The driver that carries the autoscaler's count out; None publishes it only."""
    if settings.autoscale_driver == "kubernetes":
        # Imported only when asked for: the client is large, and only a scheduler in a cluster needs it.
        from scheduler_svc.autoscale.kubernetes_driver import KubernetesDriver, KubernetesDriverConfig

        return KubernetesDriver(
            KubernetesDriverConfig(
                namespace=settings.autoscale_k8s_namespace, default_deployment=settings.autoscale_k8s_deployment
            )
        )
    return None


async def serve(settings: SchedulerSettings) -> None:
    """Runs a scheduler until SIGTERM or SIGINT."""
    tracing = setup_tracing("scheduler", settings.instance_id, enabled=settings.tracing)
    server = await start_scheduler(settings, tracing.tracer)
    started()
    try:
        await server.grpc.wait_for_signal(on_stop=server.stop)
    finally:
        tracing.shutdown()
