import pytest

from gpu_worker_svc.engine.sampling_params import SamplingParams


def test_defaults_are_valid():
    params = SamplingParams()
    params.validate()
    assert not params.is_greedy and not params.has_penalties


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0.0, "top_k": -1, "top_p": 1.0, "min_p": 1.0},
        {"max_tokens": 4, "min_tokens": 4, "logprobs": 20, "seed": -7},
        {"repetition_penalty": 0.5, "presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"stop_token_ids": [0, 5], "logprobs": 0, "prompt_logprobs": 0},
        {"logit_bias": {0: -100.0, 7: 100, 9: 0.5}},
    ],
)
def test_valid_edges(fields):
    SamplingParams(**fields).validate()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be in [0, max_tokens=4], got 5"),
        ({"min_tokens": -1}, "min_tokens must be in"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be finite"),
        ({"top_k": -2}, "top_k must be -1, 0 or positive"),
        ({"top_k": True}, "top_k must be an integer"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"min_p": -0.1}, "min_p must be in [0, 1]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2.0, 2.0]"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty must be finite"),
        ({"seed": "7"}, "seed must be an integer"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids must be >= 0"),
        ({"stop_token_ids": (3,)}, "stop_token_ids must be a list"),
        ({"logprobs": 21}, "logprobs must be in [0, 20], got 21"),
        ({"logprobs": -1}, "logprobs must be in"),
        ({"prompt_logprobs": 21}, "prompt_logprobs must be in [0, 20], got 21"),
        ({"prompt_logprobs": True}, "prompt_logprobs must be an integer"),
        ({"logit_bias": {5: 100.5}}, "logit_bias must map token ids >= 0 to biases in [-100, 100], got 5: 100.5"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias must map token ids >= 0"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias must be an integer"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias must be finite"),
        ({"logit_bias": [(5, 1.0)]}, "logit_bias must be a dict"),
    ],
)
def test_invalid_fields_name_the_field(fields, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**fields).validate()
    assert str(err.value).startswith(message)


def test_greedy_threshold_and_penalty_flags():
    assert SamplingParams(temperature=1e-5).is_greedy
    assert not SamplingParams(temperature=2e-5).is_greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties
