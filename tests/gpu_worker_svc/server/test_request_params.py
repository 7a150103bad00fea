"""The worker's edge: a NewRequest as the engine's arguments, and every check the engine needs, once."""

import dataclasses

import pytest

from gpu_worker_svc.engine.sampling_params import SamplingParams
from gpu_worker_svc.server.request_params import EngineLimits, check_request, engine_request
from shardline.proto import worker_pb2
from shardline.structured_output import StructuredOutputSpec

# The default model's vocabulary, and the context its 64 MiB test KV cache holds (tests/gpu_worker_svc/engine).
LIMITS = EngineLimits(max_model_len=1456, vocab_size=49152)


def _limits(max_model_len: int) -> EngineLimits:
    return EngineLimits(max_model_len, LIMITS.vocab_size)


def _new(
    params: dict | None = None, prompt: list[int] = (1, 2, 3), eos: list[int] = (), output: list[int] = ()
) -> worker_pb2.NewRequest:
    return worker_pb2.NewRequest(
        request_id="r", prompt_token_ids=prompt, params=params or {}, eos_token_ids=eos, output_token_ids=output
    )


def test_unset_fields_take_engine_defaults_and_max_tokens_fills_the_context():
    req = engine_request(_new(), _limits(100))
    assert req.params == SamplingParams(max_tokens=97)
    assert req.eos_token_id is None


def test_set_fields_map_one_to_one():
    req = engine_request(
        _new(
            {
                "max_tokens": 7,
                "min_tokens": 2,
                "temperature": 0.0,
                "top_p": 0.5,
                "top_k": 40,
                "min_p": 0.1,
                "presence_penalty": 0.5,
                "frequency_penalty": -0.5,
                "repetition_penalty": 1.5,
                "seed": 42,
                "stop_token_ids": [9],
                "ignore_eos": True,
                "logprobs": True,
                "top_logprobs": 3,
                "stop": ["ignored"],
                "logit_bias": {11: -100.0, 12: 0.5},
            },
            eos=[2, 5, 6],
        ),
        _limits(100),
    )
    assert req.params == SamplingParams(
        max_tokens=7,
        min_tokens=2,
        temperature=0.0,
        top_k=40,
        top_p=0.5,
        min_p=pytest.approx(0.1),
        repetition_penalty=1.5,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        seed=42,
        stop_token_ids=[9],
        ignore_eos=True,
        logprobs=3,
        logit_bias={11: -100.0, 12: 0.5},
    )
    assert req.eos_token_id == 2
    # The first EOS is the request's; the others stop it like stop tokens, unless EOS is ignored.
    assert engine_request(_new({"stop_token_ids": [9]}, eos=[2, 5, 6]), _limits(100)).params.stop_token_ids == [9, 5, 6]


def test_logprobs_without_alternatives_is_zero_and_alternatives_need_logprobs():
    assert engine_request(_new({"logprobs": True}), _limits(100)).params.logprobs == 0
    assert engine_request(_new({}), _limits(100)).params.logprobs is None
    with pytest.raises(ValueError, match="top_logprobs"):
        engine_request(_new({"top_logprobs": 2}), _limits(100))


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"top_p": 0.0}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 3, "min_tokens": 5}, "min_tokens"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"logprobs": True, "top_logprobs": 50}, "logprobs"),
        ({"logit_bias": {3: 150.0}}, "logit_bias"),
    ],
)
def test_out_of_range_values_name_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        engine_request(_new(params), _limits(100))


def test_requests_must_fit_the_context():
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine_request(_new(prompt=list(range(10))), _limits(10))
    with pytest.raises(ValueError, match="max_tokens"):
        engine_request(_new({"max_tokens": 5}, prompt=list(range(6))), _limits(10))
    assert engine_request(_new({"max_tokens": 4}, prompt=list(range(6))), _limits(10)).params.max_tokens == 4


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def test_bad_prompts_values_and_token_ids_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="prompt_token_ids"):
        check_request([], GREEDY, LIMITS)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        check_request([10**9], GREEDY, LIMITS)
    with pytest.raises(ValueError, match="top_p"):
        check_request([5], SamplingParams(top_p=1.5), LIMITS)
    with pytest.raises(ValueError, match="output_token_ids"):
        check_request([5], GREEDY, LIMITS, output_token_ids=[10**6])
    with pytest.raises(ValueError, match="logit_bias"):
        check_request([5], dataclasses.replace(GREEDY, logit_bias={10**6: 1.0}), LIMITS)
    with pytest.raises(ValueError, match=r"^structured_output: choice"):
        check_request(
            [1, 2, 3], dataclasses.replace(GREEDY, structured_output=StructuredOutputSpec("choice", ())), LIMITS
        )
    check_request([5], GREEDY, LIMITS)


def test_a_request_too_long_for_the_context_is_refused():
    # Past the rotary table, or the KV cache the context is capped to, a step would fail for the whole batch.
    n = LIMITS.max_model_len
    with pytest.raises(ValueError, match="prompt_token_ids"):
        check_request([5] * n, GREEDY, LIMITS)
    with pytest.raises(ValueError, match="max_tokens"):
        check_request([5] * (n - 10), dataclasses.replace(GREEDY, max_tokens=20), LIMITS)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        check_request([5] * (n - 10), GREEDY, LIMITS, output_token_ids=[5] * 10)
    check_request([5] * (n - 10), dataclasses.replace(GREEDY, max_tokens=10), LIMITS)


def test_a_resumed_output_must_leave_something_to_generate():
    with pytest.raises(ValueError, match="max_tokens"):
        check_request([10, 11, 12], SamplingParams(max_tokens=2), LIMITS, output_token_ids=[1, 2])
    with pytest.raises(ValueError, match="max_tokens"):
        engine_request(_new({"max_tokens": 2}, prompt=[10, 11, 12], output=[1, 2]), LIMITS)
    check_request([10, 11, 12], SamplingParams(max_tokens=3), LIMITS, output_token_ids=[1, 2])
