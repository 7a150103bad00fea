"""A gateway wired to the real tokenizer service and a scripted scheduler, inside one event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.server import GatewayServer, start_gateway
from gateway.settings import GatewaySettings
from shardline.core.grpc_server import GrpcService, RunningServer, start_grpc_server
from shardline.proto import generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.gateway.scripted_scheduler import Script, ScriptedScheduler

SCHEDULER_SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


@dataclass
class Stack:
    scheduler: ScriptedScheduler
    scheduler_server: RunningServer
    gateway: GatewayServer
    spans: InMemorySpanExporter
    channel: grpc.aio.Channel  # to the gateway's gRPC port

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.http_port}"

    @property
    def generation(self) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(self.channel)


async def start_gateway_for(
    scheduler_port: int, tokenizer_address: str, **settings: Any
) -> tuple[GatewayServer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config = GatewaySettings(
        host="127.0.0.1",
        http_port=0,
        grpc_port=0,
        tokenizer_address=tokenizer_address,
        scheduler_address=f"127.0.0.1:{scheduler_port}",
        tracing=False,
        **settings,
    )
    return await start_gateway(config, provider.get_tracer("test")), exporter


@asynccontextmanager
async def running_stack(tokenizer_address: str, script: Script, **settings: Any) -> AsyncIterator[Stack]:
    scheduler = ScriptedScheduler(script)
    service = GrpcService(scheduler, scheduler_pb2_grpc.add_SchedulerServicer_to_server, SCHEDULER_SERVICE)
    server = await start_grpc_server([service], 0, host="127.0.0.1")
    scheduler.start()
    gateway, exporter = await start_gateway_for(server.port, tokenizer_address, **settings)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc.port}")
    try:
        yield Stack(scheduler, server, gateway, exporter, channel)
    finally:
        await channel.close()
        await gateway.stop(0)
        await scheduler.stop()
        await server.stop(0)


def run_on_stack(
    tokenizer_address: str, script: Script, body: Callable[[Stack], Coroutine[Any, Any, None]], **settings: Any
) -> None:
    """Run `body` against a fresh stack in a fresh event loop (no async pytest plugin needed)."""

    async def run() -> None:
        async with running_stack(tokenizer_address, script, **settings) as stack:
            await body(stack)

    asyncio.run(run())
