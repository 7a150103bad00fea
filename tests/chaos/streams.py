"""Concurrent greedy streams through the SDK that resume on every resumable error, and how they ended."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from shardline.client import AsyncShardlineClient

MAX_TOKENS = 32
PARAMS = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@dataclass(slots=True)
class StreamResult:
    """What one client saw of one request, over every resume."""

    request_id: str
    tokens: list[int] = field(default_factory=list)  # by offset, as received
    finish_reason: str | None = None
    resumes: int = 0  # resumable errors it came back from
    errors: list[str] = field(default_factory=list)  # every error, resumed or final
    gaps: int = 0  # chunks that did not start where the last one ended


def prompts(n: int) -> list[str]:
    return [f"Story {i}: the lighthouse keeper opened the door and" for i in range(n)]


async def run_streams(
    target: str,
    request_ids: list[str],
    texts: list[str],
    *,
    resume_for_s: float = 90.0,
    started: asyncio.Event | None = None,
    started_after_tokens: int = 0,
    max_tokens: int = MAX_TOKENS,
) -> list[StreamResult]:
    """Streams every prompt at once; a stream that fails UNAVAILABLE (a gateway gone, a Redis
    outage past the scheduler's bound) is resumed at its offset until `resume_for_s` has passed.
    `started` is set once every stream has `started_after_tokens` tokens."""
    results = [StreamResult(request_id) for request_id in request_ids]

    def check_started() -> None:
        if started is not None and all(len(r.tokens) >= started_after_tokens for r in results):
            started.set()

    async with AsyncShardlineClient(target, timeout=180, retries=6, backoff_s=0.25) as client:
        await asyncio.gather(
            *(
                _one(client, result, text, resume_for_s, check_started, max_tokens)
                for result, text in zip(results, texts)
            )
        )
    return results


async def _one(
    client: AsyncShardlineClient, result: StreamResult, text: str, resume_for_s: float, on_chunk, max_tokens: int
) -> None:
    deadline = time.monotonic() + resume_for_s
    stream = client.stream(text, request_id=result.request_id, **(PARAMS | {"max_tokens": max_tokens}))
    while True:
        try:
            async for chunk in stream:
                if chunk.token_ids and chunk.offset != len(result.tokens):
                    result.gaps += 1
                result.tokens[chunk.offset :] = chunk.token_ids
                on_chunk()
                if chunk.finish_reason is not None:
                    result.finish_reason = chunk.finish_reason
                    return
            result.errors.append("the stream ended without a finish")
            return
        except grpc.aio.AioRpcError as exc:
            result.errors.append(f"{exc.code().name}: {exc.details()}")
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                return
        await asyncio.sleep(0.5)
        result.resumes += 1
        stream = client.resume(result.request_id, len(result.tokens))


def summary(results: list[StreamResult], reference: dict[int, list[int]]) -> str:
    """'n of N identical', and how many of those came back through a resume."""
    identical = [r for i, r in enumerate(results) if r.tokens == reference[i] and r.finish_reason == "length"]
    resumed = sum(1 for r in identical if r.resumes)
    return f"{len(identical)} of {len(results)} identical ({resumed} after a resume)"
