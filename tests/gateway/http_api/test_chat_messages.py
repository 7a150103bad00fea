"""A chat body's messages, without services: an assistant turn's earlier tool calls, replayed."""

from __future__ import annotations

import json

import pytest

from gateway.http_api.chat_messages import tool_calls_from_message
from shardline.core.errors import InvalidArgument


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
