"""asyncio client for Shardline's gRPC `Generation` API; the same calls as ShardlineClient, awaited."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from shardline.client.call_policy import RETRYABLE, CallPolicy
from shardline.client.channel_options import CHANNEL_OPTIONS
from shardline.client.types import (
    Chunk,
    Completion,
    ModelInfo,
    RequestDetails,
    build_request,
    build_tools,
    resume_request,
    tools_of,
    was_taken,
)
from shardline.proto import common_pb2, generation_pb2, generation_pb2_grpc

T = TypeVar("T")


class AsyncShardlineClient:
    """asyncio twin of ShardlineClient.

    >>> async with AsyncShardlineClient("localhost:50051") as client:
    ...     async for chunk in client.stream("Once upon a time", max_tokens=32):
    ...         print(chunk.text, end="")
    """

    def __init__(
        self,
        target: str = "localhost:50051",
        *,
        api_key: str | None = None,
        timeout: float | None = None,
        retries: int = 4,
        backoff_s: float = 0.2,
    ) -> None:
        self._target = target
        # Opened on first use, in the event loop that uses it: a grpc.aio channel belongs to the loop
        # it was made in, so a client built at import time (outside any loop) must not make it yet.
        self._channel: grpc.aio.Channel | None = None
        self._stub_: generation_pb2_grpc.GenerationStub | None = None
        self._policy = CallPolicy.of(api_key, timeout, retries, backoff_s)

    @property
    def _stub(self) -> generation_pb2_grpc.GenerationStub:
        if self._stub_ is None:
            self._channel = grpc.aio.insecure_channel(self._target, options=CHANNEL_OPTIONS)
            self._stub_ = generation_pb2_grpc.GenerationStub(self._channel)
        return self._stub_

    async def _call(
        self,
        fn: Callable[..., Awaitable[T]],
        request: Any,
        timeout: float | None,
        taken: Callable[[], Awaitable[T]] | None = None,
    ) -> T:
        """As CallPolicy.call, awaited."""
        policy = self._policy
        for attempt in range(policy.retries + 1):
            try:
                return await policy.once(fn, request, timeout)
            except grpc.aio.AioRpcError as exc:
                if attempt and taken is not None and was_taken(exc):
                    return await taken()
                if exc.code() not in RETRYABLE or attempt == policy.retries:
                    raise
                await asyncio.sleep(policy.delay_s(attempt))
        raise AssertionError("unreachable")

    async def generate(
        self,
        prompt: str | list[int] | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        timeout: float | None = None,
        **params: Any,
    ) -> Completion:
        """Generate a whole completion (see ShardlineClient.generate for the parameters)."""
        req = build_request(prompt, messages=messages, timeout=timeout, **params)

        async def generate_once(r: generation_pb2.GenerateRequest, **kw: Any) -> Completion:
            return Completion.from_proto(await self._stub.Generate(r, **kw))

        async def follow_started() -> Completion:
            resume = resume_request(req.request_id, 0, tools_of(req))
            return Completion.from_chunks([c async for c in self._stream(self._stub.Resume, resume, timeout)])

        return await self._call(generate_once, req, timeout, taken=follow_started)

    def stream(
        self,
        prompt: str | list[int] | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        timeout: float | None = None,
        **params: Any,
    ) -> AsyncIterator[Chunk]:
        """Generate, yielding chunks as tokens arrive; the last carries finish_reason and usage."""
        req = build_request(prompt, messages=messages, timeout=timeout, **params)
        return self._stream(self._stub.GenerateStream, req, timeout, starts=True)

    def resume(
        self,
        request_id: str,
        offset: int = 0,
        *,
        timeout: float | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
    ) -> AsyncIterator[Chunk]:
        """Continue a request's stream from token `offset`; see `ShardlineClient.resume`."""
        return self._stream(
            self._stub.Resume,
            resume_request(request_id, offset, build_tools(tools, tool_choice, parallel_tool_calls)),
            timeout,
        )

    async def _stream(
        self, fn: Callable[..., Any], req: Any, timeout: float | None, starts: bool = False
    ) -> AsyncIterator[Chunk]:
        """`fn`'s chunks, retried until the first; `starts`: it starts the generation `req` names."""
        policy = self._policy
        for attempt in range(policy.retries + 1):
            started = False
            call = policy.once(fn, req, timeout)
            try:
                async for msg in call:
                    started = True
                    yield Chunk.from_proto(msg)
                return
            except grpc.aio.AioRpcError as exc:
                if attempt and not started and starts and was_taken(exc):
                    async for chunk in self._stream(
                        self._stub.Resume, resume_request(req.request_id, 0, tools_of(req)), timeout
                    ):
                        yield chunk
                    return
                if started or exc.code() not in RETRYABLE or attempt == policy.retries:
                    raise
                await asyncio.sleep(policy.delay_s(attempt))
            finally:
                # A caller that stops early must end the rpc (the server then cancels the request after
                # its resume grace): the call and its reader reference each other, so it would never be
                # collected, and the request would run to the end, unresumable meanwhile.
                call.cancel()

    async def cancel(self, request_id: str) -> None:
        """Stop a request; its worker frees the request's KV blocks."""
        await self._call(self._stub.Cancel, common_pb2.CancelRequest(request_id=request_id), None)

    async def get_request(self, request_id: str) -> RequestDetails:
        """A request's status, worker, attempts, timings, usage and generated token ids."""
        return RequestDetails.from_proto(
            await self._call(self._stub.GetRequest, common_pb2.GetRequestRequest(request_id=request_id), None)
        )

    async def list_models(self) -> list[str]:
        """Names of the models this gateway serves."""
        return [m.name for m in await self.models()]

    async def models(self) -> list[ModelInfo]:
        """The models this gateway serves (those with a live worker), with their limits."""
        resp = await self._call(self._stub.ListModels, generation_pb2.ListModelsRequest(), None)
        return [ModelInfo.from_proto(m) for m in resp.models]

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub_ = None

    async def __aenter__(self) -> AsyncShardlineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
