"""Parameter resolution and the gateway's settings, without servers."""

from __future__ import annotations

import pytest

from gateway.http_api.openai_request import parse_request
from gateway.main import parse_settings
from gateway.runner.params import ModelLimits, resolve_max_tokens, sampling_from_openai, validate_sampling
from shardline.core.errors import InvalidArgument
from shardline.proto import sampling_pb2

LIMITS = ModelLimits(vocab_size=49152, max_context_length=8192, max_prompt_tokens=8191, max_tokens_limit=8192)


def test_unset_fields_are_resolved_for_the_workers() -> None:
    resolved = validate_sampling(sampling_pb2.SamplingParameters(), LIMITS)
    assert (resolved.temperature, resolved.top_p, resolved.repetition_penalty) == (1.0, 1.0, 1.0)
    assert resolved.HasField("seed") and resolved.skip_special_tokens
    assert not resolved.HasField("max_tokens")
    resolve_max_tokens(resolved, 8000, LIMITS, default=256)
    assert resolved.max_tokens == 192  # a default shrinks to the room left in the context
    unset = validate_sampling(sampling_pb2.SamplingParameters(), LIMITS)
    resolve_max_tokens(unset, 100, LIMITS, default=None)
    assert not unset.HasField("max_tokens")  # no default: the worker fills the rest of its context
    capped = ModelLimits(vocab_size=49152, max_context_length=8192, max_prompt_tokens=8191, max_tokens_limit=1000)
    resolve_max_tokens(unset, 100, capped, default=None)
    assert unset.max_tokens == 1000  # an operator's limit still applies
    explicit = validate_sampling(sampling_pb2.SamplingParameters(max_tokens=500, temperature=0, seed=3), LIMITS)
    assert (explicit.temperature, explicit.seed) == (0.0, 3)
    with pytest.raises(InvalidArgument) as caught:
        resolve_max_tokens(explicit, 8000, LIMITS, default=256, prefix="params.")
    assert caught.value.field == "params.max_tokens"


@pytest.mark.parametrize("default, prompt_tokens", [(16, 100), (None, 8100)])
def test_min_tokens_must_fit_the_max_tokens_it_gets(default, prompt_tokens) -> None:
    """Without max_tokens, min_tokens is checked against the default, or the room the prompt leaves
    (a worker would fail the request as its own fault)."""
    params = validate_sampling(sampling_pb2.SamplingParameters(min_tokens=100), LIMITS)
    with pytest.raises(InvalidArgument) as caught:
        resolve_max_tokens(params, prompt_tokens, LIMITS, default=default, prefix="params.")
    assert caught.value.field == "params.min_tokens"
    fits = validate_sampling(sampling_pb2.SamplingParameters(min_tokens=16), LIMITS)
    resolve_max_tokens(fits, 100, LIMITS, default=default)


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


def test_gateway_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDLINE_API_KEYS", "a, b,,c")
    monkeypatch.setenv("SHARDLINE_HTTP_PORT", "9000")
    settings = parse_settings([])
    assert (settings.api_keys, settings.http_port, settings.grpc_port) == (["a", "b", "c"], 9000, 50051)
    assert settings.gateway_id.startswith("gateway-") and settings.gateway_id != parse_settings([]).gateway_id
    settings = parse_settings(["--http-port", "0", "--api-keys", "k", "--scheduler-address", "sched:1"])
    assert (settings.http_port, settings.api_keys, settings.scheduler_address) == (0, ["k"], "sched:1")


def test_an_empty_variable_means_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    # docker compose passes `SHARDLINE_X:` through as an empty string when .env leaves it blank.
    monkeypatch.setenv("SHARDLINE_DEFAULT_MAX_TOKENS", "")
    monkeypatch.setenv("SHARDLINE_MAX_PROMPT_TOKENS", "")
    settings = parse_settings([])
    assert (settings.default_max_tokens, settings.max_prompt_tokens) == (None, None)


def test_prompt_logprobs_and_echo() -> None:
    params, *_ = sampling_from_openai({"prompt": "x", "prompt_logprobs": 3}, chat=False)
    assert params.HasField("prompt_logprobs") and params.prompt_logprobs == 3
    params, *_ = sampling_from_openai({"prompt": "x", "echo": True, "logprobs": 2}, chat=False)
    assert params.prompt_logprobs == 2  # the echoed prompt's tokens get logprobs like the completion's
    params, *_ = sampling_from_openai({"prompt": "x", "echo": True}, chat=False)
    assert not params.HasField("prompt_logprobs")  # echo alone needs none computed
    params, *_ = sampling_from_openai({"messages": [], "prompt_logprobs": 0}, chat=True)
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
    assert parsed.echo_only and parsed.params.max_tokens == 1 and parsed.params.prompt_logprobs == 1
    assert not parse_request({"prompt": "x", "echo": True, "max_tokens": 2}, chat=False).echo_only
    # Without echo, max_tokens 0 asks for nothing at all: still refused, when the limits are checked.
    unechoed = parse_request({"prompt": "x", "max_tokens": 0}, chat=False)
    assert not unechoed.echo_only and unechoed.params.max_tokens == 0
    with pytest.raises(InvalidArgument) as caught:
        validate_sampling(unechoed.params, LIMITS)
    assert caught.value.field == "max_tokens"
    with pytest.raises(InvalidArgument) as caught:
        parse_request({"prompt": "x", "echo": True, "max_tokens": 0, "min_tokens": 1}, chat=False)
    assert caught.value.field == "min_tokens"
