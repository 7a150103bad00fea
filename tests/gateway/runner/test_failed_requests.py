"""Requests that fail once accepted, streamed or not: a worker's error, a constraint with no way on, a deadline."""

from __future__ import annotations

import json

import aiohttp
import grpc
import pytest

from shardline.proto import generation_pb2, sampling_pb2
from shardline.structured_output import DEAD_END
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.scripted_scheduler import MODEL, Script

COMPLETION = {"model": MODEL, "prompt": "Hello"}


def test_a_streamed_failure_names_the_field_at_fault(tokenizer_address, text_ids) -> None:
    """A constraint that left the worker no token is the client's error, streamed or not: the
    same param and code either way."""

    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{stack.base_url}/v1/completions", json=COMPLETION) as response:
                whole = (await response.json())["error"]
                assert response.status == 400
            async with http.post(f"{stack.base_url}/v1/completions", json={**COMPLETION, "stream": True}) as response:
                lines = [line async for line in response.content if line.startswith(b"data: ")]
        streamed = json.loads(lines[-2].removeprefix(b"data: "))["error"]
        assert lines[-1] == b"data: [DONE]\n"
        assert streamed == whole and whole["param"] == "structured_output", whole

    run_on_stack(
        tokenizer_address,
        Script(text_ids[:3], finish_reason=sampling_pb2.FINISH_REASON_ERROR, error=DEAD_END + " after 2 output tokens"),
        body,
    )


def test_a_failed_generation_is_reported(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{stack.base_url}/v1/completions", json=COMPLETION) as response:
                assert response.status == 500
                assert "worker-0 failed" in (await response.json())["error"]["message"]
            async with http.post(f"{stack.base_url}/v1/completions", json={**COMPLETION, "stream": True}) as response:
                lines = [line async for line in response.content if line.startswith(b"data: ")]
            assert b"worker-0 failed" in lines[-2] and lines[-1] == b"data: [DONE]\n"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stack.generation.Generate(generation_pb2.GenerateRequest(prompt="hi"))
        assert caught.value.code() == grpc.StatusCode.INTERNAL and "worker-0 failed" in caught.value.details()

    run_on_stack(tokenizer_address, Script(text_ids[:3], finish_reason=sampling_pb2.FINISH_REASON_ERROR), body)


def test_a_request_past_its_deadline_is_a_timeout_error(tokenizer_address, text_ids) -> None:
    """The scheduler cancels a request at its deadline; the client gets 504 / DEADLINE_EXCEEDED, not a
    short answer with finish_reason "abort"."""

    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{stack.base_url}/v1/completions", json=COMPLETION) as response:
                error = (await response.json())["error"]
                assert response.status == 504 and error["code"] == "timeout"
                assert "timed out after 1 s" in error["message"]
            async with http.post(f"{stack.base_url}/v1/completions", json={**COMPLETION, "stream": True}) as response:
                lines = [line async for line in response.content if line.startswith(b"data: ")]
            assert b'"code":"timeout"' in lines[-2] and lines[-1] == b"data: [DONE]\n"
        for call in (
            stack.generation.Generate(generation_pb2.GenerateRequest(prompt="hi")),
            _drain(stack.generation.GenerateStream(generation_pb2.GenerateRequest(prompt="hi"))),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    run_on_stack(tokenizer_address, Script(text_ids[:6], hold_after=2), body, request_timeout_s=1)


async def _drain(call) -> None:
    async for _ in call:
        pass
