"""The fields of OpenAI bodies: which each endpoint takes, and how one is read and type-checked.

An unknown field is refused, naming it, never ignored. As vLLM decides per field: what the gateway
cannot honour is a 400 (OpenAI's legacy `functions`, `tools` on /v1/completions, `best_of` on
chat...), and only fields that change nothing in the answer are taken without being used (`user`,
`metadata`), their types still checked. A field given as null counts as absent, as OpenAI clients
send it.
"""

from __future__ import annotations

from typing import Any

from shardline.core.errors import InvalidArgument

# Read by both endpoints (sampling, streaming, structured output, vLLM's extensions).
_COMMON = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "seed",
        "stop",
        "stop_token_ids",
        "logit_bias",
        "min_tokens",
        "ignore_eos",
        "skip_special_tokens",
        "logprobs",
        "prompt_logprobs",
        "priority",
        "ttft_target_ms",
        "refuse_late",
        "n",
        "stream",
        "stream_options",
        "echo",
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_whitespace_pattern",
        "guided_decoding_backend",
    }
)
# Harmless: they tag a request for the client's own books and change nothing in the answer.
_HARMLESS = frozenset({"user", "metadata"})
COMPLETIONS_FIELDS = _COMMON | _HARMLESS | {"prompt", "best_of", "suffix"}
CHAT_FIELDS = (
    _COMMON
    | _HARMLESS
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "chat_template",
        "chat_template_kwargs",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
    }
)
# Why a known field of the other endpoint, or of an older API, is refused.
_REASONS = {
    "functions": "is OpenAI's deprecated form of tools, which is not supported: use tools",
    "function_call": "is OpenAI's deprecated form of tool_choice, which is not supported: use tool_choice",
}
_STREAM_OPTIONS = frozenset({"include_usage"})
_METADATA_PAIRS = 16  # OpenAI's limits on metadata
_METADATA_KEY_CHARS = 64
_METADATA_VALUE_CHARS = 512


def refuse_unknown_fields(body: dict[str, Any], chat: bool) -> None:
    """InvalidArgument naming the first field this endpoint does not take."""
    known, other = (CHAT_FIELDS, COMPLETIONS_FIELDS) if chat else (COMPLETIONS_FIELDS, CHAT_FIELDS)
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    for key, value in body.items():
        if key in known or value is None:
            continue
        if key in _REASONS:
            raise InvalidArgument(key, _REASONS[key])
        if key in other:
            there = "/v1/completions" if chat else "/v1/chat/completions"
            raise InvalidArgument(key, f"is not supported by {endpoint} (it belongs to {there})")
        raise InvalidArgument(key[:64], f"is not a field of {endpoint}")
    options = body.get("stream_options")
    if isinstance(options, dict):
        for key, value in options.items():
            if key not in _STREAM_OPTIONS and value is not None:
                raise InvalidArgument(f"stream_options.{key[:64]}", "is not supported")
    _check_harmless(body)


def _check_harmless(body: dict[str, Any]) -> None:
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidArgument("user", "must be a string")
    metadata = body.get("metadata")
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > _METADATA_PAIRS:
        raise InvalidArgument("metadata", f"must be an object of at most {_METADATA_PAIRS} string values")
    for key, value in metadata.items():
        if len(key) > _METADATA_KEY_CHARS or not isinstance(value, str) or len(value) > _METADATA_VALUE_CHARS:
            raise InvalidArgument(
                f"metadata.{key[:64]}",
                f"keys may have {_METADATA_KEY_CHARS} characters and "
                f"values must be strings of {_METADATA_VALUE_CHARS} at most",
            )


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
    return as_float(value, path or name) if kind is float else value


def integer_field(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    """body[name] as an integer in [low, high), or None when absent."""
    value = json_field(body, name, int)
    if value is not None and not low <= value < high:
        raise InvalidArgument(name, f"must be an integer in [{low}, {high - 1}]")
    return value


def as_float(value: int | float, field: str) -> float:
    """A JSON number as a float: an integer literal of hundreds of digits is out of any range."""
    try:
        return float(value)
    except OverflowError:
        raise InvalidArgument(field, "is out of range") from None
