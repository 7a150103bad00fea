"""The output processor: each engine step's deltas turned into every request's chunks, in one pass.

The scheduler sends ONE TokenBatch per worker step with the deltas of this gateway's requests. The
processor cuts from each what its stream has had already, then turns every request's new tokens
into text with ONE batched detokenize call (local_detokenizer.py), keeping each request's detokenize
context (prefix) and unconsumed tokens (pending) itself, since that call is stateless. The same call
carries the text of every token the step's logprobs name, and, for a delta that crosses its
request's min_tokens, the text of its tokens before that point. Then it matches stop strings
(stop_strings.py) and hands each request's consumer a StreamChunk, the last one with its
finish_reason and usage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.output.local_detokenizer import LocalDetokenizer
from gateway.output.request_stream import TOKENIZER_DOWN, RequestStream, StreamChunk, tail
from gateway.output.stop_strings import StopSearch, find_stop_tokens
from gateway.upstream.backends import Backends
from shardline.core.errors import FailedPrecondition, ShardlineError, Unavailable
from shardline.proto import common_pb2, sampling_pb2, tokenizer_pb2

logger = logging.getLogger(__name__)

FINISH_REASONS = {
    sampling_pb2.FINISH_REASON_STOP: "stop",
    sampling_pb2.FINISH_REASON_LENGTH: "length",
    sampling_pb2.FINISH_REASON_ABORT: "abort",
    sampling_pb2.FINISH_REASON_ERROR: "error",
}


@dataclass(slots=True)
class DeltaWork:
    """One request's delta in a step: its tokens new to the gateway, and where they go."""

    stream: RequestStream
    delta: common_pb2.RequestDelta
    new: list[int]  # the delta's tokens not seen before
    logprobs: list[sampling_pb2.TokenLogprob]
    offset: int  # output index of new[0]
    final: bool  # the delta ends the request
    prompt_logprobs: list[sampling_pb2.TokenLogprob] = field(default_factory=list)  # from the first delta

    @property
    def stopped_by_token(self) -> bool:
        """The delta ends its request on one of its stop tokens: EOS or a stop token id (a complete
        structured output ends on EOS too)."""
        return (
            self.final
            and self.delta.finish_reason == sampling_pb2.FINISH_REASON_STOP
            and bool(self.new)
            and self.new[-1] in self.stream.stop_token_ids
        )

    @property
    def spoken(self) -> list[int]:
        """The new tokens that are text. The token that stopped a request (EOS, a stop token id) is
        output but not text, as in vLLM: it would show with skip_special_tokens off, or when it is an
        ordinary token."""
        return self.new[:-1] if self.stopped_by_token else self.new

    @property
    def unarmed(self) -> int:
        """How many of the new tokens come before the request's min_tokens-th, where stop strings
        cannot end it yet (vLLM checks them once the output has min_tokens tokens)."""
        stream = self.stream
        return min(max(0, stream.min_tokens - 1 - self.offset), len(self.new)) if stream.stop.holds_text else 0


@dataclass(slots=True)
class Overshot:
    """A work of several tokens whose stop string matched: the token that completed it is searched for."""

    work: DeltaWork
    chunk: StreamChunk  # its last chunk, text already cut at the stop string
    held: str  # the text its stop matcher held back before it, which the matcher put in front
    search: StopSearch


