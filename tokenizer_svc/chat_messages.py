"""ChatMessage protos as the dicts chat templates expect, tool calls and tool definitions included.

Templates read a tool call as OpenAI spells it ({"id", "type", "function": {"name", "arguments"}}),
with the arguments as a mapping, not as JSON text: Llama 3's and Qwen's templates write
`arguments | tojson`, which would quote the text a second time. vLLM hands them over the same way.
"""

from __future__ import annotations

import json
from typing import Any

from shardline.core.errors import InvalidArgument
from shardline.core.text.chat_template import TEMPLATE_GLOBALS
from shardline.proto import sampling_pb2


def template_messages(messages: list[sampling_pb2.ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as the template's `messages`."""
    turns = []
    for index, message in enumerate(messages):
        turn: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            turn["tool_calls"] = [
                _tool_call(call, f"messages[{index}].tool_calls[{j}]") for j, call in enumerate(message.tool_calls)
            ]
        if message.tool_call_id:
            turn["tool_call_id"] = message.tool_call_id
        if message.name:
            turn["name"] = message.name
        turns.append(turn)
    return turns


def _tool_call(call: sampling_pb2.ToolCall, field: str) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments) if call.arguments else {}
        json.dumps(arguments, ensure_ascii=False).encode()  # an escaped lone surrogate is no text
    except (ValueError, RecursionError):
        arguments = None
    if not isinstance(arguments, dict):
        raise InvalidArgument(f"{field}.function.arguments", "must be a JSON object (of Unicode text)")
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


# What the service gives the template itself; a request's variables may not replace them.
_RESERVED = (
    frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message", "bos_token", "eos_token"})
    | TEMPLATE_GLOBALS
)


def template_variables(kwargs_json: str) -> dict[str, Any]:
    """A request's extra template variables (vLLM's chat_template_kwargs)."""
    if not kwargs_json:
        return {}
    try:
        variables = json.loads(kwargs_json)
    except (ValueError, RecursionError):
        variables = None
    if not isinstance(variables, dict):
        raise InvalidArgument("chat_template_kwargs", "must be a JSON object")
    if reserved := sorted(_RESERVED.intersection(variables)):
        raise InvalidArgument(f"chat_template_kwargs.{reserved[0]}", "is set by the server")
    return variables


def template_tools(tools_json: str) -> list[dict[str, Any]] | None:
    """The template's `tools`: None when the request has none, as transformers passes them."""
    if not tools_json:
        return None
    try:
        tools = json.loads(tools_json)
    except (ValueError, RecursionError):
        raise InvalidArgument("tools", "must be a JSON array of tool definitions") from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise InvalidArgument("tools", "must be a JSON array of tool definitions")
    return tools or None
