"""A delta's work in the hub's step, and stop strings matched on its text.

Stop strings end a request once its output has min_tokens tokens (as vLLM checks them), so a
delta whose tokens straddle that point is fed to its matcher in two parts: the text before, which
may not end it, and the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.output.request_stream import RequestStream, StreamChunk
from gateway.output.stop_matcher import StopMatcher
from gateway.output.stop_search import StopSearch
from shardline.proto import common_pb2, sampling_pb2


@dataclass(slots=True)
class DeltaWork:
    """One request's delta in a hub step: its tokens new to the gateway, and where they go."""

    stream: RequestStream
    delta: common_pb2.RequestDelta
    new: list[int]  # the delta's tokens not seen before
    logprobs: list[sampling_pb2.TokenLogprob]
    offset: int  # output index of new[0]
    final: bool  # the delta ends the request
    prompt_logprobs: list[sampling_pb2.TokenLogprob] = field(default_factory=list)  # from the first delta


@dataclass(slots=True)
class Overshot:
    """A work of several tokens whose stop string matched: the token that completed it is searched for."""

    work: DeltaWork
    chunk: StreamChunk  # its last chunk, text already cut at the stop string
    held: str  # the text its stop matcher held back before it, which the matcher put in front
    search: StopSearch


def match_stops(w: DeltaWork, text: str, unarmed_text: str | None) -> tuple[str, int | None]:
    """Feeds a work's text to its stop matcher, armed from its min_tokens-th token on.

    Returns the text to send and, when a stop string matched, where it ends in `text`.
    """
    stop = w.stream.stop
    unarmed = unarmed_tokens(w)
    if unarmed == 0 or not w.new:
        return _ended(stop, *stop.feed(text, final=w.final, one_token=len(w.new) == 1), 0)
    if unarmed_text is None:  # every new token comes before min_tokens
        return _ended(stop, *stop.feed(text, final=w.final, armed=False), 0)
    if not text.startswith(unarmed_text):  # a decoder that respells its tail: check the whole text
        return _ended(stop, *stop.feed(text, final=w.final), 0)
    before, _ = stop.feed(unarmed_text, armed=False)
    after, end = _ended(stop, *stop.feed(text[len(unarmed_text) :], final=w.final), len(unarmed_text))
    return before + after, end


def _ended(stop: StopMatcher, text: str, stopped: bool, fed_from: int) -> tuple[str, int | None]:
    """(text, where the matched stop string ends in the work's text, or None): the matcher's end is in
    the piece it was fed, which began `fed_from` characters into the work's text."""
    return text, fed_from + stop.match_end if stopped else None


def unarmed_tokens(w: DeltaWork) -> int:
    """How many of a work's new tokens come before its request's min_tokens-th, where stop strings
    cannot end it yet (vLLM checks them once the output has min_tokens tokens)."""
    return min(max(0, w.stream.min_tokens - 1 - w.offset), len(w.new)) if w.stream.stop.holds_text else 0


def stopped_by_token(w: DeltaWork) -> bool:
    """The delta ends its request on one of its stop tokens: EOS or a stop token id (a complete
    structured output ends on EOS too)."""
    return (
        w.final
        and w.delta.finish_reason == sampling_pb2.FINISH_REASON_STOP
        and bool(w.new)
        and w.new[-1] in w.stream.stop_token_ids
    )
