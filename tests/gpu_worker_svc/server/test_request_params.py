import pytest

from gpu_worker_svc.engine.sampling_params import SamplingParams
from gpu_worker_svc.server.request_params import engine_request
from shardline.proto import worker_pb2


def _new(params: dict | None = None, prompt: list[int] = (1, 2, 3), eos: list[int] = ()) -> worker_pb2.NewRequest:
    return worker_pb2.NewRequest(request_id="r", prompt_token_ids=prompt, params=params or {}, eos_token_ids=eos)


def test_unset_fields_take_engine_defaults_and_max_tokens_fills_the_context():
    req = engine_request(_new(), max_model_len=100)
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
        max_model_len=100,
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
    assert engine_request(_new({"stop_token_ids": [9]}, eos=[2, 5, 6]), 100).params.stop_token_ids == [9, 5, 6]


def test_logprobs_without_alternatives_is_zero_and_alternatives_need_logprobs():
    assert engine_request(_new({"logprobs": True}), 100).params.logprobs == 0
    assert engine_request(_new({}), 100).params.logprobs is None
    with pytest.raises(ValueError, match="top_logprobs"):
        engine_request(_new({"top_logprobs": 2}), 100)


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
        engine_request(_new(params), 100)


def test_requests_must_fit_the_context():
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine_request(_new(prompt=list(range(10))), max_model_len=10)
    with pytest.raises(ValueError, match="max_tokens"):
        engine_request(_new({"max_tokens": 5}, prompt=list(range(6))), max_model_len=10)
    assert engine_request(_new({"max_tokens": 4}, prompt=list(range(6))), 10).params.max_tokens == 4
