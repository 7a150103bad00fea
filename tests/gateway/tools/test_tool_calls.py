"""The output's tool calls, without services: read from the text whole and streamed, by each parser."""

from __future__ import annotations

import json

from gateway.tools.tool_calls import ToolCallOutput
from gateway.tools.tool_params import ToolRequest, resolve_parser
from tests.gateway.tools.test_tool_params import request


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
