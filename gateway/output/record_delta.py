"""A request's record from the scheduler (Redis) as one delta: how a resumed stream, or one a
gateway catches up on after losing its subscription, is rebuilt before live deltas follow."""

from __future__ import annotations

from shardline.proto import common_pb2, sampling_pb2


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
