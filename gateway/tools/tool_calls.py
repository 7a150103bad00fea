"""A chat output taken apart into text and tool calls, piece by piece as it streams.

Each tool_choice has its reader (see gateway/tools/tool_params.py for what the model writes under each);
a reader is fed the output text as it arrives and says what it holds: text for `content`, and
pieces of calls (a call's id and name first, then its arguments in fragments). A whole response
feeds the whole text to the same reader, so a streamed answer adds up to the unstreamed one.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from gateway.tools.tool_params import ToolRequest


@dataclass(slots=True)
class CallPiece:
    """Part of one tool call: its header (id and name) when it starts, then arguments text."""

    index: int  # which call of the turn
    arguments: str = ""
    id: str | None = None  # on the call's first piece only
    name: str | None = None  # on the call's first piece only

    def body(self) -> dict[str, Any]:
        """The piece as an entry of a streamed delta's `tool_calls`."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _call_id() -> str:
    return f"call_{secrets.token_hex(12)}"  # OpenAI's ids are call_ and 24 characters


class _NamedReader:
    """tool_choice names a function: the whole output is its arguments."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        if not self._started:
            self._started = True
            return "", [CallPiece(0, text, _call_id(), self._name)]
        return "", [CallPiece(0, text)] if text else []

    def finish(self) -> tuple[str, list[CallPiece]]:
        return self.feed("")  # a call, even with empty arguments, when no text came at all


# The start of one call in "required" output, up to its parameters: {"name": "f", "parameters":
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*$')


class _RequiredReader:
    """tool_choice "required": the output is a JSON array [{"name": ..., "parameters": {...}}, ...],
    its keys in that order (the constraint's schema puts them so). The arguments are the raw text of
    each "parameters" value, so they stream as the model writes them."""

    def __init__(self) -> None:
        self._mode = "between"  # between calls, in a call's head, in its arguments, or after them
        self._head = ""
        self._index = -1
        self._depth = 0  # brackets open inside the arguments
        self._in_string = False
        self._escaped = False
        self._started = False  # the arguments value has begun
        self._text = ""  # what came before the first call, for an output cut short there

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        if self._index < 0:
            self._text += text
        pieces: list[CallPiece] = []
        arguments: list[str] = []
        for char in text:
            if self._mode == "between":
                if char == "{":
                    self._mode, self._head = "head", char
            elif self._mode == "head":
                self._head += char
                if char == ":" and (match := _CALL_HEAD.match(self._head)):
                    self._index += 1
                    pieces.append(CallPiece(self._index, "", _call_id(), json.loads(match.group(1))))
                    self._mode, self._depth, self._in_string, self._started = "arguments", 0, False, False
            elif self._mode == "arguments":
                if self._argument_char(char):
                    arguments.append(char)
                if self._mode != "arguments" and arguments:
                    pieces.append(CallPiece(self._index, "".join(arguments)))
                    arguments = []
            elif char == "}":  # "after": the call's object closes
                self._mode = "between"
        if arguments:
            pieces.append(CallPiece(self._index, "".join(arguments)))
        return "", pieces

    def _argument_char(self, char: str) -> bool:
        """Whether `char` belongs to the arguments; moves to "after" where they end."""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                if self._depth == 0:
                    self._mode = "after"
            return True
        if self._depth == 0 and (char in ",}" and self._started):
            self._mode = "after" if char == "," else "between"  # a bare scalar ended (a schema of {})
            return False
        if char.isspace() and not self._started:
            return False
        self._started = True
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._mode = "after"
        return True

    def finish(self) -> tuple[str, list[CallPiece]]:
        # Cut short (max_tokens) before any call began: the client sees what the model wrote.
        return (self._text if self._index < 0 else ""), []


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


class _HermesReader:
    """tool_choice "auto" with Hermes-style templates: text, and calls written as
    <tool_call>{"name": ..., "arguments": {...}}</tool_call>. A call is passed on once its closing tag
    arrives (or a later one, when the first was inside an argument's text); a block that is not a
    call's JSON is passed on as text, as written. Blank text after a call is the template's layout."""

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self._index = -1
        self._after_call = False  # blank text from here on is dropped

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        self._buffer += text
        return self._read(final=False)

    def finish(self) -> tuple[str, list[CallPiece]]:
        return self._read(final=True)

    def _read(self, final: bool) -> tuple[str, list[CallPiece]]:
        content: list[str] = []
        pieces: list[CallPiece] = []
        while True:
            if self._in_call:
                block = self._call_block(final)
                if block is None:
                    break
                text, call = block
                self._in_call = False
                if call is None:
                    content.append(self._content(_OPEN + text + _CLOSE))
                else:
                    self._index += 1
                    self._after_call = True
                    pieces.append(CallPiece(self._index, call[1], _call_id(), call[0]))
                continue
            start = self._buffer.find(_OPEN)
            if start < 0:
                # Hold back an end that may be the start of a tag still arriving.
                keep = 0 if final else _partial_tag(self._buffer)
                content.append(self._content(self._buffer[: len(self._buffer) - keep]))
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            content.append(self._content(self._buffer[:start]))
            self._buffer, self._in_call = self._buffer[start + len(_OPEN) :], True
        if final and self._in_call:  # an unclosed call is text, as written
            content.append(self._content(_OPEN + self._buffer))
            self._buffer, self._in_call = "", False
        return "".join(content), pieces

    def _call_block(self, final: bool) -> tuple[str, tuple[str, str] | None] | None:
        """The open call's text and what it calls, taken off the buffer; None while it may still grow.

        A block that does not parse may have been cut by a closing tag inside an argument's text: the
        text up to each later closing tag is tried too, until the output ends."""
        end = self._buffer.find(_CLOSE)
        first = end
        while end >= 0:
            call = _hermes_call(self._buffer[:end])
            if call is not None:
                break
            end = self._buffer.find(_CLOSE, end + len(_CLOSE))
        if end < 0:
            if first < 0 or not final:
                return None
            end, call = first, None  # nothing parsed up to any tag: the first block is text
        text, self._buffer = self._buffer[:end], self._buffer[end + len(_CLOSE) :]
        return text, call

    def _content(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text


def _partial_tag(text: str) -> int:
    """The length of the longest end of `text` that begins the opening tag."""
    for length in range(min(len(text), len(_OPEN) - 1), 0, -1):
        if _OPEN.startswith(text[-length:]):
            return length
    return 0


def _hermes_call(block: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one <tool_call> block, or None when it is no call."""
    try:
        return _call_of(json.loads(block))
    except (ValueError, RecursionError):
        return None


def _call_of(call: Any) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a decoded {"name", "arguments" or "parameters"} object."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


class _Llama3JsonReader:
    """tool_choice "auto" with Llama 3.1+ templates: the reply is text, or calls written as JSON
    objects {"name": ..., "parameters": {...}}, separated by ";" when there are several (after a
    <|python_tag|>, a special token that does not reach the text). A reply that opens with "{" is
    read as calls, each passed on once it is whole; text that is not a call is passed on as written."""

    def __init__(self) -> None:
        self._buffer = ""
        self._mode = "start"  # until the first non-blank character tells text from calls
        self._index = -1

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        self._buffer += text
        if self._mode == "start":
            stripped = self._buffer.lstrip()
            if not stripped:
                return "", []
            self._mode = "calls" if stripped.startswith("{") else "text"
        elif self._mode == "calls" and "}" not in text:
            return "", []  # a call's object can only end at a "}": no need to parse the buffer again
        if self._mode == "text":
            text, self._buffer = self._buffer, ""
            return text, []
        pieces: list[CallPiece] = []
        while True:
            start = len(self._buffer) - len(self._buffer.lstrip().lstrip(";").lstrip())
            try:
                call, end = _DECODER.raw_decode(self._buffer, start)
            except ValueError:
                break  # not whole yet (or not JSON: told at the end)
            parsed = _call_of(call)
            if parsed is None:
                break
            self._index += 1
            pieces.append(CallPiece(self._index, parsed[1], _call_id(), parsed[0]))
            self._buffer = self._buffer[end:]
        return "", pieces

    def finish(self) -> tuple[str, list[CallPiece]]:
        rest, self._buffer = self._buffer, ""
        if self._index >= 0 and not rest.strip(" \t\n;"):
            return "", []
        return rest, []  # what is not a call is text, as written


_DECODER = json.JSONDecoder()


_AUTO_READERS: dict[str, type[_HermesReader] | type[_Llama3JsonReader]] = {
    "hermes": _HermesReader,
    "llama3_json": _Llama3JsonReader,
}
_Reader = _NamedReader | _RequiredReader | _HermesReader | _Llama3JsonReader


class ToolCallOutput:
    """One choice's output read as text and tool calls, according to its tool_choice."""

    def __init__(self, request: ToolRequest) -> None:
        self.request = request
        self._reader: _Reader | None
        if request.choice == "named":
            self._reader = _NamedReader(request.name)
        elif request.choice == "required":
            self._reader = _RequiredReader()
        elif request.choice == "auto":
            self._reader = _AUTO_READERS[request.parser]()  # resolve_parser has set one
        else:
            self._reader = None
        self.called = False  # some call has started

    def feed(self, text: str, final: bool) -> tuple[str, list[CallPiece]]:
        """The text for `content` and the call pieces in the next `text`; `final` flushes."""
        if self._reader is None:
            return text, []
        content, pieces = self._reader.feed(text)
        if final:
            more_content, more_pieces = self._reader.finish()
            content, pieces = content + more_content, pieces + more_pieces
        if not self.request.parallel:  # "required" is held to one call by its schema; "auto" here
            pieces = [piece for piece in pieces if piece.index == 0]
        self.called = self.called or bool(pieces)
        return content, pieces

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" when the model chose to call (not under a named tool_choice, which is
        the caller's choice: OpenAI answers "stop" there)."""
        if reason == "stop" and self.called and self.request.choice in ("required", "auto"):
            return "tool_calls"
        return reason

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole response's assistant message for `text`, and the finish reason."""
        content, pieces = self.feed(text, final=True)
        calls: list[dict[str, Any]] = []
        for piece in pieces:
            if piece.id is not None:  # a whole response's calls have no index: only stream deltas do
                calls.append(
                    {"id": piece.id, "type": "function", "function": {"name": piece.name, "arguments": piece.arguments}}
                )
            else:
                calls[piece.index]["function"]["arguments"] += piece.arguments
        # OpenAI's content is null beside calls when the model said nothing else.
        message: dict[str, Any] = {"role": "assistant", "content": None if calls and not content else content}
        if calls:
            message["tool_calls"] = calls
        return message, self.finish_reason(finish_reason)
