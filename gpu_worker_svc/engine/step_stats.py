"""A step's StepStats: what it computed, and the batch and cache it left."""

from gpu_worker_svc.engine.batch_scheduler import BatchScheduler, SchedulerOutput
from gpu_worker_svc.engine.outputs import RequestOutput, StepStats


def step_stats(
    sched: SchedulerOutput,
    starts: list[int],
    outputs: list[RequestOutput],
    elapsed: float,
    step: int,
    scheduler: BatchScheduler,
) -> StepStats:
    """`starts`: each scheduled sequence's computed tokens before the step."""
    decoding = [s for s in sched.scheduled if s.num_new_tokens == 1 or s.draft_token_ids]
    decode = sum(s.num_new_tokens for s in decoding)
    drafting = {s.seq.request_id for s in decoding if s.draft_token_ids}
    pairs = kv_read = 0
    for s, before in zip(sched.scheduled, starts):
        n = s.num_new_tokens
        pairs += n * before + n * (n + 1) // 2
        kv_read += before + n
    pool = scheduler.block_pool
    return StepStats(
        step=step,
        batch_size=len(sched.scheduled),
        num_tokens=sched.num_batched_tokens,
        num_prefill_tokens=sched.num_batched_tokens - decode,
        num_decode_tokens=decode,
        prefix_cache_hit_tokens=sched.num_prefix_cached_tokens,
        kv_blocks_used=pool.num_used_blocks,
        kv_blocks_total=pool.num_blocks,
        num_waiting=scheduler.num_waiting,
        num_running=scheduler.num_running,
        num_preempted=len(sched.preempted_ids),
        step_time_s=elapsed,
        attention_pairs=pairs,
        kv_tokens_read=kv_read,
        num_draft_tokens=sum(len(s.draft_token_ids) for s in decoding),
        num_accepted_tokens=sum(len(o.new_token_ids) - 1 for o in outputs if o.request_id in drafting),
    )
