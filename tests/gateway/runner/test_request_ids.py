"""One rule for the ids clients name their requests with, over HTTP and gRPC: 1 to 128 characters,
so that the ids derived from them (an HTTP request's choices) stay within the 256 every lookup takes."""

from __future__ import annotations

import aiohttp
import grpc
import pytest

from shardline.core.ids import MAX_ID_LENGTH, MAX_NAMED_ID_LENGTH
from shardline.proto import generation_pb2
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.scripted_scheduler import Script


def test_a_named_id_of_128_is_taken_and_one_of_129_refused_naming_the_field(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        longest, too_long = "a" * MAX_NAMED_ID_LENGTH, "b" * (MAX_NAMED_ID_LENGTH + 1)
        async with aiohttp.ClientSession() as http:
            for request_id, status in ((longest, 200), (too_long, 400)):
                async with http.post(
                    f"{stack.base_url}/v1/completions",
                    json={"prompt": "hi", "max_tokens": 2, "n": 2},
                    headers={"X-Request-Id": request_id},
                ) as response:
                    assert response.status == status, await response.text()
                    if status == 400:
                        error = (await response.json())["error"]
                        assert error["param"] == "X-Request-Id" and "1 to 128" in error["message"]
        # The choices' ids, the named one with `-<n>`, are within what the scheduler takes.
        submitted = [s.request_id for s in stack.scheduler.submitted]
        assert submitted == [f"{longest}-0", f"{longest}-1"] and max(map(len, submitted)) <= MAX_ID_LENGTH
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stack.generation.Generate(generation_pb2.GenerateRequest(prompt="hi", request_id=too_long))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("request_id: must be 1 to 128")

    run_on_stack(tokenizer_address, Script(text_ids), body)
