"""Sampling parameters validated against the model and resolved, as both APIs give them."""

from __future__ import annotations

import pytest

from gateway.runner.params import ModelLimits, resolve_max_tokens, validate_sampling
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