@dataclass(slots=True)
class StepCall:
    """A step's one Detokenize request: each work's text item in work order, then one item per token
    id the logprobs name, then, for each work that crosses min_tokens, the text of its tokens before."""

    request: tokenizer_pb2.DetokenizeRequest
    named: list[int]  # the token ids whose text the logprobs need, in the order of their items
    splits: dict[int, int]  # work index -> the index of its item before min_tokens

    @staticmethod
    def of(work: list[DeltaWork]) -> StepCall:
        items = [_item(w, w.spoken, final=w.final) for w in work]
        # Logprobs name tokens by id; their texts ride in the same call, one final item per distinct id.
        named = sorted({t for w in work for t in named_tokens(w.logprobs, w.prompt_logprobs)})
        items += [tokenizer_pb2.DetokenizeItem(new_token_ids=[t], final=True, raw_bytes=True) for t in named]
        # A delta that crosses min_tokens also gets the text of its tokens before it, which stop
        # strings must not end the request in (vLLM checks them token by token).
        crossing = [i for i, w in enumerate(work) if 0 < w.unarmed < len(w.new)]
        splits = {i: len(items) + n for n, i in enumerate(crossing)}
        items += [_item(work[i], work[i].new[: work[i].unarmed], final=False) for i in crossing]
        return StepCall(tokenizer_pb2.DetokenizeRequest(items=items), named, splits)

    def token_texts(
        self, reply: tokenizer_pb2.DetokenizeResponse, works: int
    ) -> tuple[dict[int, str], dict[int, bytes]]:
        """The text of each named token, and the bytes of those that end mid-character, whose text
        is U+FFFD (logprobs give their bytes)."""
        results = reply.results[works : works + len(self.named)]
        texts = {t: result.text for t, result in zip(self.named, results)}
        broken = {t: result.raw_bytes for t, result in zip(self.named, results) if "\ufffd" in result.text}
        return texts, broken


def _item(w: DeltaWork, tokens: list[int], final: bool) -> tokenizer_pb2.DetokenizeItem:
    """The detokenize item of `tokens`, new tokens of `w`, in its stream's context."""
    return tokenizer_pb2.DetokenizeItem(
        prefix_token_ids=w.stream.prefix,
        new_token_ids=w.stream.pending + tokens,
        final=final,
        skip_special_tokens=w.stream.skip_special_tokens,
    )


