"""Chat templates: a model's jinja2 template turning a list of messages into its prompt text.

Rendering matches transformers' `apply_chat_template(..., tokenize=False)`: the same sandboxed
environment options (trim_blocks, lstrip_blocks, loop controls) and the same helpers
(`raise_exception`, `strftime_now`, a `tojson` that does not escape HTML). Templates come from
model files, that is from strangers, so they only ever run in jinja2's immutable sandbox.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The model has no usable chat template, or the messages do not fit it."""


class _GenerationTag(Extension):
    # Training templates mark assistant text with {% generation %}...{% endgeneration %} for
    # transformers' assistant-token masks; serving only needs the text inside.
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes <, > and & for HTML, which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template, with the special tokens the template may refer to."""

    def __init__(self, template: str | None, bos_token: str | None, eos_token: str | None) -> None:
        if not template:
            raise ChatTemplateError("this model has no chat template; send a plain prompt (completions) instead")
        try:
            self._compiled = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"the model's chat template does not compile: {exc} (line {exc.lineno})") from exc
        self.source = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.tool_call_format = tool_call_format(template)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        variables: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages`; `variables` and extra keyword arguments (tools, documents,
        ...) go to the template.

        `continue_final_message` leaves the last message open, the text cut where its content ends,
        so that the model goes on with it rather than start a turn of its own: as transformers does
        it, with a tag appended to the content to find that place."""
        _check_messages(messages)
        context = {"tools": None, "documents": None, **(variables or {}), **kwargs}
        if continue_final_message:
            final = messages[-1].get("content")
            if not isinstance(final, str):
                raise ChatTemplateError(f"messages[{len(messages) - 1}].content must be text to be continued")
            messages = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_TAG}]
        try:
            # One mapping, not keywords: a variable may be called anything, "self" included.
            text = self._compiled.render(
                {
                    **context,
                    "messages": messages,
                    "add_generation_prompt": add_generation_prompt,
                    "bos_token": self.bos_token,
                    "eos_token": self.eos_token,
                }
            )
        except jinja2.TemplateError as exc:
            # raise_exception(...) in a template reports messages it rejects, e.g. roles that do not alternate.
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - a template meets values of types it never expected
            raise ChatTemplateError(
                f"the chat template failed on these messages or variables: {type(exc).__name__}: {exc}"
            ) from exc
        if not continue_final_message:
            return text
        tag = _CONTINUE_TAG.strip()
        if tag not in text:
            raise ChatTemplateError("continue_final_message: this chat template leaves the last message's text out")
        cut = text.rindex(tag)
        # A template that trims the content's trailing blank (and the tag's) keeps no trailing blank either.
        return text[:cut] if text[cut : cut + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:cut].rstrip()


# Appended to the content to be continued to find where it ends in the prompt (transformers' tag).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# The environment's own helpers, which a request's variables may not replace.
TEMPLATE_GLOBALS = frozenset(
    {"raise_exception", "strftime_now", "namespace", "range", "dict", "lipsum", "cycler", "joiner"}
)


def tool_call_format(template: str) -> str:
    """How the template tells the model to write a tool call: "hermes" for <tool_call> tags (Qwen 2.5
    and 3, Hermes 2 Pro and 3, SmolLM3), "llama3_json" for Llama 3.1+'s {"name", "parameters"} objects,
    "" for a template that writes none (or a format not parsed here)."""
    if "tools" not in template:
        return ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|start_header_id|>" in template and '"parameters": ' in template:
        return "llama3_json"
    return ""


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{index}] must be an object, not {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{index}].role is missing or not a string")
        if "content" not in message and "tool_calls" not in message:
            raise ChatTemplateError(f"messages[{index}].content is missing")
        content = message.get("content")
        # OpenAI allows null content on an assistant message that carries tool calls, and a list of parts.
        if not (isinstance(content, (str, list)) or (content is None and "tool_calls" in message)):
            raise ChatTemplateError(f"messages[{index}].content must be a string or a list of parts")
