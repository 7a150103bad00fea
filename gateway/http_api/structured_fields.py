"""Structured output in OpenAI bodies: OpenAI's response_format, and vLLM's two spellings of the same.

- `response_format`: {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}
- `structured_outputs` (vLLM): {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
- `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (vLLM's older names)

At most one may be given. Here only the shapes are checked; whether a schema, regex or grammar
compiles is the tokenizer service's CheckStructuredOutput, before the request is submitted.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.http_api.openai_fields import json_field
from shardline.core.errors import InvalidArgument
from shardline.proto import sampling_pb2

# vLLM's names, each with the StructuredOutput field it sets.
_GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED_OUTPUTS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}
# structured_outputs' other keys that mean something here (disable_fallback: there is one backend).
_OPTIONS = ("disable_any_whitespace", "disable_fallback")
# vLLM's names for the one backend there is, and the option its older spelling could carry.
_BACKENDS = ("auto", "xgrammar")
_BACKEND_OPTIONS = ("disable-any-whitespace", "no-fallback")  # no-fallback: there is none to fall back to


def structured_output_from_openai(body: dict[str, Any]) -> tuple[sampling_pb2.StructuredOutput | None, str]:
    """The body's constraint, if any, and the field it came from (named in errors)."""
    found: list[tuple[sampling_pb2.StructuredOutput, str]] = []
    response_format = json_field(body, "response_format", dict)
    if response_format is not None:
        constraint = _response_format(response_format)
        if constraint is not None:
            found.append(constraint)
    options = json_field(body, "structured_outputs", dict)
    if options is not None:
        unknown = [key for key in options if key not in _STRUCTURED_OUTPUTS and key not in _OPTIONS]
        if unknown:
            raise InvalidArgument(f"structured_outputs.{unknown[0]}", "is not supported")
        # json_object: false is vLLM's way of leaving it out.
        given = [
            key
            for key in _STRUCTURED_OUTPUTS
            if options.get(key) is not None and not (key == "json_object" and options[key] is False)
        ]
        if len(given) != 1:
            raise InvalidArgument("structured_outputs", "give exactly one of " + ", ".join(_STRUCTURED_OUTPUTS))
        field = f"structured_outputs.{given[0]}"
        constraint = _constraint(_STRUCTURED_OUTPUTS[given[0]], options[given[0]], field)
        compact = options.get("disable_any_whitespace", False)
        if not isinstance(compact, bool):
            raise InvalidArgument("structured_outputs.disable_any_whitespace", "must be a boolean")
        _compact(constraint, compact)
        found.append((constraint, field))
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            found.append((_constraint(kind, body[name], name), name))
    if body.get("guided_whitespace_pattern") is not None:
        raise InvalidArgument("guided_whitespace_pattern", "is not supported")
    backend = json_field(body, "guided_decoding_backend", str)
    if backend is not None:
        name, _, extra = backend.partition(":")
        flags = [flag for flag in extra.split(",") if flag]
        if name not in _BACKENDS or any(flag not in _BACKEND_OPTIONS for flag in flags):
            raise InvalidArgument(
                "guided_decoding_backend",
                "the only backend is xgrammar (with the options disable-any-whitespace, no-fallback)",
            )
        for constraint, _ in found:
            _compact(constraint, "disable-any-whitespace" in flags)
    if len(found) > 1:
        raise InvalidArgument(
            found[1][1], f"only one structured output constraint is allowed; {found[0][1]} is given too"
        )
    return found[0] if found else (None, "")


def _compact(constraint: sampling_pb2.StructuredOutput, compact: bool) -> None:
    """vLLM's disable_any_whitespace: for the JSON kinds; the others have no free whitespace to drop."""
    if compact and constraint.WhichOneof("kind") in ("json_schema", "json_object"):
        constraint.disable_any_whitespace = True


def _response_format(value: dict[str, Any]) -> tuple[sampling_pb2.StructuredOutput, str] | None:
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return sampling_pb2.StructuredOutput(json_object=True), "response_format"
    if kind != "json_schema":
        raise InvalidArgument("response_format.type", "must be text, json_object or json_schema")
    spec = value.get("json_schema")
    if spec is not None and not isinstance(spec, dict):
        raise InvalidArgument("response_format.json_schema", "must be an object")
    field = "response_format.json_schema.schema"
    if spec is None or spec.get("schema") is None:
        raise InvalidArgument(field, "is required when type is json_schema")
    return _constraint("json_schema", spec["schema"], field), field


def _constraint(kind: str, value: Any, field: str) -> sampling_pb2.StructuredOutput:
    """One StructuredOutput from a JSON value, type-checked (an OpenAI schema is an object, vLLM's
    guided_json may also be its JSON text)."""
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(field, f"is not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise InvalidArgument(field, "must be a JSON Schema object")
        return sampling_pb2.StructuredOutput(json_schema=json.dumps(value))
    if kind == "json_object":
        if value is not True:
            raise InvalidArgument(field, "must be true")
        return sampling_pb2.StructuredOutput(json_object=True)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidArgument(field, "must be a non-empty list of non-empty strings")
        return sampling_pb2.StructuredOutput(choice=sampling_pb2.Choices(choices=value))
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(field, "must be a non-empty string")
    message = sampling_pb2.StructuredOutput()
    setattr(message, kind, value)  # json_schema, regex or grammar: a string field each
    return message
