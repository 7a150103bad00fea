"""Wiring of the gateway: dependencies, stream hub, gRPC Generation and Batches services and OpenAI HTTP API."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from aiohttp import web
from opentelemetry import trace

from gateway.batches.batch_front import BatchFront
from gateway.grpc_api.batches_grpc import SERVICE_NAME as BATCHES_SERVICE_NAME
from gateway.grpc_api.batches_grpc import BatchesServicer
from gateway.grpc_api.generation_service import GenerationService
from gateway.grpc_api.health_mirror import HealthMirror
from gateway.http_api.errors import ServerLog
from gateway.http_api.openai_http import OpenAIHttpApi
from gateway.output.stream_hub import StreamHub
from gateway.runner.request_runner import RequestRunner
from gateway.settings import GatewaySettings
from gateway.tenancy.auth import ApiKeys, GrpcAuthInterceptor
from gateway.tenancy.tenant_limiter import TenantLimiter
from gateway.tenancy.tenants import TenantDirectory
from gateway.upstream.backends import Backends
from shardline.core.grpc_server import GrpcService, RunningServer, start_grpc_server
from shardline.core.service_main import started
from shardline.proto import batches_pb2_grpc, generation_pb2, generation_pb2_grpc
from tracing.grpc_context import TracingServerInterceptor
from tracing.otel_setup import setup_tracing

logger = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
# A fresh gateway waits this long for its scheduler subscription before it takes traffic anyway.
STARTUP_SUBSCRIBE_WAIT_S = 5.0
# Connections the kernel holds for the HTTP server before it accepts them (aiohttp's default is 128):
# past it a burst's connections wait a second or more for a SYN retry, where they should get their 429 at once.
HTTP_BACKLOG = 4096


@dataclass(slots=True)
class GatewayServer:
    """A running gateway; `stop()` ends it."""

    settings: GatewaySettings  # what it was started with (ports as requested)
    backends: Backends  # its links to the tokenizer and scheduler
    hub: StreamHub  # its Subscribe stream
    grpc: RunningServer  # the Generation and Batches gRPC server; grpc.port is the bound port
    http: web.AppRunner  # the OpenAI HTTP server
    http_port: int  # the bound HTTP port
    health: HealthMirror  # keeps the gRPC health equal to the dependencies' state
    limiter: TenantLimiter | None = None  # the tenants' limits, when some may have them
    tenants: TenantDirectory | None = None  # the tenants file or Redis key, when there is one

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.health.stop()
        await self.grpc.set_serving(False)
        await self.http.cleanup()
        await self.grpc.stop(grace_s)
        await self.hub.stop()
        if self.limiter is not None:
            await self.limiter.close()
        if self.tenants is not None:
            await asyncio.to_thread(self.tenants.close)
        await self.backends.close()


async def start_gateway(settings: GatewaySettings, tracer: trace.Tracer | None = None) -> GatewayServer:
    """Start both front ends; ports 0 pick free ones."""
    tracer = tracer or trace.get_tracer("shardline.gateway")
    async with contextlib.AsyncExitStack() as undo:  # a failed start (a port taken) stops what it started
        backends = Backends(settings.tokenizer_address, settings.scheduler_address, settings.max_tokenizer_calls)
        undo.push_async_callback(backends.close)
        hub = StreamHub(settings.gateway_id, backends, settings.local_detokenize)
        hub.start()
        undo.push_async_callback(hub.stop)
        if not await hub.wait_connected(STARTUP_SUBSCRIBE_WAIT_S):
            logger.warning(
                "scheduler at %s not reachable yet; requests get 503 until it is", settings.scheduler_address
            )
        runner = RequestRunner(settings, backends, hub, tracer)
        if runner.tenants is not None:
            undo.callback(runner.tenants.close)
        if runner.limiter is not None:
            undo.push_async_callback(runner.limiter.close)
        keys = ApiKeys(settings.api_keys, runner.tenants)  # the tenants file's keys are accepted too
        batch_api = BatchFront(settings, keys)  # its service is gRPC Batches' too
        services = [
            GrpcService(
                GenerationService(runner, keys), generation_pb2_grpc.add_GenerationServicer_to_server, SERVICE_NAME
            ),
            GrpcService(
                BatchesServicer(batch_api.service, keys),
                batches_pb2_grpc.add_BatchesServicer_to_server,
                BATCHES_SERVICE_NAME,
            ),
        ]
        grpc_server = await start_grpc_server(
            services,
            settings.grpc_port,
            host=settings.host,
            interceptors=[
                TracingServerInterceptor(tracer),
                GrpcAuthInterceptor(keys, SERVICE_NAME),
                GrpcAuthInterceptor(keys, BATCHES_SERVICE_NAME),
            ],
        )
        undo.push_async_callback(grpc_server.stop, 0)
        health = HealthMirror(backends, hub, grpc_server, ["", SERVICE_NAME])
        health.start()
        undo.push_async_callback(health.stop)
        app = OpenAIHttpApi(runner, keys, batch_api.status_counts).application()
        batch_api.add_routes(app)
        # handler_cancellation: a client that disconnects cancels its handler, which cancels the request upstream.
        http = web.AppRunner(app, handler_cancellation=True, access_log=None, logger=ServerLog())
        await http.setup()
        undo.push_async_callback(http.cleanup)
        await web.TCPSite(http, settings.host, settings.http_port, backlog=HTTP_BACKLOG).start()
        http_port = http.addresses[0][1]
        undo.pop_all()
    logger.info("gateway %s: HTTP on %d, gRPC on %d", settings.gateway_id, http_port, grpc_server.port)
    return GatewayServer(settings, backends, hub, grpc_server, http, http_port, health, runner.limiter, runner.tenants)


async def serve(settings: GatewaySettings) -> None:
    """Run until SIGTERM/SIGINT."""
    tracing = setup_tracing("gateway", settings.gateway_id, enabled=settings.tracing)
    try:
        gateway = await start_gateway(settings, tracing.tracer)
        started()
        try:
            await gateway.grpc.wait_for_signal(on_stop=gateway.http.cleanup)
        finally:
            await gateway.health.stop()
            await gateway.hub.stop()
            if gateway.limiter is not None:
                await gateway.limiter.close()
            if gateway.tenants is not None:
                await asyncio.to_thread(gateway.tenants.close)
            await gateway.backends.close()
    finally:
        await asyncio.to_thread(tracing.shutdown)
