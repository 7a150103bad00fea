"""A request's record from the scheduler (Redis) replayed into its stream: how a resumed stream, or one
a gateway catches up on after losing its subscription, is rebuilt before live deltas follow.

The record's tokens from an offset on come in as one delta. A stream resumed at that offset gets the
detokenize state first that it would have had if it had sent the earlier tokens itself: it would
hold back text (the bytes of a character its last tokens have not finished, text that may begin a
stop string), which a client resuming there has not had, so the resumed stream holds back the same.
"""

from __future__ import annotations

from gateway.output.request_stream import RequestStream, tail
from gateway.upstream.backends import RPC_TIMEOUT_S, Backends, upstream
from shardline.proto import common_pb2, sampling_pb2, tokenizer_pb2

# Last tokens of a resumed stream's record checked for held-back text: more than a character's bytes.
_RESUME_TAIL = 8


async def restore_held_back(
    backends: Backends, stream: RequestStream, info: common_pb2.RequestInfo, offset: int
) -> None:
    """Puts `stream`, resumed at output `offset`, where a stream that had sent those tokens itself
    would be: those tokens stay pending and the stop matcher holds the same text again, so what the
    client had plus what it gets is the whole text."""
    if info.status >= sampling_pb2.REQUEST_STATUS_FINISHED and offset == len(info.output_token_ids):
        return  # the client had the last chunk, which flushed everything held back: nothing is owed
    before = list(info.output_token_ids[:offset])
    if not before:
        return
    tokenizer = await backends.tokenizer_info()
    cut = max(0, len(before) - _RESUME_TAIL)
    specials = frozenset(tokenizer.special_token_ids) if stream.skip_special_tokens else frozenset()
    early = [t for t in before[:cut] if t not in specials]
    items = [
        tokenizer_pb2.DetokenizeItem(
            prefix_token_ids=tail(early, tokenizer.detokenize_prefix_window),
            new_token_ids=before[cut:],
            skip_special_tokens=stream.skip_special_tokens,
        )
    ]
    if stream.stop.holds_text and early:  # the matcher must see the text, not only its last tokens
        items.append(tokenizer_pb2.DetokenizeItem(new_token_ids=early, final=True, skip_special_tokens=False))
    with upstream("tokenizer"):
        reply = await backends.tokenizer.Detokenize(tokenizer_pb2.DetokenizeRequest(items=items), timeout=RPC_TIMEOUT_S)
    last = reply.results[0]
    consumed = [t for t in before[cut : cut + last.num_consumed] if t not in specials]
    stream.pending = before[cut + last.num_consumed :]
    stream.prefix = tail(early + consumed, tokenizer.detokenize_prefix_window)
    if stream.stop.holds_text:
        earlier = reply.results[1].text if len(items) > 1 else ""
        stream.stop.feed(earlier + last.text, armed=False)  # sent before: only what it holds back matters


def record_delta(info: common_pb2.RequestInfo, offset: int) -> common_pb2.RequestDelta:
    """A delta holding a request record's tokens from `offset` on, with their logprobs (and, from
    0, the prompt's) where it asked for them; final when the record is."""
    delta = common_pb2.RequestDelta(
        request_id=info.request_id,
        token_ids=info.output_token_ids[offset:],
        offset=offset,
        logprobs=info.output_logprobs[offset:],
        prompt_logprobs=info.prompt_logprobs if offset == 0 else [],
    )
    if info.status == sampling_pb2.REQUEST_STATUS_FINISHED:
        delta.finish_reason = info.finish_reason or sampling_pb2.FINISH_REASON_STOP
    elif info.status == sampling_pb2.REQUEST_STATUS_CANCELLED:
        delta.finish_reason = sampling_pb2.FINISH_REASON_ABORT
    elif info.status == sampling_pb2.REQUEST_STATUS_FAILED:
        delta.finish_reason = sampling_pb2.FINISH_REASON_ERROR
        delta.error = info.error
    if delta.finish_reason:
        delta.usage.CopyFrom(info.usage)
    return delta
