"""OpenAI response bodies: whole completions, streamed chunks, logprobs and usage."""

from __future__ import annotations

import time
from typing import Any

from gateway.http_api.openai_echo import EchoedPrompt, vllm_prompt_logprobs
from gateway.output.collected_output import CollectedOutput
from gateway.output.request_stream import StreamChunk
from gateway.tools.tool_calls import ToolCallOutput
from gateway.tools.tool_params import ToolRequest
from shardline.proto import sampling_pb2


def usage_body(usage: sampling_pb2.Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }
    if usage.cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return body


class ResponseFormatter:
    """Builds the response bodies of one choice of a request; keeps what its stream needs between chunks.

    A request with several choices (n > 1, or a batch of prompts) has one formatter per choice, all
    with the request's id and `created`.
    """

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        include_usage: bool = False,
        index: int = 0,
        created: int | None = None,
        echo: EchoedPrompt | None = None,
        prompt_logprobs: bool = False,
        tools: ToolRequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.include_usage = include_usage
        self.index = index  # choices[].index
        self.created = int(time.time()) if created is None else created
        self.echo = echo  # completions' echo: the prompt goes first
        self.prompt_logprobs = prompt_logprobs  # answer vLLM's prompt_logprobs field
        self._text_offset = 0  # characters of the token texts so far, for completions' logprobs.text_offset
        self._sent_role = False
        self._echoed = False
        # Chat with tools: the output read as text and calls (one reader per choice, as it keeps state).
        self._tools = ToolCallOutput(tools) if tools is not None else None

    def whole(self, completion: CollectedOutput) -> dict[str, Any]:
        """The non-streamed response of a single-choice request."""
        return self.whole_of([self], [completion], completion.usage)

    def choice(self, completion: CollectedOutput) -> dict[str, Any]:
        """This choice in a non-streamed response."""
        prefix, echoed = self._echo(completion.prompt_logprobs, completion.logprobs, completion.token_texts)
        logprobs = _joined(echoed, self._logprobs(completion.logprobs, completion.token_texts, completion.token_bytes))
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": completion.text}
            finish_reason = completion.finish_reason
            if self._tools is not None:
                message, finish_reason = self._tools.message(completion.text, finish_reason)
            return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.echo is not None and self.echo.only:  # max_tokens 0: no completion, the limit ended it
            choice = {"index": self.index, "text": prefix, "logprobs": echoed, "finish_reason": "length"}
        else:
            choice = {
                "index": self.index,
                "text": prefix + completion.text,
                "logprobs": logprobs,
                "finish_reason": completion.finish_reason,
            }
        if self.prompt_logprobs:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(completion.prompt_logprobs, completion.token_texts)
        return choice

    @staticmethod
    def whole_of(
        formatters: list[ResponseFormatter], completions: list[CollectedOutput], usage: sampling_pb2.Usage | None
    ) -> dict[str, Any]:
        """The non-streamed response with every choice, in index order."""
        choices = [f.choice(c) for f, c in zip(formatters, completions)]
        body = {**formatters[0]._head(chunk=False), "choices": choices, "usage": usage_body(usage)}
        if formatters[0].chat and formatters[0].prompt_logprobs:  # vLLM: one conversation, at the top
            body["prompt_logprobs"] = vllm_prompt_logprobs(completions[0].prompt_logprobs, completions[0].token_texts)
        return body

    def events(self, chunk: StreamChunk) -> list[dict[str, Any]]:
        """The server-sent events for one chunk of a single-choice stream, the usage event included."""
        events = self.choice_events(chunk)
        if chunk.finish_reason and self.include_usage:
            events.append(self.usage_event(chunk.usage))
        return events

    def choice_events(self, chunk: StreamChunk) -> list[dict[str, Any]]:
        """This choice's events for one chunk; none for a chunk with nothing to tell."""
        events = []
        if self.chat and not self._sent_role:
            # OpenAI opens every chat stream with the role, before any content.
            self._sent_role = True
            events.append(self._chunk({"role": "assistant", "content": ""}, None, None))
        if self.echo is not None and not self._echoed:
            # vLLM sends the echoed prompt as the stream's first event; its logprobs come with the first token.
            self._echoed = True
            text, logprobs = self._echo(chunk.prompt_logprobs, chunk.logprobs, chunk.token_texts)
            events.append(self._chunk(text, logprobs, None))
        if self.echo is not None and self.echo.only:
            if chunk.finish_reason:
                events.append(self._chunk("", None, "length"))
            return events
        if self._tools is not None:
            return events + self._tool_events(chunk)
        if chunk.text or chunk.logprobs or chunk.finish_reason:
            logprobs = self._logprobs(chunk.logprobs, chunk.token_texts, chunk.token_bytes)
            body = {"content": chunk.text} if chunk.text else {}
            events.append(self._chunk(body if self.chat else chunk.text, logprobs, chunk.finish_reason))
        return events

    def _tool_events(self, chunk: StreamChunk) -> list[dict[str, Any]]:
        """A chat chunk's event when the output may hold tool calls: its text and call pieces, as
        far as they can be told apart yet."""
        assert self._tools is not None
        content, pieces = self._tools.feed(chunk.text, final=chunk.finish_reason is not None)
        delta: dict[str, Any] = {"content": content} if content else {}
        if pieces:
            delta["tool_calls"] = [piece.body() for piece in pieces]
        if not (delta or chunk.logprobs or chunk.finish_reason):
            return []
        logprobs = self._logprobs(chunk.logprobs, chunk.token_texts, chunk.token_bytes)
        return [self._chunk(delta, logprobs, self._tools.finish_reason(chunk.finish_reason))]

    def usage_event(self, usage: sampling_pb2.Usage | None) -> dict[str, Any]:
        """The stream's last event under stream_options.include_usage: no choices, the request's usage."""
        return {**self._head(chunk=True), "choices": [], "usage": usage_body(usage)}

    def _chunk(self, content: Any, logprobs: dict[str, Any] | None, finish_reason: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self.index, "logprobs": logprobs, "finish_reason": finish_reason}
        choice["delta" if self.chat else "text"] = content
        body = {**self._head(chunk=True), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return body

    def _head(self, chunk: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def _echo(
        self,
        prompt_logprobs: list[sampling_pb2.TokenLogprob],
        logprobs: list[sampling_pb2.TokenLogprob],
        texts: dict[int, str],
    ) -> tuple[str, dict[str, Any] | None]:
        """The echoed prompt's text, and its logprobs when the request asked for logprobs."""
        if self.echo is None:
            return "", None
        if not logprobs:  # prompt_logprobs alone answers in vLLM's own field, not in `logprobs`
            return self.echo.text, None
        # The prompt's first token has no logprob (nothing comes before it): null, as OpenAI sends it.
        first: dict[str, list[Any]] = {
            "tokens": [self.echo.first_token_text],
            "token_logprobs": [None],
            "top_logprobs": [None],
            "text_offset": [0],
        }
        rest, self._text_offset = _legacy_logprobs(prompt_logprobs, texts, len(self.echo.first_token_text))
        return self.echo.text, _joined(first, rest)

    def _logprobs(
        self, logprobs: list[sampling_pb2.TokenLogprob], texts: dict[int, str], raw: dict[int, bytes]
    ) -> dict[str, Any] | None:
        if not logprobs:
            return None
        if self.chat:
            return {
                "content": [
                    {
                        **_token_entry(lp.token_id, lp.logprob, texts, raw),
                        "top_logprobs": [_token_entry(alt.token_id, alt.logprob, texts, raw) for alt in lp.top],
                    }
                    for lp in logprobs
                ]
            }
        # Each token's offset in the completion's text, the same streamed or not.
        body, self._text_offset = _legacy_logprobs(logprobs, texts, self._text_offset)
        return body


def _legacy_logprobs(
    logprobs: list[sampling_pb2.TokenLogprob], texts: dict[int, str], offset: int
) -> tuple[dict[str, list[Any]], int]:
    """/v1/completions' logprobs object for these tokens, their text offsets counted from `offset`;
    and the offset after them."""
    offsets = []
    for lp in logprobs:
        offsets.append(offset)
        offset += len(texts[lp.token_id])
    return {
        "tokens": [texts[lp.token_id] for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        # The token itself is always among the alternatives, as OpenAI and vLLM send them
        # (so there are up to logprobs + 1 of them).
        "top_logprobs": [
            {**{texts[alt.token_id]: alt.logprob for alt in lp.top}, texts[lp.token_id]: lp.logprob} for lp in logprobs
        ],
        "text_offset": offsets,
    }, offset


def _joined(first: dict[str, list[Any]] | None, second: dict[str, list[Any]] | None) -> dict[str, list[Any]] | None:
    """Two legacy logprobs objects as one, list by list."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


def _token_entry(token_id: int, logprob: float, texts: dict[int, str], raw: dict[int, bytes]) -> dict[str, Any]:
    # OpenAI's `bytes` lets a client rebuild a character split over tokens: a token that ends
    # mid-character has the bytes it spells, not those of the U+FFFD its text shows.
    text = texts[token_id]
    return {"token": text, "logprob": logprob, "bytes": list(raw.get(token_id) or text.encode())}
