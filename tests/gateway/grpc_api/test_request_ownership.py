"""With API keys on, a request belongs to the key that submitted it: another key can neither read,
resume nor cancel it (it is NOT_FOUND to that key, as an unknown id is)."""

from __future__ import annotations

import aiohttp
import grpc
import pytest

from shardline.proto import common_pb2, generation_pb2, sampling_pb2
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.scripted_scheduler import MODEL, Script

OWNER = [("authorization", "Bearer k1")]
OTHER = [("authorization", "Bearer k2")]


def test_a_key_reads_resumes_and_cancels_only_its_own_requests(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        request = generation_pb2.GenerateRequest(prompt="hi", request_id="owned-1")
        reply = await stack.generation.Generate(request, metadata=OWNER)
        assert reply.finish_reason == sampling_pb2.FINISH_REASON_STOP
        # The scheduler keeps a digest of the key, never the key itself.
        [submit] = stack.scheduler.submitted
        assert submit.owner and "k1" not in submit.owner

        lookup = common_pb2.GetRequestRequest(request_id="owned-1")
        info = await stack.generation.GetRequest(lookup, metadata=OWNER)
        assert info.request_id == "owned-1" and not info.owner  # the digest stays inside
        resume = generation_pb2.ResumeRequest(request_id="owned-1")
        assert [c async for c in stack.generation.Resume(resume, metadata=OWNER)]

        refused = [
            stack.generation.GetRequest(lookup, metadata=OTHER),
            stack.generation.Cancel(common_pb2.CancelRequest(request_id="owned-1"), metadata=OTHER),
            _drain(stack.generation.Resume(resume, metadata=OTHER)),
        ]
        for call in refused:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert stack.scheduler.cancelled == []  # the other key's cancel never reached the scheduler

        # Over HTTP the same key makes the same owner; another key, another.
        async with aiohttp.ClientSession() as http:
            for key in ("k1", "k2"):
                async with http.post(
                    f"{stack.base_url}/v1/completions",
                    json={"model": MODEL, "prompt": "hi"},
                    headers={"Authorization": f"Bearer {key}"},
                ) as response:
                    assert response.status == 200
        assert [s.owner == submit.owner for s in stack.scheduler.submitted[1:]] == [True, False]

    run_on_stack(tokenizer_address, Script(text_ids), body, api_keys="k1, k2")


def test_without_keys_anyone_may_act_on_any_request(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        await stack.generation.Generate(generation_pb2.GenerateRequest(prompt="hi", request_id="open-1"))
        assert stack.scheduler.submitted[0].owner == ""
        info = await stack.generation.GetRequest(common_pb2.GetRequestRequest(request_id="open-1"))
        assert info.request_id == "open-1"

    run_on_stack(tokenizer_address, Script(text_ids), body)


async def _drain(call) -> None:
    async for _ in call:
        pass
