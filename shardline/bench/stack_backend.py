"""The stack as a benchmark target: each request streamed through the gateway's gRPC API, as a client would."""

from __future__ import annotations

import time

import grpc

from shardline.bench.metrics import RequestTiming
from shardline.client import AsyncShardlineClient

# gRPC's refusals, as the HTTP statuses the gateway's OpenAI API gives the same ones (shardline/core/errors.py).
_STATUS_OF_CODE = {grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503}


class StackBackend:
    """Streams each request through the gateway's gRPC API, as a client would."""

    def __init__(self, target: str, api_key: str | None = None, priority: int = 0) -> None:
        self.client = AsyncShardlineClient(target, api_key=api_key, retries=0)
        self.priority = priority  # the class its requests ask for (a tenant's, in a multi-tenant load)

    async def send(self, prompt: list[int], output_len: int, timing: RequestTiming) -> None:
        start = time.perf_counter()
        stream = self.client.stream(
            prompt, max_tokens=output_len, ignore_eos=True, temperature=0.0, priority=self.priority
        )
        try:
            async for chunk in stream:
                if chunk.token_ids:
                    timing.chunk_times.append(time.perf_counter() - start)
                    timing.output_len += len(chunk.token_ids)
                if chunk.finish_reason == "error":
                    raise RuntimeError(f"request {chunk.request_id} failed")
                if chunk.usage is not None:
                    timing.cached_tokens = chunk.usage.cached_tokens
        except grpc.aio.AioRpcError as exc:
            timing.status = _STATUS_OF_CODE.get(exc.code(), 0)
            raise

    async def vocab_size(self) -> int | None:
        """The served model's vocabulary size: random prompts must be ids it has."""
        models = await self.client.models()
        if not models:
            raise RuntimeError("the stack serves no model (no live worker)")
        return min(model.vocab_size for model in models)

    async def close(self) -> None:
        await self.client.close()
