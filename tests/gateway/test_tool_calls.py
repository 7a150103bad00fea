"""Tool calling in the gateway without services: the request's tools, and the output's calls."""

from __future__ import annotations

import json

import pytest

from gateway.tool_calls import _AUTO_READERS, ToolCallOutput
from gateway.tool_params import (
    TOOL_CALL_PARSERS,
    ToolRequest,
    resolve_parser,
    tool_calls_from_message,
    tools_from_openai,
)
from shardline.errors import InvalidArgument

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
    parsed = tools_from_openai(body)
    assert parsed is not None
    return parsed


def streamed(output: ToolCallOutput, pieces: list[str]) -> tuple[str, list[dict]]:
    """Feeds `pieces` as a stream would, and adds up the deltas as an OpenAI client does."""
    content, calls = "", []
    for i, text in enumerate(pieces):
        more, deltas = output.feed(text, final=i == len(pieces) - 1)
        content += more
        for delta in deltas:
            body = delta.body()
            if "id" in body:
                assert body["index"] == len(calls) and body["type"] == "function"
                calls.append({"id": body["id"], "name": body["function"]["name"], "arguments": ""})
            calls[body["index"]]["arguments"] += body["function"]["arguments"]
    return content, calls


def by_char(text: str) -> list[str]:
    return list(text)


def test_required_output_is_read_into_calls_whole_and_streamed() -> None:
    tricky = {"city": 'Par}is "{[', "nested": {"a": [1, {"b": '\\"'}]}}
    text = json.dumps([{"name": "get_weather", "parameters": tricky}, {"name": "get_time", "parameters": {}}])
    message, reason = ToolCallOutput(request("required")).message(text, "stop")
    assert reason == "tool_calls" and message["content"] is None
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == tricky
    assert json.loads(calls[1]["function"]["arguments"]) == {}
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in calls)
    assert all(set(c) == {"id", "type", "function"} for c in calls)  # OpenAI's shape: no stream index
    for pieces in (by_char(text), [text[:7], text[7:30], text[30:]]):
        content, streamed_calls = streamed(ToolCallOutput(request("required")), pieces)
        assert content == ""
        assert [(c["name"], c["arguments"]) for c in streamed_calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in calls
        ]


def test_required_output_cut_before_a_call_is_text() -> None:
    message, reason = ToolCallOutput(request("required")).message('[{"na', "length")
    assert message == {"role": "assistant", "content": '[{"na'} and reason == "length"


def test_named_output_is_the_arguments() -> None:
    text = '{"city": "Oslo"}'
    message, reason = ToolCallOutput(request({"type": "function", "function": {"name": "get_weather"}})).message(
        text, "stop"
    )
    assert reason == "stop"  # OpenAI's answer to a forced call
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": text}
    content, calls = streamed(
        ToolCallOutput(request({"type": "function", "function": {"name": "get_weather"}})), by_char(text)
    )
    assert content == "" and calls[0]["arguments"] == text and calls[0]["name"] == "get_weather"


def hermes_request() -> ToolRequest:
    parsed = request()
    resolve_parser(parsed, "", "hermes")
    return parsed


def test_hermes_output_keeps_text_and_reads_calls() -> None:
    text = (
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
    )
    message, reason = ToolCallOutput(hermes_request()).message(text, "stop")
    assert reason == "tool_calls" and message["content"] == "Let me check. "
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    for pieces in (by_char(text), [text[:16], text[16:40], text[40:]]):
        content, calls = streamed(ToolCallOutput(hermes_request()), pieces)
        assert content == "Let me check. "
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
        ]


def test_hermes_output_without_calls_is_text_as_written() -> None:
    for text in (
        "The weather is <tool nice>.",
        "<tool_call>not json</tool_call> end",
        'cut <tool_call>{"na',
        "ends on a partial tag <tool_",
    ):
        message, reason = ToolCallOutput(hermes_request()).message(text, "stop")
        assert message == {"role": "assistant", "content": text} and reason == "stop"
        content, calls = streamed(ToolCallOutput(hermes_request()), by_char(text))
        assert content == text and calls == []


def test_tool_choice_none_passes_text_through() -> None:
    output = ToolCallOutput(request("none"))
    assert output.message('<tool_call>{"name": "get_time"}</tool_call>', "stop") == (
        {"role": "assistant", "content": '<tool_call>{"name": "get_time"}</tool_call>'},
        "stop",
    )


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
        tools_from_openai(body)
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
    assert tools_from_openai({"tools": [], "tool_choice": "none"}) is None


