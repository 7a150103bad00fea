"""The gateway's own gRPC health, kept equal to what its /health says of its dependencies."""

from __future__ import annotations

import asyncio
import logging

from gateway.output.stream_hub import StreamHub
from gateway.upstream.backends import Backends
from shardline.core.grpc_server import RunningServer

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0


class HealthMirror:
    """SERVING while the tokenizer and the scheduler answer SERVING and the output subscription is
    open; NOT_SERVING otherwise (the scheduler says NOT_SERVING while Redis is down). A gRPC load
    balancer or probe then sees what an HTTP one sees at /health."""

    def __init__(self, backends: Backends, hub: StreamHub, server: RunningServer, names: list[str]) -> None:
        self._backends = backends
        self._hub = hub
        self._server = server
        self._names = names
        self._serving = True  # as start_grpc_server left it
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="health-mirror")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            dependencies = await self._backends.health()
            serving = all(dependencies.values()) and self._hub.connected
            if serving != self._serving:
                logger.warning(
                    "gRPC health: %s (%s, subscribed: %s)",
                    "SERVING" if serving else "NOT_SERVING",
                    ", ".join(f"{name}: {ok}" for name, ok in dependencies.items()),
                    self._hub.connected,
                )
                self._serving = serving
                await self._server.set_serving(serving, self._names)
            await asyncio.sleep(CHECK_INTERVAL_S)
