"""Sampling parameters, as either API gives them: validated against the served model, and resolved.

Every error is an InvalidArgument naming the offending field (`param` in an OpenAI error body).
The resolved SamplingParameters has every optional field set, seed included, as the scheduler and
workers expect.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

from shardline.core.errors import InvalidArgument
from shardline.proto import sampling_pb2

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 1024  # characters; longer ones are surely a mistake and cost a scan per step
MAX_TOP_LOGPROBS = 20
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range for each logit_bias value

# (field, lowest, highest, lowest allowed itself): float ranges, as vLLM and OpenAI set them.
_FLOAT_RANGES = (
    ("temperature", 0.0, 2.0, True),
    ("top_p", 0.0, 1.0, False),
    ("min_p", 0.0, 1.0, True),
    ("presence_penalty", -2.0, 2.0, True),
    ("frequency_penalty", -2.0, 2.0, True),
    ("repetition_penalty", 0.0, 2.0, False),
)
# The float fields that proto3 lets a client leave unset; the others are checked as sent.
_OPTIONAL_FLOATS = frozenset(("temperature", "top_p", "repetition_penalty"))


@dataclass(slots=True)
class ModelLimits:
    """What the served model and the gateway's settings allow one request."""

    vocab_size: int  # token ids must be below this
    max_context_length: int  # prompt plus output, in tokens
    max_prompt_tokens: int  # longest prompt accepted
    max_tokens_limit: int  # largest max_tokens accepted


class ContextLengthExceeded(InvalidArgument):
    """The prompt, or the prompt plus max_tokens, does not fit the model's context."""

    openai_code = "context_length_exceeded"


def validate_sampling(
    params: sampling_pb2.SamplingParameters, limits: ModelLimits, prefix: str = "", max_tokens_field: str = "max_tokens"
) -> sampling_pb2.SamplingParameters:
    """A checked copy of `params` with every optional field but max_tokens resolved.

    `prefix` goes before field names in errors ("params." over gRPC), and `max_tokens_field` is the
    name the client gave max_tokens (OpenAI chat: max_completion_tokens). max_tokens depends on the
    prompt's length, so `resolve_max_tokens` sets it once the prompt is tokenized.
    """
    resolved = sampling_pb2.SamplingParameters()
    resolved.CopyFrom(params)
    for name, low, high, low_allowed in _FLOAT_RANGES:
        if name not in _OPTIONAL_FLOATS or resolved.HasField(name):
            _check_range(prefix + name, getattr(resolved, name), low, high, low_allowed)
    if resolved.HasField("max_tokens") and not 1 <= resolved.max_tokens <= limits.max_tokens_limit:
        raise InvalidArgument(prefix + max_tokens_field, f"must be between 1 and {limits.max_tokens_limit}")
    if resolved.HasField("max_tokens") and resolved.min_tokens > resolved.max_tokens:
        raise InvalidArgument(prefix + "min_tokens", "must not exceed max_tokens")
    if resolved.top_k > limits.vocab_size:
        raise InvalidArgument(prefix + "top_k", f"must not exceed the vocabulary size ({limits.vocab_size})")
    _check_stop(list(resolved.stop), prefix + "stop")
    for token_id in resolved.stop_token_ids:
        if token_id >= limits.vocab_size:
            raise InvalidArgument(prefix + "stop_token_ids", f"{token_id} is not a token id of this model")
    for token_id, bias in resolved.logit_bias.items():
        if token_id >= limits.vocab_size:
            raise InvalidArgument(prefix + "logit_bias", f"{token_id} is not a token id of this model")
        _check_range(prefix + "logit_bias", bias, -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS, True)
    if resolved.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidArgument(prefix + "top_logprobs", f"must be at most {MAX_TOP_LOGPROBS}")
    if resolved.top_logprobs and not resolved.logprobs:
        raise InvalidArgument(prefix + "top_logprobs", "needs logprobs to be enabled")
    if resolved.prompt_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidArgument(prefix + "prompt_logprobs", f"must be at most {MAX_TOP_LOGPROBS}")
    for name in ("temperature", "top_p", "repetition_penalty"):
        if not resolved.HasField(name):
            setattr(resolved, name, 1.0)
    if not resolved.HasField("seed"):
        # Sampling is keyed on (seed, token index), so a seed fixed here makes a resumed run identical.
        resolved.seed = secrets.randbits(63)
    if not resolved.HasField("skip_special_tokens"):
        resolved.skip_special_tokens = True
    return resolved


def resolve_max_tokens(
    params: sampling_pb2.SamplingParameters,
    prompt_tokens: int,
    limits: ModelLimits,
    default: int | None,
    prefix: str = "",
    max_tokens_field: str = "max_tokens",
) -> None:
    """Check or set max_tokens for a prompt of `prompt_tokens`: an explicit value must fit the context;
    without one, `default` shrinks to fit.

    With no default (the rest of the context, as vLLM's OpenAI server does) and no operator limit
    below the context, max_tokens stays unset: the worker then generates up to its own context
    length, which a small KV cache can make shorter than the model's.
    """
    room = limits.max_context_length - prompt_tokens
    if params.HasField("max_tokens"):
        if params.max_tokens > room:
            raise ContextLengthExceeded(
                prefix + max_tokens_field,
                f"the prompt ({prompt_tokens} tokens) plus {max_tokens_field} ({params.max_tokens}) exceeds the "
                f"model's context length ({limits.max_context_length})",
            )
        return
    if default is None and limits.max_tokens_limit >= room:
        if params.min_tokens > room:
            raise InvalidArgument(
                prefix + "min_tokens",
                f"must not exceed the room the prompt ({prompt_tokens} "
                f"tokens) leaves in the model's context ({room} tokens)",
            )
        return
    params.max_tokens = max(1, min(room if default is None else default, room, limits.max_tokens_limit))
    if params.min_tokens > params.max_tokens:  # checked here, not by the worker: it would fail it as its own fault
        raise InvalidArgument(
            prefix + "min_tokens", f"must not exceed {max_tokens_field}, which is {params.max_tokens} when not given"
        )


def _check_stop(stops: list[str], field: str) -> None:
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidArgument(field, f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    for stop in stops:
        if not stop or len(stop) > MAX_STOP_LENGTH:
            raise InvalidArgument(field, f"each stop string must have 1 to {MAX_STOP_LENGTH} characters")


def _check_range(field: str, value: float, low: float, high: float, low_allowed: bool) -> None:
    above_low = value >= low if low_allowed else value > low
    if not (math.isfinite(value) and above_low and value <= high):
        bracket = "[" if low_allowed else "("
        raise InvalidArgument(field, f"must be in {bracket}{low:g}, {high:g}], got {value:g}")
