"""Refused whatever the parameters: an unknown model (404), a full queue (429), a bad key (401), no backend (503)."""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
import openai
import pytest

from shardline.proto import generation_pb2, sampling_pb2
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.scripted_scheduler import MODEL, Script

COMPLETION = {"model": MODEL, "prompt": "Hello"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]}
BAD = b"\x0a\x02\xff\xfe"  # no GenerateRequest: field 1 (the model) as a string of bad UTF-8


def test_unknown_model_is_404_and_not_found(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            for endpoint, base in (("completions", COMPLETION), ("chat/completions", CHAT)):
                async with http.post(f"{stack.base_url}/v1/{endpoint}", json={**base, "model": "gpt-9"}) as response:
                    error = (await response.json())["error"]
                    assert response.status == 404
                    assert (error["param"], error["code"]) == ("model", "model_not_found")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stack.generation.Generate(generation_pb2.GenerateRequest(model="gpt-9", prompt="hi"))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_a_full_scheduler_queue_is_429_and_resource_exhausted(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        stack.scheduler.reject_with = grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(openai.RateLimitError) as caught:
            await openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0).completions.create(
                model=MODEL, prompt="hi"
            )
        assert caught.value.body["type"] == "rate_limit_error"
        assert caught.value.response.headers["Retry-After"] == "1"  # the openai client honours it
        with pytest.raises(grpc.aio.AioRpcError) as grpc_caught:
            await stack.generation.Generate(generation_pb2.GenerateRequest(prompt="hi"))
        assert grpc_caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The first refusal was the scheduler's; the second never reached it: for the hold, the
        # gateway refuses before tokenizing.
        assert [span.name for span in stack.spans.get_finished_spans()].count("tokenize") == 1
        stack.scheduler.reject_with = None
        await asyncio.sleep(0.3)  # past the hold
        # The refused requests left nothing behind: the same client id can be used again.
        reply = await stack.generation.Generate(generation_pb2.GenerateRequest(prompt="hi", request_id="mine-1"))
        assert reply.request_id == "mine-1"

    run_on_stack(tokenizer_address, Script(text_ids), body, queue_full_hold_s=0.25)


def test_api_keys_over_http_and_grpc(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            url = f"{stack.base_url}/v1/completions"
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic k1"}):
                async with http.post(url, json=COMPLETION, headers=headers) as response:
                    error = (await response.json())["error"]
                    assert response.status == 401 and error["type"] == "authentication_error"
            async with http.get(f"{stack.base_url}/v1/models") as response:
                assert response.status == 401
            async with http.get(f"{stack.base_url}/health") as response:
                assert response.status == 200
        good = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="k2", max_retries=0)
        assert (await good.completions.create(model=MODEL, prompt="hi")).choices[0].finish_reason
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="k3", max_retries=0).models.list()
        request = generation_pb2.GenerateRequest(prompt="hi")
        for call in (stack.generation.Generate(request), _drain(stack.generation.GenerateStream(request))):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # A caller without a key is refused before its request is read: UNAUTHENTICATED, not a parse error.
        raw = stack.channel.unary_unary(
            "/shardline.v1.Generation/Generate", request_serializer=None, response_deserializer=None
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await raw(BAD)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = await stack.generation.Generate(request, metadata=[("authorization", "Bearer k1")])
        assert reply.finish_reason == sampling_pb2.FINISH_REASON_STOP

    run_on_stack(tokenizer_address, Script(text_ids), body, api_keys="k1, k2")


def test_scheduler_unavailable_is_503(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        await stack.scheduler_server.stop(0)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{stack.base_url}/health") as response:
                assert response.status == 503
                assert (await response.json())["scheduler"] is False
            await asyncio.sleep(0.1)
            async with http.post(f"{stack.base_url}/v1/completions", json=COMPLETION) as response:
                assert response.status == 503 and response.headers["Retry-After"] == "1"
            async with http.get(f"{stack.base_url}/v1/completions") as response:  # a 405 says what is allowed
                assert response.status == 405 and response.headers["Allow"] == "POST"
                assert (await response.json())["error"]["code"] == "method_not_allowed"

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_health_needs_a_live_worker(tokenizer_address, text_ids) -> None:
    """/health is a readiness check: 503 while no live worker serves the model, though its services answer."""

    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{stack.base_url}/health") as response:
                assert response.status == 200 and (await response.json())["workers"] == 1
            stack.scheduler.workers_alive = False
            async with http.get(f"{stack.base_url}/health") as response:
                assert response.status == 503
                assert await response.json() == {
                    "status": "unavailable",
                    "tokenizer": True,
                    "scheduler": True,
                    "subscribed": True,
                    "workers": 0,
                }

    run_on_stack(tokenizer_address, Script(text_ids[:3]), body)


async def _drain(call) -> None:
    async for _ in call:
        pass
