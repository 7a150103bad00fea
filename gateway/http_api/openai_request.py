"""OpenAI /v1/completions and /v1/chat/completions request bodies, parsed into a GenerationSpec's parts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.http_api.openai_fields import refuse_unknown_fields
from gateway.http_api.structured_fields import structured_output_from_openai
from gateway.runner.chat_request import chat_request
from gateway.runner.generation_spec import Prompt
from gateway.runner.params import MAX_CHOICES, json_field, sampling_from_openai
from gateway.tenancy.slo_params import Slo, checked_target
from gateway.tools.tool_params import ToolRequest, constrain, tool_calls_from_message, tools_from_openai
from shardline.core.errors import InvalidArgument
from shardline.proto import sampling_pb2

# OpenAI's newer "developer" role is the system prompt under another name; templates know only "system".
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


@dataclass(slots=True)
class OpenAIRequest:
    """A completions or chat completions request, parsed and type-checked (ranges are checked later)."""

    chat: bool  # /v1/chat/completions rather than /v1/completions
    model: str  # requested model
    prompts: list[Prompt]  # prompt texts, token ids or chat messages: several for a batch of completions
    params: sampling_pb2.SamplingParameters  # the sampling fields, unresolved
    priority: int  # lower is served first (a vLLM extension)
    stream: bool  # answer with server-sent events
    include_usage: bool  # stream_options.include_usage: end the stream with a usage chunk
    max_tokens_field: str = "max_tokens"  # max_completion_tokens when a chat request used that name
    n: int = 1  # completions to generate per prompt
    echo: bool = False  # completions: the prompt comes back before its completion (with its logprobs)
    echo_only: bool = False  # echo with max_tokens 0: each choice is its prompt alone (how text is scored)
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field was sent: answer it in vLLM's shape
    structured_output_field: str = ""  # where params.structured_output came from (response_format...)
    tools: ToolRequest | None = None  # chat: the functions the model may call, and how
    slo: Slo = Slo()  # ttft_target_ms and refuse_late, as sent

    @property
    def num_choices(self) -> int:
        """Choices in the response: n per prompt, prompt by prompt (OpenAI's order)."""
        return len(self.prompts) * self.n


def parse_request(body: Any, chat: bool) -> OpenAIRequest:
    """The request in an OpenAI JSON body; InvalidArgument names the first bad field."""
    if not isinstance(body, dict):
        raise InvalidArgument("body", "must be a JSON object")
    refuse_unknown_fields(body, chat)
    model = json_field(body, "model", str) or ""
    prompts = [chat_messages(body)] if chat else _prompts(body)
    params, priority, max_tokens_field, n = sampling_from_openai(body, chat)
    structured_output, structured_output_field = structured_output_from_openai(body)
    if structured_output is not None:
        params.structured_output.CopyFrom(structured_output)
    tools = tools_from_openai(body) if chat else None
    if tools is not None:
        prompts[0].chat.tools_json = tools.tools_json
        if constrain(tools, params, structured_output_field):
            structured_output_field = "tools"
    if len(prompts) * n > MAX_CHOICES:
        raise InvalidArgument(
            "n" if len(prompts) == 1 else "prompt",
            f"a request may ask for at most {MAX_CHOICES} completions (prompts x n), got {len(prompts)} x {n}",
        )
    stream = bool(json_field(body, "stream", bool))
    options = json_field(body, "stream_options", dict)
    if options is not None and not stream:
        raise InvalidArgument("stream_options", "is only allowed when stream is true")
    include_usage = bool(json_field(options or {}, "include_usage", bool, "stream_options.include_usage"))
    echo = not chat and bool(json_field(body, "echo", bool))
    echo_only = echo and params.HasField("max_tokens") and params.max_tokens == 0
    if echo_only:
        # OpenAI's way to score a text: its logprobs, no completion. As in vLLM, the engine still samples
        # one token (a prefill yields one), and the response leaves it out.
        if params.min_tokens:
            raise InvalidArgument("min_tokens", "must not exceed max_tokens")
        params.max_tokens = 1
    return OpenAIRequest(
        chat,
        model,
        prompts,
        params,
        priority,
        stream,
        include_usage,
        max_tokens_field,
        n,
        echo,
        echo_only,
        body.get("prompt_logprobs") is not None,
        structured_output_field,
        tools,
        slo_from_openai(body),
    )


def slo_from_openai(body: dict[str, Any]) -> Slo:
    """The SLO fields of an OpenAI body; InvalidArgument names a bad one."""
    target_ms = json_field(body, "ttft_target_ms", float)
    target_s = None if target_ms is None else checked_target(target_ms / 1000.0, "ttft_target_ms")
    return Slo(target_s, json_field(body, "refuse_late", bool))


def _prompts(body: dict[str, Any]) -> list[Prompt]:
    """A prompt (text or token ids), or a batch of them: a list of texts or of token-id lists."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return [_prompt(prompt, "prompt")]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
        return [_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    raise InvalidArgument("prompt", "must be a string, a list of token ids, or a non-empty list of either")


def _prompt(prompt: str | list[int], field: str) -> Prompt:
    return Prompt(text=prompt, field=field) if isinstance(prompt, str) else Prompt(token_ids=prompt, field=field)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


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