class OutputProcessor:
    """The streams of this gateway's live requests, and the step by step making of their chunks."""

    def __init__(self, backends: Backends, local_detokenize: bool, cancel: Callable[[str], None]) -> None:
        self.detokenizer = LocalDetokenizer(backends, local_detokenize)
        self._tokenizer = backends.tokenizer  # the stop search's Detokenize calls
        self._cancel = cancel  # ends upstream a request the gateway ended itself (a stop string, a failure)
        self._streams: dict[str, RequestStream] = {}

    def add(self, stream: RequestStream) -> None:
        """Start making `stream.request_id`'s chunks."""
        if stream.request_id in self._streams:
            raise FailedPrecondition("request_id", f"{stream.request_id} is already streaming from this gateway")
        self._streams[stream.request_id] = stream

    def remove(self, request_id: str) -> RequestStream | None:
        """Stop making the request's chunks; its stream, if it had one."""
        return self._streams.pop(request_id, None)

    def get(self, request_id: str) -> RequestStream | None:
        return self._streams.get(request_id)

    def followed(self) -> list[str]:
        """The requests whose deltas are taken as they come (not held back for a record)."""
        return [request_id for request_id, stream in self._streams.items() if stream.buffered is None]

    async def process(self, deltas: list[common_pb2.RequestDelta]) -> None:
        """One step's deltas (or a record's), into their requests' chunks."""
        work = self._cut(deltas)
        if work:
            await self._emit(work)

    def _cut(self, deltas: list[common_pb2.RequestDelta]) -> list[DeltaWork]:
        """Each request's tokens new to its stream. One request can appear more than once (a resumed
        record, then the deltas held meanwhile, which may overlap it): each delta is cut against the
        tokens taken so far in this step."""
        work: dict[str, DeltaWork] = {}
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None or stream.finished:
                continue  # cancelled, or owned by a gateway this one replaced
            if stream.buffered is not None:
                stream.buffered.append(delta)
                continue
            merged = work.get(delta.request_id)
            if merged is not None and merged.final:
                continue
            expected = merged.offset + len(merged.new) if merged is not None else stream.next_offset
            skip = max(0, expected - delta.offset)
            if delta.offset > expected:
                logger.warning("%s: tokens %d..%d were lost", delta.request_id, expected, delta.offset)
            final = delta.finish_reason != sampling_pb2.FINISH_REASON_UNSPECIFIED
            new, logprobs = list(delta.token_ids[skip:]), list(delta.logprobs[skip:])
            # Only the first token's delta has them; a repeat of it (skip) has been passed on already.
            first = delta.offset == 0 and not skip and bool(delta.token_ids)
            prompt_logprobs = list(delta.prompt_logprobs) if first else []
            if first and stream.wants_prompt_logprobs and len(prompt_logprobs) != stream.prompt_tokens - 1:
                self._lost_prompt_logprobs(stream)
                continue
            if merged is not None:
                merged.new += new
                merged.logprobs += logprobs
                merged.prompt_logprobs += prompt_logprobs
                merged.final, merged.delta = final, delta if final else merged.delta
            elif new or final:
                work[delta.request_id] = DeltaWork(
                    stream, delta, new, logprobs, delta.offset + skip, final, prompt_logprobs
                )
        return list(work.values())

    def _lost_prompt_logprobs(self, stream: RequestStream) -> None:
        # Its first token came from a Redis record without them (one written by a scheduler that did
        # not keep them): an error the client can retry, not a short answer.
        error = "its prompt logprobs were lost in a reconnection to the scheduler; send it again"
        self._finish(stream, StreamChunk("", [], 0, error=error), "error", cancel=True)

    async def _emit(self, work: list[DeltaWork]) -> None:
        """The step's one detokenize call, then each request's chunk."""
        call = StepCall.of(work)
        start_ns = time.time_ns()
        try:
            tokenizer, reply = await self.detokenizer.detokenize(call.request)
        except ShardlineError as exc:
            self._fail(work, exc)
            return
        end_ns, now = time.time_ns(), time.perf_counter()
        texts, broken = call.token_texts(reply, len(work))
        specials = frozenset(tokenizer.special_token_ids)
        overshot: list[Overshot] = []
        for i, (w, result) in enumerate(zip(work, reply.results)):
            _advance(w, result, specials, tokenizer.detokenize_prefix_window)
            w.stream.timing.record(bool(w.new), now, start_ns, end_ns)
            held = w.stream.stop.held
            unarmed_text = reply.results[call.splits[i]].text if i in call.splits else None
            text, end = w.stream.stop.match(result.text, w.final, len(w.new), w.unarmed, unarmed_text)
            chunk = StreamChunk(text, w.new, w.offset, w.logprobs, prompt_logprobs=w.prompt_logprobs)
            if w.logprobs or w.prompt_logprobs:
                chunk.token_texts = {t: texts[t] for t in named_tokens(w.logprobs, w.prompt_logprobs)}
                chunk.token_bytes = {t: broken[t] for t in chunk.token_texts if t in broken}
            if end is not None and len(w.new) > 1:  # which of its tokens completed the stop string?
                spoken = len(w.spoken)
                search = StopSearch(
                    call.request.items[i], spoken, result.text, end, lo=w.unarmed + 1, hi=spoken, hi_text=result.text
                )
                overshot.append(Overshot(w, chunk, held, search))
            else:
                self._deliver(w, chunk, stopped=end is not None)
        if overshot:
            await self._cut_after_stops(overshot)

    def _fail(self, work: list[DeltaWork], exc: ShardlineError) -> None:
        logger.error("detokenize failed for %d requests: %s", len(work), exc)
        for w in work:
            # The tokenizer is still down: this gateway cannot turn the tokens into text, but the
            # requests run on and are recorded, so each client may Resume from its offset then.
            # Any other failure is this gateway's: the request is ended upstream too.
            down = isinstance(exc, Unavailable)
            error = (
                f"{TOKENIZER_DOWN}: the request runs on; resume it at offset {w.offset}"
                if down
                else f"detokenize failed: {exc}"
            )
            self._finish(
                w.stream, StreamChunk("", w.new, w.offset, error=error), "error", cancel=not w.final and not down
            )

    def _deliver(self, w: DeltaWork, chunk: StreamChunk, stopped: bool) -> None:
        """A chunk to its consumer: the last one when a stop string or the delta ends the request."""
        if stopped:
            self._finish(w.stream, chunk, "stop", cancel=not w.final)
        elif w.final:
            reason = FINISH_REASONS.get(w.delta.finish_reason, "error")
            chunk.error = w.delta.error if reason == "error" else ""
            usage = w.delta.usage if w.delta.HasField("usage") else None
            self._finish(w.stream, chunk, reason, cancel=False, usage=usage)
        else:
            w.stream.queue.put_nowait(chunk)

    async def _cut_after_stops(self, overshot: list[Overshot]) -> None:
        """Ends requests whose stop string completed inside a delta of several tokens, keeping the
        tokens through the one that completed it (vLLM checks stop strings token by token, so its
        output, logprobs and usage end there). If the search fails, every token is kept, as before
        it; the requests end either way."""
        try:
            await find_stop_tokens(self._tokenizer, [o.search for o in overshot])
            for o in overshot:
                # Of the stop strings that token completes, the first in the list wins, as in vLLM (all
                # the delta's tokens before it complete none). Not when min_tokens fell inside the
                # delta: stop strings in its text before then must not count.
                if o.work.unarmed == 0:
                    shown = o.held + o.search.hi_text
                    start = o.work.stream.stop.first_listed(shown)
                    o.chunk.text = shown[:start] if start is not None else o.chunk.text
        except Exception as exc:  # the chunks must go out whatever went wrong here
            logger.warning("could not find the tokens before %d stop strings: %r", len(overshot), exc)
        for o in overshot:
            w, chunk, keep = o.work, o.chunk, o.search.hi
            chunk.token_ids, chunk.logprobs = w.new[:keep], w.logprobs[:keep]
            chunk.token_texts = {t: chunk.token_texts[t] for t in named_tokens(chunk.logprobs, chunk.prompt_logprobs)}
            chunk.token_bytes = {t: b for t, b in chunk.token_bytes.items() if t in chunk.token_texts}
            w.stream.next_offset = w.offset + keep  # its usage counts the kept tokens
            self._finish(w.stream, chunk, "stop", cancel=not w.final)

    def _finish(
        self,
        stream: RequestStream,
        chunk: StreamChunk,
        reason: str,
        cancel: bool,
        usage: sampling_pb2.Usage | None = None,
    ) -> None:
        # `cancel`: the gateway ends a request the scheduler still runs (a stop string, a failure here).
        chunk.finish_reason = reason
        chunk.usage = usage or stream.usage()
        stream.finished = True
        self._streams.pop(stream.request_id, None)
        stream.queue.put_nowait(chunk)
        if cancel:
            self._cancel(stream.request_id)


def _advance(w: DeltaWork, result: tokenizer_pb2.DetokenizeResult, specials: frozenset[int], window: int) -> None:
    """The stream's detokenize state after its step: the tokens the text consumed join its context,
    the rest (a character not yet finished) wait for the next step."""
    stream = w.stream
    sent = stream.pending + w.spoken
    consumed = sent[: result.num_consumed]
    stream.pending = sent[result.num_consumed :]
    if stream.skip_special_tokens:
        consumed = [t for t in consumed if t not in specials]
    stream.prefix = tail(stream.prefix + consumed, window)
    stream.next_offset = w.offset + len(w.new)
    if w.delta.HasField("usage"):  # the first delta's says what the prefix cache served
        stream.cached_tokens = w.delta.usage.cached_tokens


def named_tokens(*logprob_lists: list[sampling_pb2.TokenLogprob]) -> list[int]:
    """Every token id the logprobs name: each token and its alternatives."""
    return [
        t for logprobs in logprob_lists for lp in logprobs for t in (lp.token_id, *(alt.token_id for alt in lp.top))
    ]
