"""What the gateway keeps per streamed request, and the chunks its consumer receives."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from gateway.output.stop_strings import StopMatcher
from shardline.core.errors import (
    NO_WORKER,
    SLO_UNMET,
    STREAM_INTERRUPTED,
    DeadlineExceeded,
    InvalidArgument,
    ShardlineError,
    Unavailable,
)
from shardline.proto import common_pb2, sampling_pb2
from shardline.structured_output import DEAD_END

# The error of a stream the gateway could not detokenize because the tokenizer stayed unreachable:
# the request itself runs on, so the client gets UNAVAILABLE (retry or resume), not INTERNAL.
TOKENIZER_DOWN = "the tokenizer is unavailable"


@dataclass(slots=True)
class StreamChunk:
    """One piece of a request's output, as its consumer receives it."""

    text: str  # new text since the previous chunk, stop string and anything after it cut out
    token_ids: list[int]  # tokens generated since the previous chunk
    offset: int  # index in the request's output of token_ids[0]
    logprobs: list[sampling_pb2.TokenLogprob] = field(default_factory=list)  # per token, when asked for
    token_texts: dict[int, str] = field(default_factory=dict)  # text of each token named in logprobs
    # The bytes of those whose text is U+FFFD: a token that ends mid-character (logprobs' `bytes`).
    token_bytes: dict[int, bytes] = field(default_factory=dict)
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" on the last chunk only
    usage: sampling_pb2.Usage | None = None  # token accounting, on the last chunk only
    error: str = ""  # why the request failed, with finish_reason "error"; with "abort", that it timed out
    # On the first chunk with tokens, when the request asked for prompt logprobs: one per prompt token
    # after the first (their texts are in token_texts too).
    prompt_logprobs: list[sampling_pb2.TokenLogprob] = field(default_factory=list)

    def failure(self) -> ShardlineError | None:
        """The client's error for a last chunk that ends in failure, or at the request's deadline
        (the client gets an error, not a short answer)."""
        return failure_of(self.finish_reason, self.error)


def failure_of(finish_reason: str | None, error: str) -> ShardlineError | None:
    if finish_reason == "error" and error.startswith(DEAD_END):  # the client's own constraint is at fault
        return InvalidArgument("structured_output", error.removeprefix("structured_output: "))
    # Refused for a TTFT target it can no longer meet (the platform's answer to overload), or with no
    # worker of its model left: a 503, which the client may retry.
    if finish_reason == "error" and error.startswith((TOKENIZER_DOWN, STREAM_INTERRUPTED, SLO_UNMET, NO_WORKER)):
        return Unavailable(error)
    if finish_reason == "error":
        return ShardlineError(f"generation failed: {error}")
    if finish_reason == "abort" and error:
        return DeadlineExceeded(error)
    return None


@dataclass(slots=True)
class StreamTiming:
    """When a request's output arrived: its metrics and its detokenize span are made from this."""

    first_token_s: float | None = None  # perf_counter when its first generated token arrived
    last_token_s: float | None = None  # perf_counter when its latest token arrived
    detokenize_calls: int = 0  # batched Detokenize calls that carried its tokens
    detokenize_start_ns: int = 0  # wall clock at the start of the first of those calls
    detokenize_end_ns: int = 0  # wall clock at the end of the latest one

    def record(self, has_tokens: bool, now: float, start_ns: int, end_ns: int) -> None:
        """One batched Detokenize call that carried this request's output (tokens, or only its end)."""
        if has_tokens:
            self.first_token_s = self.first_token_s or now
            self.last_token_s = now
        if self.detokenize_calls == 0:
            self.detokenize_start_ns = start_ns
        self.detokenize_calls += 1
        self.detokenize_end_ns = end_ns


@dataclass(slots=True)
class RequestStream:
    """The output processor's state for one request whose output it streams."""

    request_id: str  # the request
    prompt_tokens: int  # prompt length, for the usage of a request finished by a stop string
    skip_special_tokens: bool  # the request's resolved setting
    stop: StopMatcher  # its stop strings and any text held back while they might match
    queue: asyncio.Queue[StreamChunk] = field(default_factory=asyncio.Queue)  # chunks for the consumer
    prefix: list[int] = field(default_factory=list)  # last tokens turned into text: detokenize context
    pending: list[int] = field(default_factory=list)  # tokens not yet turned into text (partial characters)
    next_offset: int = 0  # output index of the next token expected
    buffered: list[common_pb2.RequestDelta] | None = None  # deltas held while a Resume awaits the record
    finished: bool = False  # its last chunk has been queued
    timing: StreamTiming = field(default_factory=StreamTiming)
    cached_tokens: int = 0  # prompt tokens the worker found in its prefix cache, from the first delta
    min_tokens: int = 0  # stop strings end the request only once it has this many tokens (as in vLLM)
    # It asked for prompt logprobs, which only the first token's delta from its worker carries.
    wants_prompt_logprobs: bool = False
    # Tokens that end it (EOS, its stop_token_ids): the one it stops on is output, not text (as in vLLM).
    stop_token_ids: frozenset[int] = frozenset()

    def usage(self) -> sampling_pb2.Usage:
        """Its usage so far, for a request the gateway ends itself (a stop string, a lost consumer)."""
        return usage_of(self.prompt_tokens, self.next_offset, self.cached_tokens)


def stream_for(
    request_id: str,
    prompt_tokens: int,
    params: sampling_pb2.SamplingParameters,
    eos_token_ids: Iterable[int],
    buffered: list[common_pb2.RequestDelta] | None = None,
) -> RequestStream:
    """The stream of a request with resolved `params`; `buffered` holds its deltas back meanwhile."""
    return RequestStream(
        request_id,
        prompt_tokens,
        params.skip_special_tokens,
        StopMatcher(list(params.stop)),
        buffered=buffered,
        min_tokens=params.min_tokens,
        wants_prompt_logprobs=params.HasField("prompt_logprobs"),
        stop_token_ids=frozenset(eos_token_ids) | frozenset(params.stop_token_ids),
    )


def record_stream(info: common_pb2.RequestInfo, eos_token_ids: Iterable[int]) -> RequestStream:
    """The stream of a request submitted before (by this gateway or another), holding its deltas back
    until its record is applied."""
    return stream_for(info.request_id, info.usage.prompt_tokens, info.params, eos_token_ids, buffered=[])


async def drain(stream: RequestStream) -> AsyncIterator[StreamChunk]:
    """The stream's chunks as they come, up to and including the last one."""
    while True:
        chunk = await stream.queue.get()
        yield chunk
        if chunk.finish_reason is not None:
            return


def tail(ids: list[int], size: int) -> list[int]:
    """The last `size` ids: a detokenize context."""
    return ids[max(0, len(ids) - size) :]


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> sampling_pb2.Usage:
    """OpenAI-style token accounting."""
    return sampling_pb2.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        cached_tokens=cached_tokens,
    )
