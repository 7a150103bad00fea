"""A chat body's conversation: its messages, the options of vLLM's for rendering them, and its tools."""

from __future__ import annotations

import json
from typing import Any

from gateway.http_api.openai_fields import json_field
from gateway.runner.chat_request import chat_request
from gateway.runner.generation_spec import Prompt
from gateway.tools.tool_params import ToolRequest, tool_request
from shardline.core.errors import InvalidArgument
from shardline.proto import sampling_pb2

# OpenAI's newer "developer" role is the system prompt under another name; templates know only "system".
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def chat_messages(body: dict[str, Any]) -> Prompt:
    """The conversation, and vLLM's options for rendering it: add_generation_prompt,
    continue_final_message, chat_template_kwargs and documents (a per-request chat_template is refused).
    The tokenizer service refuses variables that would replace its own (messages, tools...)."""
    if body.get("chat_template") is not None:
        raise InvalidArgument(
            "chat_template", "a request may not bring its own template (the server's SHARDLINE_CHAT_TEMPLATE sets one)"
        )
    chat = chat_request(
        _turns(body),
        json_field(body, "add_generation_prompt", bool),
        bool(json_field(body, "continue_final_message", bool)),
    )
    variables = dict(json_field(body, "chat_template_kwargs", dict) or {})
    documents = json_field(body, "documents", list)
    if documents is not None:
        if not all(isinstance(document, dict) for document in documents):
            raise InvalidArgument("documents", "must be an array of objects")
        variables["documents"] = documents
    if variables:
        chat.template_kwargs_json = json.dumps(variables)
    return Prompt(chat=chat, field="messages")


def chat_tools(body: dict[str, Any]) -> ToolRequest | None:
    """The functions the model may call, and how: `tools`, `tool_choice` and `parallel_tool_calls`."""
    return tool_request(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))


def _turns(body: dict[str, Any]) -> list[sampling_pb2.ChatMessage]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages", "must be a non-empty array of messages")
    turns = []
    for index, message in enumerate(messages):
        field = f"messages[{index}]"
        if not isinstance(message, dict):
            raise InvalidArgument(field, "must be an object with role and content")
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:  # a list or object is unhashable: no dict lookup
            raise InvalidArgument(f"{field}.role", f"must be one of {', '.join(_ROLES)}")
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""  # an assistant turn that only called tools, as replayed transcripts carry it
        turn = sampling_pb2.ChatMessage(role=_ROLES[role], content=_content(content, field))
        if role == "assistant":
            turn.tool_calls.extend(tool_calls_from_message(message, field))
        turn.tool_call_id = _optional_text(message, "tool_call_id", field)
        turn.name = _optional_text(message, "name", field)
        turns.append(turn)
    return turns


def _optional_text(message: dict[str, Any], key: str, field: str) -> str:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidArgument(f"{field}.{key}", "must be a string")
    return value or ""


def _content(content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise InvalidArgument(f"{field}.content", "only text parts are supported")
            texts.append(part["text"])
        return "\n".join(texts)  # as vLLM joins a message's text parts
    raise InvalidArgument(f"{field}.content", "must be a string or an array of text parts")


def tool_calls_from_message(message: dict[str, Any], field: str) -> list[sampling_pb2.ToolCall]:
    """An assistant turn's earlier calls, replayed in the conversation."""
    calls = message.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise InvalidArgument(f"{field}.tool_calls", "must be an array of tool calls")
    result = []
    for index, call in enumerate(calls):
        where = f"{field}.tool_calls[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidArgument(where, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, dict):  # some clients send the object itself
            arguments = json.dumps(arguments)
        if not isinstance(arguments, str) or not is_json_object(arguments):
            raise InvalidArgument(f"{where}.function.arguments", "must be a JSON object, as text")
        call_id = call.get("id") or ""
        if not isinstance(call_id, str):
            raise InvalidArgument(f"{where}.id", "must be a string")
        result.append(sampling_pb2.ToolCall(id=call_id, name=function["name"], arguments=arguments))
    return result


def is_json_object(text: str) -> bool:
    """Whether `text` is a JSON object that is Unicode text throughout: an escaped lone surrogate
    ("\\ud800") is valid JSON but no text, and would fail the tokenizer once the template wrote it."""
    try:
        value = json.loads(text)
        json.dumps(value, ensure_ascii=False).encode()
    except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        return False
    return isinstance(value, dict)
