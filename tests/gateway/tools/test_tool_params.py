"""The request's tools, without services: parsed and checked naming the field, and as constraints."""

from __future__ import annotations

import json

import pytest

from gateway.tools.tool_calls import _AUTO_READERS
from gateway.tools.tool_params import TOOL_CALL_PARSERS, ToolRequest, resolve_parser, tool_request
from shardline.core.errors import InvalidArgument

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty object


def request(choice=None, tools=(WEATHER, TIME), **extra) -> ToolRequest:
    body = {"tools": list(tools), **extra}
    if choice is not None:
        body["tool_choice"] = choice
    parsed = tool_request(**body)
    assert parsed is not None
    return parsed


def test_constraints_of_each_choice() -> None:
    assert request("none").constraint() is None and request("auto").constraint() is None
    named = request({"type": "function", "function": {"name": "get_weather"}}).constraint()
    assert json.loads(named.json_schema) == WEATHER["function"]["parameters"] and named.disable_any_whitespace
    calls = json.loads(request("required").constraint().json_schema)
    assert calls["type"] == "array" and calls["minItems"] == 1 and "maxItems" not in calls
    assert [c["properties"]["name"]["enum"] for c in calls["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert calls["$defs"]["tool_1"] == {"type": "object", "properties": {}}
    untyped = {"type": "function", "function": {"name": "any", "parameters": {"properties": {"a": {}}}}}
    schema = request("required", tools=[untyped]).constraint().json_schema
    assert accepts(schema, '[{"name": "any", "parameters": {"a": 1}}]')
    assert not accepts(schema, '[{"name": "any", "parameters": 1}]')  # arguments are an object
    assert set(_AUTO_READERS) == set(TOOL_CALL_PARSERS)
    assert json.loads(request("required", parallel_tool_calls=False).constraint().json_schema)["maxItems"] == 1


def accepts(schema: str, text: str) -> bool:
    """Whether xgrammar's grammar for `schema` (compact, as "required" asks) derives `text`."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False), text)


def test_required_keeps_each_tools_references_its_own() -> None:
    """Local references of every kind still mean what they meant in the tool's own schema."""
    tree = {
        "type": "function",
        "function": {
            "name": "tree",
            "parameters": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
                "required": ["name"],
                "additionalProperties": False,
            },
        },
    }
    where = {
        "type": "function",
        "function": {
            "name": "where",
            "parameters": {
                "type": "object",
                "properties": {"loc": {"$ref": "#/definitions/Loc"}, "when": {"$ref": "#/$defs/Day"}},
                "required": ["loc", "when"],
                "additionalProperties": False,
                "definitions": {
                    "Loc": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}},
                        "required": ["city"],
                        "additionalProperties": False,
                    }
                },
                "$defs": {"Day": {"type": "integer"}},
            },
        },
    }
    same = {
        "type": "function",
        "function": {
            "name": "same",
            "parameters": {  # the same $defs name, meaning another
                "type": "object",
                "properties": {"a": {"$ref": "#/$defs/Day"}, "b": {"$ref": "#/properties/a"}},
                "required": ["a", "b"],
                "additionalProperties": False,
                "$defs": {"Day": {"type": "string"}},
            },
        },
    }
    schema = request("required", tools=[tree, where, same]).constraint().json_schema
    for text, fits in [
        ('[{"name": "tree", "parameters": {"name": "a", "kids": [{"name": "b"}]}}]', True),
        (
            '[{"name": "tree", "parameters": {"name": "a", "kids": '
            '[[{"name": "tree", "parameters": {"name": "x"}}]]}}]',
            False,
        ),
        ('[{"name": "where", "parameters": {"loc": {"city": "Oslo"}, "when": 3}}]', True),
        ('[{"name": "where", "parameters": {"loc": {"city": "Oslo"}, "when": "3"}}]', False),
        ('[{"name": "same", "parameters": {"a": "x", "b": "y"}}]', True),
        ('[{"name": "same", "parameters": {"a": 1, "b": "y"}}]', False),
        (
            '[{"name": "tree", "parameters": {"name": "a"}}, {"name": "where", "parameters": {"loc": {"city": "x"}, '
            '"when": 1}}]',
            True,
        ),
        ("[]", False),
        ('[{"name": "nope", "parameters": {}}]', False),
    ]:
        assert accepts(schema, text) == fits, text


@pytest.mark.parametrize(
    "body, field",
    [
        ({"tools": "x"}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": ["get_weather"]}}},
            "tool_choice.function.name",
        ),
        ({"tools": [{"type": "function", "function": {"name": "get_weather\n"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$defs": [1]}}}]},
            "tools[0].function.parameters.$defs",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"definitions": "x"}}}]},
            "tools[0].function.parameters.definitions",
        ),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_tool_requests_name_the_field(body, field) -> None:
    with pytest.raises(InvalidArgument) as caught:
        tool_request(**body)
    assert caught.value.field == field


def test_auto_needs_a_parser() -> None:
    parsed = request()
    with pytest.raises(InvalidArgument) as caught:
        resolve_parser(parsed, "", "")
    assert caught.value.field == "tool_choice"
    with pytest.raises(InvalidArgument):
        resolve_parser(request(), "none", "hermes")  # the operator turned "auto" off
    resolve_parser(parsed, "hermes", "")
    assert parsed.parser == "hermes"
    required = request("required")
    resolve_parser(required, "", "")  # no parser needed: the output is constrained
    assert tool_request(tools=[], tool_choice="none") is None


def test_too_many_tools_for_required_name_tools() -> None:
    parameters = {"type": "object", "properties": {"a": {"type": "string", "description": "x" * 1000}}}
    big = [{"type": "function", "function": {"name": f"f{i}", "parameters": parameters}} for i in range(80)]
    with pytest.raises(InvalidArgument) as caught:
        request("required", tools=big).constraint()
    assert caught.value.field == "tools" and "required" in str(caught.value)


def test_a_deeply_nested_schema_is_a_400_under_required() -> None:
    deep: dict = {"type": "object"}
    for _ in range(600):
        deep = {"type": "object", "properties": {"a": deep}}
    tool = {"type": "function", "function": {"name": "deep", "parameters": deep}}
    with pytest.raises(InvalidArgument) as caught:
        request("required", tools=[tool]).constraint()
    assert caught.value.field == "tools"
