"""Engine step results as the wire's `shardline.v1.StepOutput`."""

from __future__ import annotations

from gpu_worker_svc.engine.llm_engine import LLMEngine
from gpu_worker_svc.engine.outputs import RequestOutput, StepStats, TokenLogprobs
from shardline.proto import common_pb2, sampling_pb2, worker_pb2

FINISH_REASONS = {
    None: sampling_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": sampling_pb2.FINISH_REASON_STOP,
    "length": sampling_pb2.FINISH_REASON_LENGTH,
    "abort": sampling_pb2.FINISH_REASON_ABORT,
    "error": sampling_pb2.FINISH_REASON_ERROR,
}


def request_delta(out: RequestOutput) -> common_pb2.RequestDelta:
    delta = common_pb2.RequestDelta(
        request_id=out.request_id,
        token_ids=out.new_token_ids,
        offset=out.offset,
        finish_reason=FINISH_REASONS[out.finish_reason],
        error=out.error or "",
    )
    delta.logprobs.extend(map(_token_logprob, out.logprobs or ()))
    delta.prompt_logprobs.extend(map(_token_logprob, out.prompt_logprobs or ()))
    if out.finish_reason is not None or out.offset == 0:
        # The first delta too: its prompt and cached tokens, for a gateway that ends it early (a stop string).
        completion = out.offset + len(out.new_token_ids)
        delta.usage.CopyFrom(
            sampling_pb2.Usage(
                prompt_tokens=out.num_prompt_tokens,
                completion_tokens=completion,
                total_tokens=out.num_prompt_tokens + completion,
                cached_tokens=out.num_cached_tokens,
            )
        )
    return delta


def _token_logprob(lp: TokenLogprobs) -> sampling_pb2.TokenLogprob:
    return sampling_pb2.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top=[sampling_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def error_delta(new: worker_pb2.NewRequest, message: str) -> common_pb2.RequestDelta:
    """The final delta of a request the engine refused."""
    return _final_delta(new, sampling_pb2.FINISH_REASON_ERROR, message)


def abort_delta(new: worker_pb2.NewRequest) -> common_pb2.RequestDelta:
    """The final delta of a request aborted before it reached the engine."""
    return _final_delta(new, sampling_pb2.FINISH_REASON_ABORT, "")


def _final_delta(new: worker_pb2.NewRequest, reason: int, message: str) -> common_pb2.RequestDelta:
    prompt, done = len(new.prompt_token_ids), len(new.output_token_ids)
    return common_pb2.RequestDelta(
        request_id=new.request_id,
        offset=done,
        finish_reason=reason,
        error=message,
        usage=sampling_pb2.Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done),
    )


def stats_message(engine: LLMEngine, stats: StepStats | None) -> worker_pb2.StepStats:
    """The step's figures; occupancy only when nothing ran (an abort-only step still frees blocks)."""
    msg = worker_pb2.StepStats(
        kv_blocks_used=engine.block_pool.num_used_blocks,
        kv_blocks_total=engine.block_pool.num_blocks,
        num_waiting=engine.scheduler.num_waiting,
        num_running=engine.scheduler.num_running,
    )
    if stats is not None:
        msg.batch_size = stats.batch_size
        msg.num_tokens = stats.num_tokens
        msg.num_prefill_tokens = stats.num_prefill_tokens
        msg.num_decode_tokens = stats.num_decode_tokens
        msg.prefix_cache_hit_tokens = stats.prefix_cache_hit_tokens
        msg.step_time_ms = stats.step_time_s * 1000.0
    return msg
