"""LoRA adapters loaded and unloaded at run time (vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter), through the scheduler to every live worker of the served model."""

from __future__ import annotations

from gateway.settings import GatewaySettings
from gateway.upstream.backends import Backends, upstream
from shardline.core.errors import InvalidArgument, NotFound
from shardline.proto import common_pb2

# A load reads and checks the adapter's files on every worker; well under a second each.
LORA_RPC_TIMEOUT_S = 90.0


class LoraUpdates:
    """Where the gateway allows it (allow_runtime_lora_updating): the folder named is read on the
    workers' machines, so only operators should reach these calls."""

    def __init__(self, settings: GatewaySettings, backends: Backends) -> None:
        self.allowed = settings.allow_runtime_lora_updating
        self.backends = backends

    async def load(self, name: str, path: str) -> list[str]:
        """Serves the adapter in folder `path` as model `name`; the adapters served after."""
        self._check(name)
        if not path:
            raise InvalidArgument("lora_path", "is required: the adapter's folder on the workers' machines")
        model = (await self.backends.tokenizer_info()).model
        request = common_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path, model=model)
        with upstream("scheduler"):
            response = await self.backends.scheduler.LoadLoraAdapter(request, timeout=LORA_RPC_TIMEOUT_S)
        return list(response.adapters)

    async def unload(self, name: str) -> list[str]:
        """Stops serving adapter `name`; the adapters served after."""
        self._check(name)
        model = (await self.backends.tokenizer_info()).model
        request = common_pb2.UnloadLoraAdapterRequest(lora_name=name, model=model)
        with upstream("scheduler"):
            response = await self.backends.scheduler.UnloadLoraAdapter(request, timeout=LORA_RPC_TIMEOUT_S)
        return list(response.adapters)

    def _check(self, name: str) -> None:
        if not self.allowed:
            raise NotFound("run-time LoRA updates are off here (set SHARDLINE_ALLOW_RUNTIME_LORA_UPDATING=1)")
        if not name:
            raise InvalidArgument("lora_name", "is required")