def test_replayed_calls() -> None:
    calls = tool_calls_from_message(
        {
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}},
            ]
        },
        "messages[1]",
    )
    assert [(c.id, c.name, json.loads(c.arguments)) for c in calls] == [
        ("call_1", "get_weather", {"city": "Oslo"}),
        ("call_2", "get_time", {}),
    ]
    deep = "[" * 100_000 + "]" * 100_000
    for bad, field in (
        (["x"], "messages[1].tool_calls[0]"),
        ([{"function": {"name": "f", "arguments": deep}}], "messages[1].tool_calls[0].function.arguments"),
        (
            [{"function": {"name": "f", "arguments": '{"c": "\\ud800"}'}}],
            "messages[1].tool_calls[0].function.arguments",
        ),
        ([{"function": {"name": "f", "arguments": "[1]"}}], "messages[1].tool_calls[0].function.arguments"),
        ("x", "messages[1].tool_calls"),
    ):
        with pytest.raises(InvalidArgument) as caught:
            tool_calls_from_message({"tool_calls": bad}, "messages[1]")
        assert caught.value.field == field


def llama3_request() -> ToolRequest:
    parsed = request()
    resolve_parser(parsed, "llama3_json", "")
    return parsed


def test_llama3_json_output_reads_calls() -> None:
    text = (
        ' {"name": "get_weather", "parameters": {"city": "Oslo; Bergen {x}"}}; {"name": "get_time", "parameters": {}}'
    )
    message, reason = ToolCallOutput(llama3_request()).message(text, "stop")
    assert reason == "tool_calls" and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Oslo; Bergen {x}"}),
        ("get_time", {}),
    ]
    for pieces in (by_char(text), [text[:20], text[20:]]):
        content, calls = streamed(ToolCallOutput(llama3_request()), pieces)
        assert content == "" and [(c["name"], c["arguments"]) for c in calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
        ]


def test_llama3_json_text_stays_text() -> None:
    for text in ("It is sunny in {Oslo}.", '{"not": "a call"}', '{"name": "get_weather", "parameters": {"ci', "  "):
        whole, reason = ToolCallOutput(llama3_request()).message(text, "stop")
        assert whole == {"role": "assistant", "content": text} and reason == "stop"
        assert streamed(ToolCallOutput(llama3_request()), by_char(text)) == (text, [])
    # A reply that starts as text passes through as it streams, calls or not after it.
    content, calls = streamed(ToolCallOutput(llama3_request()), ["Sure", ': {"name": "get_time", "parameters": {}}'])
    assert content == 'Sure: {"name": "get_time", "parameters": {}}' and calls == []
    message, _ = ToolCallOutput(llama3_request()).message('{"name": "get_time", "parameters": {}} and then', "stop")
    assert message["tool_calls"][0]["function"]["name"] == "get_time" and message["content"] == " and then"


def test_hermes_edge_cases_read_the_same_whole_and_streamed() -> None:
    cases = [
        # Blank text after a call is layout, however it is split.
        ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n\nDone.', "Done.", ["get_time"]),
        # A closing tag inside an argument's text does not end the call.
        (
            '<tool_call>{"name": "get_weather", "arguments": {"city": "a</tool_call>b"}}</tool_call>',
            "",
            ["get_weather"],
        ),
        # Arguments written as JSON text.
        (
            '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>',
            "",
            ["get_weather"],
        ),
        # A broken block, then a good one: the broken one is text.
        (
            '<tool_call>{"name": </tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
            '<tool_call>{"name": </tool_call>',
            ["get_time"],
        ),
    ]
    for text, content, names in cases:
        message, _ = ToolCallOutput(hermes_request()).message(text, "stop")
        assert (message["content"] or "") == content, text
        assert [c["function"]["name"] for c in message.get("tool_calls", [])] == names, text
        for pieces in (by_char(text), [text]):
            streamed_content, calls = streamed(ToolCallOutput(hermes_request()), pieces)
            assert (streamed_content, [c["name"] for c in calls]) == (content, names), text
    message, _ = ToolCallOutput(hermes_request()).message(cases[1][0], "stop")
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "a</tool_call>b"}


def test_one_call_without_parallel_tool_calls() -> None:
    parsed = request(parallel_tool_calls=False)
    resolve_parser(parsed, "hermes", "")
    text = (
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "x"}}</tool_call>'
    )
    message, reason = ToolCallOutput(parsed).message(text, "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"] and reason == "tool_calls"


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
