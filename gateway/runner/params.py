"""Sampling parameters: parsed from OpenAI JSON or taken from gRPC, validated, and resolved.

Every error is an InvalidArgument naming the offending field (`param` in an OpenAI error body).
The resolved SamplingParameters has every optional field set, seed included, as the scheduler and
workers expect.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Any

from shardline.core.errors import InvalidArgument
from shardline.proto import sampling_pb2

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 1024  # characters; longer ones are surely a mistake and cost a scan per step
MAX_TOP_LOGPROBS = 20
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range for each logit_bias value
# Most completions one OpenAI request may ask for (prompts x n): each is a request in the queue.
MAX_CHOICES = 64
# OpenAI's legacy /v1/completions generates 16 tokens when max_tokens is absent.
OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_UINT32 = 1 << 32
_INT32 = 1 << 31
_UINT64 = 1 << 64

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


def sampling_from_openai(body: dict[str, Any], chat: bool) -> tuple[sampling_pb2.SamplingParameters, int, str, int]:
    """(sampling parameters, priority, the name max_tokens came under, n) from an OpenAI completions
    or chat body; values are checked later."""
    _reject_unsupported(body, chat)
    params = sampling_pb2.SamplingParameters()
    max_tokens_field = "max_tokens"
    max_tokens = _integer(body, "max_completion_tokens", 0, _UINT32) if chat else None
    if max_tokens is not None:
        max_tokens_field = "max_completion_tokens"  # OpenAI's newer name; it wins over max_tokens
    else:
        max_tokens = _integer(body, "max_tokens", 0, _UINT32)
    if max_tokens is not None:
        params.max_tokens = max_tokens
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = json_field(body, name, float)
        if value is not None:
            setattr(params, name, value)
    top_k = _integer(body, "top_k", -1, _UINT32)
    params.top_k = 0 if top_k in (None, -1) else top_k  # vLLM spells "no top-k" as -1
    params.min_tokens = _integer(body, "min_tokens", 0, _UINT32) or 0
    seed = _integer(body, "seed", -(1 << 63), _UINT64)
    if seed is not None:
        params.seed = seed % _UINT64  # OpenAI seeds are signed 64-bit; the wire carries the same bits unsigned
    params.stop.extend(_stop_strings(body.get("stop")))
    stop_ids = json_field(body, "stop_token_ids", list) or []
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < _UINT32 for t in stop_ids):
        raise InvalidArgument("stop_token_ids", "must be a list of token ids")
    params.stop_token_ids.extend(stop_ids)
    for key, bias in (json_field(body, "logit_bias", dict) or {}).items():
        # JSON object keys are strings: OpenAI's are token ids written in decimal.
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < _UINT32):
            raise InvalidArgument("logit_bias", f"keys must be token ids, got {key[:20]!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise InvalidArgument("logit_bias", f"the bias of token {key} must be a number")
        params.logit_bias[int(key)] = _as_float(bias, "logit_bias")
    params.ignore_eos = bool(json_field(body, "ignore_eos", bool))
    skip = json_field(body, "skip_special_tokens", bool)
    if skip is not None:
        params.skip_special_tokens = skip
    if chat:
        params.logprobs = bool(json_field(body, "logprobs", bool))
        params.top_logprobs = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS + 1) or 0
    else:
        # Completions: logprobs is the number of alternatives per token (0 still returns the sampled one's).
        count = _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS + 1)
        params.logprobs = count is not None
        params.top_logprobs = count or 0
    prompt_logprobs = _integer(body, "prompt_logprobs", 0, MAX_TOP_LOGPROBS + 1)  # vLLM's extension
    if prompt_logprobs is not None:
        params.prompt_logprobs = prompt_logprobs
    elif not chat and params.logprobs and json_field(body, "echo", bool):
        # An echoed prompt's tokens get logprobs like the completion's (how harnesses score text).
        params.prompt_logprobs = params.top_logprobs
    priority = _integer(body, "priority", -_INT32, _INT32) or 0
    n = _integer(body, "n", 1, MAX_CHOICES + 1) or 1
    if not chat and _integer(body, "best_of", 1, _UINT32) not in (None, n):
        # best_of > n means ranking candidates by likelihood and returning the best n: not done here.
        raise InvalidArgument("best_of", "only best_of equal to n is supported")
    return params, priority, max_tokens_field, n


def _reject_unsupported(body: dict[str, Any], chat: bool) -> None:
    if chat and json_field(body, "echo", bool):
        raise InvalidArgument("echo", "echo is only supported by /v1/completions")
    if json_field(body, "stream", bool) and body.get("prompt_logprobs") is not None:
        raise InvalidArgument(
            "prompt_logprobs",
            "is not available when stream is true (as in vLLM); /v1/completions' echo with logprobs streams them",
        )
    if not chat and json_field(body, "suffix", str):
        raise InvalidArgument("suffix", "suffix is not supported")


def _stop_strings(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidArgument("stop", "must be a string or a list of strings")
    return stops


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


_JSON_TYPES = {
    float: "a number",
    int: "an integer",
    bool: "a boolean",
    str: "a string",
    list: "an array",
    dict: "an object",
}


def json_field(body: dict[str, Any], name: str, kind: type, path: str | None = None) -> Any:
    """body[name] when present and not null, checked to be of JSON type `kind`; errors name `path`
    (where `body` is itself a field: "stream_options.include_usage"), or `name`."""
    value = body.get(name)
    if value is None:
        return None
    numeric = kind in (int, float)
    ok = isinstance(value, (int, float) if kind is float else kind) and not (numeric and isinstance(value, bool))
    if not ok:
        raise InvalidArgument(path or name, f"must be {_JSON_TYPES[kind]}")
    return _as_float(value, path or name) if kind is float else value


def _as_float(value: int | float, field: str) -> float:
    """A JSON number as a float: an integer literal of hundreds of digits is out of any range."""
    try:
        return float(value)
    except OverflowError:
        raise InvalidArgument(field, "is out of range") from None


def _integer(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    """body[name] as an integer in [low, high), or None when absent."""
    value = json_field(body, name, int)
    if value is not None and not low <= value < high:
        raise InvalidArgument(name, f"must be an integer in [{low}, {high - 1}]")
    return value
