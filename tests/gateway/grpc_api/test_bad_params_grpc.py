"""Bad input over gRPC: INVALID_ARGUMENT naming the field, from Generate and GenerateStream alike."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import duration_pb2

from shardline.proto import common_pb2, generation_pb2, sampling_pb2
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.scripted_scheduler import Script

BAD = b"\x0a\x02\xff\xfe"  # no GenerateRequest: field 1 (the model) as a string of bad UTF-8


def test_invalid_arguments_over_grpc(tokenizer_address, text_ids) -> None:
    cases = [
        (
            generation_pb2.GenerateRequest(prompt="hi", params=sampling_pb2.SamplingParameters(temperature=9)),
            "params.temperature",
        ),
        (generation_pb2.GenerateRequest(prompt="hi", params=sampling_pb2.SamplingParameters(top_p=0)), "params.top_p"),
        (
            generation_pb2.GenerateRequest(prompt="hi", params=sampling_pb2.SamplingParameters(stop=["a"] * 17)),
            "params.stop",
        ),
        (
            generation_pb2.GenerateRequest(prompt="hi", params=sampling_pb2.SamplingParameters(max_tokens=0)),
            "params.max_tokens",
        ),
        (
            generation_pb2.GenerateRequest(prompt="hi", params=sampling_pb2.SamplingParameters(top_logprobs=2)),
            "params.top_logprobs",
        ),
        (generation_pb2.GenerateRequest(), "input"),
        (generation_pb2.GenerateRequest(prompt=""), "prompt"),
        # The scheduler, which only gateways reach, leaves an empty prompt to them.
        (generation_pb2.GenerateRequest(prompt_token_ids={"ids": []}), "prompt_token_ids"),
        (generation_pb2.GenerateRequest(prompt="hi", request_id="has space"), "request_id"),
        # Accepted here once, then refused by the scheduler with its own rule: now one rule for both.
        (generation_pb2.GenerateRequest(prompt="hi", request_id="café-1"), "request_id"),
        (generation_pb2.GenerateRequest(prompt_token_ids={"ids": [49152]}), "prompt_token_ids"),
        (
            generation_pb2.GenerateRequest(messages={"messages": [{"role": "", "content": "x"}]}),
            "messages.messages[0].role",
        ),
        (
            generation_pb2.GenerateRequest(messages={"messages": [{"role": "user", "content": "x"}, {"role": "bot"}]}),
            "messages.messages[1].role",
        ),
        (
            generation_pb2.GenerateRequest(
                prompt="hi",
                params=sampling_pb2.SamplingParameters(structured_output=sampling_pb2.StructuredOutput(regex="[a-")),
            ),
            "params.structured_output",
        ),
        (
            generation_pb2.GenerateRequest(
                prompt="hi", params=sampling_pb2.SamplingParameters(structured_output=sampling_pb2.StructuredOutput())
            ),
            "params.structured_output",
        ),
        # Once INTERNAL: min_tokens over the default max_tokens, which the worker refused.
        (
            generation_pb2.GenerateRequest(prompt="hi", params=sampling_pb2.SamplingParameters(min_tokens=2**32 - 1)),
            "params.min_tokens",
        ),
        (generation_pb2.GenerateRequest(prompt="hi", timeout=duration_pb2.Duration(seconds=1, nanos=-5)), "timeout"),
        (generation_pb2.GenerateRequest(prompt="hi", timeout=duration_pb2.Duration(nanos=2 * 10**9)), "timeout"),
        (generation_pb2.GenerateRequest(prompt="hi", timeout=duration_pb2.Duration(seconds=-1)), "timeout"),
        # Echoed whole, a 100k-character id made the error's trailer too big: RESOURCE_EXHAUSTED.
        (generation_pb2.GenerateRequest(prompt="hi", request_id="r" * 100_000), "request_id"),
    ]

    async def body(stack: Stack) -> None:
        for request, field in cases:
            for call in (stack.generation.Generate(request), _drain(stack.generation.GenerateStream(request))):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, caught.value.details())
                assert caught.value.details().startswith(f"{field}:"), caught.value.details()
        for lookup in (
            stack.generation.GetRequest(common_pb2.GetRequestRequest(request_id="r" * 100_000)),
            stack.generation.Cancel(common_pb2.CancelRequest(request_id="r" * 100_000)),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await lookup
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(caught.value.details()) < 300
        # A timeout past what timedelta holds (once INTERNAL, an OverflowError) is the gateway's own limit.
        reply = await stack.generation.Generate(
            generation_pb2.GenerateRequest(prompt="hi", timeout=duration_pb2.Duration(seconds=2**62))
        )
        assert reply.text
        # Bytes that are no GenerateRequest: grpc would answer UNKNOWN, with a Python exception's text.
        for method, call in (("Generate", stack.channel.unary_unary), ("GenerateStream", stack.channel.unary_stream)):
            raw = call(f"/shardline.v1.Generation/{method}", request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await (_drain(raw(BAD)) if method == "GenerateStream" else raw(BAD))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
            assert caught.value.details().startswith("request: not a valid message")

    run_on_stack(tokenizer_address, Script(text_ids), body)


async def _drain(call) -> None:
    async for _ in call:
        pass
