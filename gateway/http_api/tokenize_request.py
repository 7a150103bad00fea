"""vLLM's /tokenize and /detokenize bodies, parsed once into typed requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.http_api.chat_messages import chat_messages, chat_tools
from gateway.http_api.openai_fields import json_field
from gateway.runner.generation_spec import Prompt
from shardline.core.errors import InvalidArgument


@dataclass(slots=True)
class TokenizeRequest:
    """A /tokenize body: a prompt's text, or a conversation as the chat endpoint renders it."""

    model: str  # empty: the served one
    prompt: Prompt  # its text, or its chat (with its tools' definitions)
    add_special_tokens: bool = True  # a text's: the tokenizer's special tokens around it


@dataclass(slots=True)
class DetokenizeRequest:
    """A /detokenize body: token ids to turn into text."""

    model: str  # empty: the served one
    tokens: list[int]


def parse_tokenize(body: Any) -> TokenizeRequest:
    """{"prompt": text} or {"messages": [...]}, with vLLM's options; InvalidArgument names a bad field."""
    model = _model(body)
    if json_field(body, "return_token_strs", bool):
        raise InvalidArgument("return_token_strs", "token strings are not supported; /detokenize decodes ids")
    if "messages" in body and "prompt" in body:
        raise InvalidArgument("prompt", "give a prompt or messages, not both")
    if "messages" in body:
        if json_field(body, "add_special_tokens", bool):
            raise InvalidArgument("add_special_tokens", "a chat's special tokens come from its template")
        conversation = chat_messages(body)  # rendered as the chat endpoint renders it, tools included
        tools = chat_tools(body)
        assert conversation.chat is not None
        conversation.chat.tools_json = tools.tools_json if tools is not None else ""
        return TokenizeRequest(model, conversation)
    prompt = json_field(body, "prompt", str)
    if prompt is None:
        raise InvalidArgument("prompt", "give a prompt (a string) or messages")
    special = json_field(body, "add_special_tokens", bool)
    return TokenizeRequest(model, Prompt(text=prompt), True if special is None else special)


def parse_detokenize(body: Any) -> DetokenizeRequest:
    """{"tokens": [ids]}; InvalidArgument names a bad field."""
    model = _model(body)
    tokens = json_field(body, "tokens", list)
    if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise InvalidArgument("tokens", "must be a list of token ids")
    return DetokenizeRequest(model, tokens)


def _model(body: Any) -> str:
    if not isinstance(body, dict):
        raise InvalidArgument("body", "must be a JSON object")
    return json_field(body, "model", str) or ""
