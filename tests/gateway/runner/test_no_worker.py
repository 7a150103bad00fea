"""A request with no live worker of its model left: 503 with Retry-After, or UNAVAILABLE, saying why,
whether the scheduler refused it at Submit or failed it while it waited."""

from __future__ import annotations

import json

import aiohttp
import grpc
import pytest

from shardline.core.errors import NO_WORKER
from shardline.proto import generation_pb2, sampling_pb2
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.scripted_scheduler import Script

WHY = f"{NO_WORKER}: no worker of 'SmolLM2-135M-Instruct' has been live for 30 s; retry once one is up"


async def _check_refusals(stack: Stack, refused_at_submit: bool) -> None:
    async with aiohttp.ClientSession() as http:
        url = f"{stack.base_url}/v1/completions"
        async with http.post(url, json={"prompt": "hi", "max_tokens": 2}) as response:
            assert response.status == 503, await response.text()
            assert int(response.headers["Retry-After"]) >= 1
            assert (await response.json())["error"]["message"] == WHY
        async with http.post(url, json={"prompt": "hi", "max_tokens": 2, "stream": True}) as response:
            if refused_at_submit:  # before the stream's headers: a plain 503
                assert response.status == 503 and int(response.headers["Retry-After"]) >= 1
                assert (await response.json())["error"]["message"] == WHY
            else:  # the stream had begun: its error event, typed as a 503
                events = [line for line in (await response.text()).splitlines() if line.startswith("data: {")]
                assert response.status == 200 and len(events) == 1, events
                error = json.loads(events[0].removeprefix("data: "))["error"]
                assert (error["message"], error["code"]) == (WHY, "service_unavailable")
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await stack.generation.Generate(generation_pb2.GenerateRequest(prompt="hi"))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE and failed.value.details() == WHY


def test_a_request_failed_for_want_of_a_worker_is_503_with_retry_after(tokenizer_address, text_ids) -> None:
    failed = Script(text_ids[:0], finish_reason=sampling_pb2.FINISH_REASON_ERROR, error=WHY)
    run_on_stack(tokenizer_address, failed, lambda stack: _check_refusals(stack, refused_at_submit=False))


def test_a_submit_refused_for_want_of_a_worker_is_503_naming_why(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        stack.scheduler.reject_with = grpc.StatusCode.UNAVAILABLE
        stack.scheduler.reject_details = WHY
        await _check_refusals(stack, refused_at_submit=True)

    run_on_stack(tokenizer_address, Script(text_ids), body)
