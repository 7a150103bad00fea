"""The gateway's one Subscribe stream: every request's output, detokenized in one call per engine step.

The scheduler sends ONE TokenBatch per worker step with the deltas of this gateway's requests. The
hub turns all of them into text with ONE batched detokenize call, in-process with the tokenizer's
definition (local_detokenizer.py) or else through Tokenizer.Detokenize, keeping each request's
detokenize context (prefix) and unconsumed tokens (pending) itself, since that call is stateless.
It then matches stop strings and hands each request's consumer a StreamChunk.

If the scheduler restarts or drops a slow subscriber, the hub reconnects with backoff and catches up
every live request from its persisted record (Scheduler.GetRequest); offsets make duplicates harmless.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

import grpc

from gateway.output.delta_stops import DeltaWork, Overshot, match_stops, stopped_by_token, unarmed_tokens
from gateway.output.local_detokenizer import LocalDetokenizer
from gateway.output.record_delta import record_delta
from gateway.output.request_stream import TOKENIZER_DOWN, RequestStream, StreamChunk
from gateway.output.resume_state import restore_held_back, tail
from gateway.output.stop_search import StopSearch, find_stop_tokens
from gateway.upstream.backends import RPC_TIMEOUT_S, Backends
from shardline.core.errors import FailedPrecondition, ShardlineError, Unavailable
from shardline.proto import common_pb2, sampling_pb2, scheduler_pb2, tokenizer_pb2

logger = logging.getLogger(__name__)

FINISH_REASONS = {
    sampling_pb2.FINISH_REASON_STOP: "stop",
    sampling_pb2.FINISH_REASON_LENGTH: "length",
    sampling_pb2.FINISH_REASON_ABORT: "abort",
    sampling_pb2.FINISH_REASON_ERROR: "error",
}
_FIRST_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 2.0


class StreamHub:
    """Consumes this gateway's Subscribe stream and feeds each live request's queue."""

    def __init__(self, gateway_id: str, backends: Backends, local_detokenize: bool = True) -> None:
        self._gateway_id = gateway_id
        self._backends = backends
        self.detokenizer = LocalDetokenizer(backends, local_detokenize)
        self._streams: dict[str, RequestStream] = {}
        # One batch (or one Resume record) at a time: each changes the prefix and pending of its requests.
        self._lock = asyncio.Lock()
        self._connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._unsent_cancels: set[str] = set()  # cancels the scheduler could not take, sent again on resubscribe

    def start(self) -> None:
        self._task = asyncio.create_task(self._subscribe_forever(), name="stream-hub")

    async def stop(self) -> None:
        tasks = [task for task in (self._task, *self._background) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    async def wait_connected(self, timeout_s: float) -> bool:
        """Whether the subscription is (or becomes, within `timeout_s`) open."""
        try:
            await asyncio.wait_for(self._connected.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def register(self, stream: RequestStream) -> None:
        """Start routing `stream.request_id`'s deltas to `stream.queue`; call before Submit or Attach."""
        if stream.request_id in self._streams:
            raise FailedPrecondition("request_id", f"{stream.request_id} is already streaming from this gateway")
        self._streams[stream.request_id] = stream

    def release(self, request_id: str, cancel: bool = True, grace_s: float = 0.0) -> None:
        """The consumer is gone: stop routing, and cancel the request upstream if it is still running.

        With `grace_s`, the cancel waits that long and is dropped if a client resumed the request on
        this gateway meanwhile (one that resumed it on another gateway owns it: the scheduler ignores
        this gateway's cancel then).
        """
        stream = self._streams.pop(request_id, None)
        if stream is None or stream.finished or not cancel:
            return
        if grace_s > 0:
            self._spawn(self._cancel_unless_resumed(request_id, grace_s))
        else:
            self._cancel_upstream(request_id)

    async def _cancel_unless_resumed(self, request_id: str, grace_s: float) -> None:
        await asyncio.sleep(grace_s)
        if request_id not in self._streams:
            await self._cancel(request_id)

    async def apply_record(self, request_id: str, info: common_pb2.RequestInfo, offset: int) -> RequestStream:
        """Start a registered, resumed stream at output `offset` from the request's record, then let
        the deltas held meanwhile in."""
        async with self._lock:
            stream = self._streams[request_id]
            await restore_held_back(self._backends, stream, info, offset)
            stream.next_offset = offset
            deltas = [record_delta(info, offset), *(stream.buffered or ())]
            stream.buffered = None
            await self._handle(deltas)
            return stream

    async def _subscribe_forever(self) -> None:
        backoff = _FIRST_BACKOFF_S
        request = scheduler_pb2.SubscribeRequest(gateway_id=self._gateway_id)
        while True:
            await self._backends.scheduler_ready()
            call = self._backends.scheduler.Subscribe(request)
            try:
                # The scheduler sends its initial metadata once the subscription is registered: a Submit
                # (or a catch-up read) before that could have its deltas relayed to nobody.
                await call.initial_metadata()
                self._connected.set()
                logger.info("subscribed to the scheduler as %s", self._gateway_id)
                backoff = _FIRST_BACKOFF_S
                await self._catch_up()
                async for batch in call:
                    async with self._lock:
                        await self._handle(batch.deltas)
                logger.warning("the scheduler closed the subscription; reconnecting")
            except grpc.aio.AioRpcError as exc:
                logger.warning("subscription lost (%s: %s); reconnecting", exc.code().name, exc.details())
            except Exception:
                # A bug must not end the only stream every request depends on: log it, resubscribe, catch up.
                logger.exception("stream hub failed; resubscribing")
            finally:
                self._connected.clear()
                call.cancel()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF_S)

    async def _catch_up(self) -> None:
        for request_id in list(self._unsent_cancels):
            self._cancel_upstream(request_id)
        # Tokens persisted while the stream was down never reach it: read them from the records.
        ids = [rid for rid, stream in self._streams.items() if stream.buffered is None]
        records = await asyncio.gather(*(self._record(rid) for rid in ids), return_exceptions=True)
        deltas = []
        for rid, record in zip(ids, records):
            stream = self._streams.get(rid)
            if stream is None or isinstance(record, BaseException):
                continue
            if record is None:
                deltas.append(
                    common_pb2.RequestDelta(
                        request_id=rid,
                        offset=stream.next_offset,
                        finish_reason=sampling_pb2.FINISH_REASON_ERROR,
                        error="the scheduler has no record of this request any more",
                    )
                )
            else:
                deltas.append(record_delta(record, stream.next_offset))
        async with self._lock:
            await self._handle(deltas)

    async def _record(self, request_id: str) -> common_pb2.RequestInfo | None:
        try:
            return await self._backends.scheduler.GetRequest(
                common_pb2.GetRequestRequest(request_id=request_id), timeout=RPC_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    async def _handle(self, deltas: list[common_pb2.RequestDelta]) -> None:
        # One request can appear more than once (a resumed record, then the deltas held meanwhile,
        # which may overlap it): each delta is cut against the tokens taken so far in this call.
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
                # Its first token came from a Redis record without them (one written by a scheduler
                # that did not keep them): an error the client can retry, not a short answer.
                self._finish(
                    stream,
                    StreamChunk(
                        "",
                        [],
                        0,
                        error="its prompt logprobs were lost in a reconnection to the scheduler; send it again",
                    ),
                    "error",
                    cancel=True,
                )
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
        if work:
            await self._detokenize(list(work.values()))

    async def _detokenize(self, work: list[DeltaWork]) -> None:
        # The token that stopped a request (EOS, a stop token id) is output but not text, as in vLLM:
        # it would show with skip_special_tokens off, or when it is an ordinary token.
        spoken = [w.new[:-1] if stopped_by_token(w) else w.new for w in work]
        items = [
            tokenizer_pb2.DetokenizeItem(
                prefix_token_ids=w.stream.prefix,
                new_token_ids=w.stream.pending + new,
                final=w.final,
                skip_special_tokens=w.stream.skip_special_tokens,
            )
            for w, new in zip(work, spoken)
        ]
        # Logprobs name tokens by id; their texts ride in the same call, one final item per distinct id.
        named = sorted({t for w in work for t in _named_tokens(w.logprobs, w.prompt_logprobs)})
        items += [tokenizer_pb2.DetokenizeItem(new_token_ids=[t], final=True, raw_bytes=True) for t in named]
        # A delta that crosses min_tokens also gets the text of its tokens before it, which stop
        # strings must not end the request in (vLLM checks them token by token).
        crossing = [i for i, w in enumerate(work) if 0 < unarmed_tokens(w) < len(w.new)]
        splits = {i: len(items) + n for n, i in enumerate(crossing)}  # work index -> its extra item
        for w in (work[i] for i in crossing):
            items.append(
                tokenizer_pb2.DetokenizeItem(
                    prefix_token_ids=w.stream.prefix,
                    new_token_ids=w.stream.pending + w.new[: unarmed_tokens(w)],
                    skip_special_tokens=w.stream.skip_special_tokens,
                )
            )
        start_ns = time.time_ns()
        try:
            tokenizer, reply = await self.detokenizer.detokenize(tokenizer_pb2.DetokenizeRequest(items=items))
        except ShardlineError as exc:
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
            return
        end_ns, now = time.time_ns(), time.perf_counter()
        named_results = reply.results[len(work) : len(work) + len(named)]
        texts = {t: result.text for t, result in zip(named, named_results)}
        # A token that ends mid-character has no text of its own (U+FFFD): logprobs give its bytes.
        broken = {t: result.raw_bytes for t, result in zip(named, named_results) if "\ufffd" in result.text}
        specials = frozenset(tokenizer.special_token_ids)
        overshot: list[Overshot] = []
        for i, (w, result) in enumerate(zip(work, reply.results)):
            stream = w.stream
            sent = stream.pending + spoken[i]
            item = items[i]
            consumed = sent[: result.num_consumed]
            stream.pending = sent[result.num_consumed :]
            if stream.skip_special_tokens:
                consumed = [t for t in consumed if t not in specials]
            stream.prefix = tail(stream.prefix + consumed, tokenizer.detokenize_prefix_window)
            stream.next_offset = w.offset + len(w.new)
            if w.delta.HasField("usage"):  # the first delta's says what the prefix cache served
                stream.cached_tokens = w.delta.usage.cached_tokens
            stream.timing.record(bool(w.new), now, start_ns, end_ns)
            held = stream.stop.held
            text, end = match_stops(w, result.text, reply.results[splits[i]].text if i in splits else None)
            chunk = StreamChunk(text, w.new, w.offset, w.logprobs, prompt_logprobs=w.prompt_logprobs)
            if w.logprobs or w.prompt_logprobs:
                chunk.token_texts = {t: texts[t] for t in _named_tokens(w.logprobs, w.prompt_logprobs)}
                chunk.token_bytes = {t: broken[t] for t in chunk.token_texts if t in broken}
            if end is not None and len(w.new) > 1:  # which of its tokens completed the stop string?
                search = StopSearch(
                    item,
                    len(spoken[i]),
                    result.text,
                    end,
                    lo=unarmed_tokens(w) + 1,
                    hi=len(spoken[i]),
                    hi_text=result.text,
                )
                overshot.append(Overshot(w, chunk, held, search))
            elif end is not None:
                self._finish(stream, chunk, "stop", cancel=not w.final)
            elif w.final:
                reason = FINISH_REASONS.get(w.delta.finish_reason, "error")
                chunk.error = w.delta.error if reason == "error" else ""
                usage = w.delta.usage if w.delta.HasField("usage") else None
                self._finish(stream, chunk, reason, cancel=False, usage=usage)
            else:
                stream.queue.put_nowait(chunk)
        if overshot:
            await self._cut_after_stops(overshot)

    async def _cut_after_stops(self, overshot: list[Overshot]) -> None:
        """Ends requests whose stop string completed inside a delta of several tokens, keeping the
        tokens through the one that completed it (vLLM checks stop strings token by token, so its
        output, logprobs and usage end there). If the search fails, every token is kept, as before
        it; the requests end either way."""
        try:
            await find_stop_tokens(self._backends.tokenizer, [o.search for o in overshot])
            for o in overshot:
                # Of the stop strings that token completes, the first in the list wins, as in vLLM (all
                # the delta's tokens before it complete none). Not when min_tokens fell inside the
                # delta: stop strings in its text before then must not count.
                if unarmed_tokens(o.work) == 0:
                    shown = o.held + o.search.hi_text
                    start = o.work.stream.stop.first_listed(shown)
                    o.chunk.text = shown[:start] if start is not None else o.chunk.text
        except Exception as exc:  # the chunks must go out whatever went wrong here
            logger.warning("could not find the tokens before %d stop strings: %r", len(overshot), exc)
        for o in overshot:
            w, chunk, keep = o.work, o.chunk, o.search.hi
            chunk.token_ids, chunk.logprobs = w.new[:keep], w.logprobs[:keep]
            chunk.token_texts = {t: chunk.token_texts[t] for t in _named_tokens(chunk.logprobs, chunk.prompt_logprobs)}
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
            self._cancel_upstream(stream.request_id)

    def _cancel_upstream(self, request_id: str) -> None:
        self._spawn(self._cancel(request_id))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cancel(self, request_id: str) -> None:
        try:
            # Our gateway id: if a client has resumed the request on another gateway, it runs on.
            await self._backends.scheduler.Cancel(
                common_pb2.CancelRequest(request_id=request_id, gateway_id=self._gateway_id), timeout=RPC_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                # The scheduler is down or restarting: it will recover the request from Redis and run
                # it for nobody. The cancel goes again once the subscription is back (_catch_up).
                self._unsent_cancels.add(request_id)
            logger.warning("cancel of %s failed: %s %s", request_id, exc.code().name, exc.details())
            return
        self._unsent_cancels.discard(request_id)


def _named_tokens(*logprob_lists: list[sampling_pb2.TokenLogprob]) -> list[int]:
    """Every token id the logprobs name: each token and its alternatives."""
    return [
        t for logprobs in logprob_lists for lp in logprobs for t in (lp.token_id, *(alt.token_id for alt in lp.top))
    ]
