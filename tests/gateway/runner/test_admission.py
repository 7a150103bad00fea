"""Admission before work: overload is a 429 / RESOURCE_EXHAUSTED before any tokenizing, never a
CANCELLED; the gateway's tokenizer calls stay bounded; a prompt too big for the context is refused
by its size, without a Tokenize call."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import aiohttp
import grpc

from shardline.proto import common_pb2, generation_pb2
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.scripted_scheduler import MODEL, Script

BURST = 300
BIG = "The quick brown fox jumps over the lazy dog. " * 70_000  # 3.1 MB


def _tokenized(stack: Stack) -> int:
    return [span.name for span in stack.spans.get_finished_spans()].count("tokenize")


async def _http_burst(stack: Stack, count: int) -> list[tuple[int, float, dict]]:
    """(status, seconds, JSON body) of `count` completions sent at once."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def one() -> tuple[int, float, dict]:
            start = time.perf_counter()
            body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 2}
            async with http.post(f"{stack.base_url}/v1/completions", json=body) as response:
                return (
                    response.status,
                    time.perf_counter() - start,
                    {**await response.json(), "retry_after": response.headers.get("Retry-After")},
                )

        return await asyncio.gather(*(one() for _ in range(count)))


def test_a_burst_past_the_admission_bound_is_refused_before_tokenizing(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        results = await _http_burst(stack, BURST)
        statuses = [status for status, _, _ in results]
        assert set(statuses) == {200, 429}, set(statuses)
        ok = statuses.count(200)
        # Every refusal came before any work: only the admitted requests were tokenized.
        assert _tokenized(stack) == ok == len(stack.scheduler.submitted)
        refused = [reply for status, _, reply in results if status == 429]
        assert all(r["error"]["type"] == "rate_limit_error" and r["retry_after"] == "1" for r in refused)
        assert "admitting" in refused[0]["error"]["message"]
        assert 0 < stack.gateway.backends.tokenizer.peak <= 4

        # Over gRPC: OK or RESOURCE_EXHAUSTED, never a bare CANCELLED.
        async def one() -> grpc.StatusCode:
            try:
                await stack.generation.Generate(generation_pb2.GenerateRequest(prompt="Hello there"))
                return grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                return exc.code()

        codes = await asyncio.gather(*(one() for _ in range(BURST)))
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, set(codes)
        assert stack.gateway.backends.tokenizer.peak <= 4

    run_on_stack(tokenizer_address, Script(text_ids[:2]), body, max_admitting=64, max_tokenizer_calls=4)


def test_grpc_never_sheds_a_burst_as_cancelled(tokenizer_address, text_ids) -> None:
    # Past 1,000 calls not yet picked up, grpc's own default sheds some at random as a bare CANCELLED
    # (224 of 2,000 here); each of these must get the gateway's own answer.
    async def body(stack: Stack) -> None:
        async def one() -> grpc.StatusCode:
            try:
                await stack.generation.GetRequest(common_pb2.GetRequestRequest(request_id="bad id!"), timeout=60)
                return grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                return exc.code()

        codes = await asyncio.gather(*(one() for _ in range(2000)))
        assert set(codes) == {grpc.StatusCode.INVALID_ARGUMENT}, Counter(codes)

    run_on_stack(tokenizer_address, Script(text_ids[:2]), body, max_admitting=64, max_tokenizer_calls=4)


def test_a_full_queue_refuses_new_arrivals_untokenized(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        stack.scheduler.accept_only = 20
        results = await _http_burst(stack, BURST)
        statuses = [status for status, _, _ in results]
        assert set(statuses) == {200, 429} and statuses.count(200) == 20
        # Those admitted when the queue filled were tokenized; the rest never were.
        assert _tokenized(stack) <= 20 + 64
        queue_full = [
            seconds
            for status, seconds, reply in results
            if status == 429 and "queue is full" in reply["error"]["message"]
        ]
        assert queue_full

    run_on_stack(tokenizer_address, Script(text_ids[:2]), body, max_admitting=64, queue_full_hold_s=5.0)


def test_a_prompt_too_big_for_the_context_is_refused_by_its_size(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            requests = [
                ("/v1/completions", {"model": MODEL, "prompt": BIG}, "prompt"),
                ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": BIG}]}, "messages"),
                ("/tokenize", {"model": MODEL, "prompt": BIG}, "prompt"),
                ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": BIG}]}, "messages"),
            ]
            for path, request, param in requests:
                async with http.post(f"{stack.base_url}{path}", json=request) as response:
                    error = (await response.json())["error"]
                    assert response.status == 400, error
                    assert (error["param"], error["code"]) == (param, "context_length_exceeded")
                    assert "at least" in error["message"]
        try:
            await stack.generation.Generate(generation_pb2.GenerateRequest(prompt=BIG))
            raise AssertionError("a 3 MB prompt was accepted")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.details().startswith("prompt: ")
        # None of them reached the tokenizer's Tokenize or chat template.
        assert stack.gateway.backends.tokenizer.peak == 0
        assert stack.scheduler.submitted == []

    run_on_stack(tokenizer_address, Script(text_ids[:2]), body)
