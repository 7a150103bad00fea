"""OpenAI bodies parsed into typed requests, and what they ask of the sampler, without servers."""

from __future__ import annotations

import pytest

from gateway.http_api.openai_request import parse_request
from gateway.runner.params import ModelLimits, validate_sampling
from shardline.core.errors import InvalidArgument
from shardline.proto import sampling_pb2

LIMITS = ModelLimits(vocab_size=49152, max_context_length=8192, max_prompt_tokens=8191, max_tokens_limit=8192)


def sampling_from_openai(body: dict, chat: bool) -> tuple[sampling_pb2.SamplingParameters, int, str, int]:
    """The sampling parameters, priority, name of max_tokens and n that a body asks for, given a prompt."""
    prompt = {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
    parsed = parse_request({**prompt, **body}, chat)
    return parsed.sampling.parameters(), parsed.priority, parsed.sampling.max_tokens_field, parsed.n


def test_openai_fields_map_onto_sampling_parameters() -> None:
    params, priority, max_tokens_field, n = sampling_from_openai(
        {
            "max_completion_tokens": 12,
            "max_tokens": 99,
            "temperature": 0.7,
            "top_k": -1,
            "seed": -1,
            "stop": "END",
            "stop_token_ids": [7],
            "logprobs": True,
            "top_logprobs": 3,
            "priority": -2,
            "ignore_eos": True,
            "skip_special_tokens": False,
            "user": "ignored",
        },
        chat=True,
    )
    assert (params.max_tokens, params.top_k, params.seed, list(params.stop)) == (12, 0, 2**64 - 1, ["END"])
    assert (params.logprobs, params.top_logprobs, params.ignore_eos, params.skip_special_tokens) == (
        True,
        3,
        True,
        False,
    )
    assert abs(params.temperature - 0.7) < 1e-6 and priority == -2
    assert max_tokens_field == "max_completion_tokens"  # so that errors name the field the client sent
    assert n == 1
    completions, _, _, _ = sampling_from_openai({"logprobs": 0}, chat=False)
    assert (completions.logprobs, completions.top_logprobs) == (True, 0)
    biased, _, _, _ = sampling_from_openai({"logit_bias": {"50": -100, "7": 2.5, "0": 100}}, chat=False)
    assert dict(biased.logit_bias) == {50: -100.0, 7: 2.5, 0: 100.0}
    assert dict(validate_sampling(biased, LIMITS).logit_bias) == dict(biased.logit_bias)
    with pytest.raises(InvalidArgument) as caught:  # the gRPC API's map is range-checked as well
        validate_sampling(sampling_pb2.SamplingParameters(logit_bias={3: 1e9}), LIMITS, prefix="params.")
    assert caught.value.field == "params.logit_bias"


def test_prompt_logprobs_and_echo() -> None:
    params, *_ = sampling_from_openai({"prompt": "x", "prompt_logprobs": 3}, chat=False)
    assert params.HasField("prompt_logprobs") and params.prompt_logprobs == 3
    params, *_ = sampling_from_openai({"prompt": "x", "echo": True, "logprobs": 2}, chat=False)
    assert params.prompt_logprobs == 2  # the echoed prompt's tokens get logprobs like the completion's
    params, *_ = sampling_from_openai({"prompt": "x", "echo": True}, chat=False)
    assert not params.HasField("prompt_logprobs")  # echo alone needs none computed
    params, *_ = sampling_from_openai({"prompt_logprobs": 0}, chat=True)
    assert params.HasField("prompt_logprobs") and params.prompt_logprobs == 0
    for body, chat, field in (
        ({"echo": True}, True, "echo"),
        ({"prompt_logprobs": 21}, False, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, False, "prompt_logprobs"),
    ):
        with pytest.raises(InvalidArgument) as caught:
            sampling_from_openai(body, chat=chat)
        assert caught.value.field == field
    with pytest.raises(InvalidArgument) as caught:
        validate_sampling(sampling_pb2.SamplingParameters(prompt_logprobs=21), LIMITS, "params.")
    assert caught.value.field == "params.prompt_logprobs"


def test_echo_with_max_tokens_0_asks_for_one_token_and_keeps_none() -> None:
    # OpenAI's way to score a text. The engine samples one token (a prefill yields one); the response drops it.
    parsed = parse_request({"prompt": "x", "echo": True, "max_tokens": 0, "logprobs": 1}, chat=False)
    assert parsed.echo_only and parsed.sampling.max_tokens == 1 and parsed.sampling.prompt_logprobs == 1
    assert not parse_request({"prompt": "x", "echo": True, "max_tokens": 2}, chat=False).echo_only
    # Without echo, max_tokens 0 asks for nothing at all: still refused, when the limits are checked.
    unechoed = parse_request({"prompt": "x", "max_tokens": 0}, chat=False)
    assert not unechoed.echo_only and unechoed.sampling.max_tokens == 0
    with pytest.raises(InvalidArgument) as caught:
        validate_sampling(unechoed.sampling.parameters(), LIMITS)
    assert caught.value.field == "max_tokens"
    with pytest.raises(InvalidArgument) as caught:
        parse_request({"prompt": "x", "echo": True, "max_tokens": 0, "min_tokens": 1}, chat=False)
    assert caught.value.field == "min_tokens"
