"""Whether a request's prompt is prefilled on a prefill worker or by the worker that runs it, and why.

Remote prefill pays for moving the prompt's KV (about 94 MB for 2,048 tokens of the default model,
half a second over gRPC here) to save the decode worker the prefill itself (seconds on a CPU), and
it keeps long prefills out of the decode worker's steps, where they would stall every running
request's next token. So it is worth it only for a long prompt whose prefix the decode worker does
not hold already: Dynamo's and llm-d's conditional disaggregation. See docs/kv_transfer.md.
"""

from dataclasses import dataclass

from shardline.core.worker_role import WorkerRole

# Why a request was prefilled where it was: the value of the dispatch span's shardline.prefill.reason.
REMOTE = "long_uncached_prompt"  # the only reason that prefills remotely
AGGREGATED_WORKER = "aggregated_worker"  # its worker's role is both: it prefills its own requests
TENSOR_PARALLEL = "tensor_parallel"  # its worker runs at TP > 1, which KV transfer does not serve yet
PROMPT_LOGPROBS = "prompt_logprobs"  # it asks for the prompt's logprobs: logits that imported blocks lack
NO_PREFILL_WORKER = "no_prefill_worker"  # no prefill worker of its model is registered and live
SHORT_PROMPT = "short_prompt"  # fewer tokens than the threshold: moving its KV would cost more than computing it
CACHED_ON_DECODE_WORKER = "cached_on_decode_worker"  # long, but the part its worker lacks is under the threshold


@dataclass(slots=True, frozen=True)
class PrefillDecision:
    """Where one dispatch's prefill runs."""

    remote: bool  # on a prefill worker, its blocks sent to the decode worker before the request
    reason: str  # one of the reasons above
    uncached_tokens: int  # tokens to prefill that the decode worker likely lacks (the router's estimate)


def decide_prefill(
    worker_role: WorkerRole,
    num_tokens: int,
    cached_tokens: int,
    prefill_workers: int,
    min_tokens: int,
    wants_prompt_logprobs: bool = False,
    worker_tp_size: int = 1,
) -> PrefillDecision:
    """The decision for a request of `num_tokens` (prompt plus an earlier attempt's output) dispatched to
    a worker of `worker_role` that likely holds its first `cached_tokens`, with `prefill_workers` of its
    model up and a threshold of `min_tokens` (SHARDLINE_REMOTE_PREFILL_MIN_TOKENS). A worker at TP > 1
    would refuse the blocks after the prefill worker had computed them all: it prefills itself."""
    uncached = max(0, num_tokens - cached_tokens)
    if worker_role != "decode":
        reason = AGGREGATED_WORKER
    elif worker_tp_size > 1:
        reason = TENSOR_PARALLEL
    elif wants_prompt_logprobs:
        reason = PROMPT_LOGPROBS
    elif prefill_workers == 0:
        reason = NO_PREFILL_WORKER
    elif num_tokens < min_tokens:
        reason = SHORT_PROMPT
    elif uncached < min_tokens:
        reason = CACHED_ON_DECODE_WORKER
    else:
        return PrefillDecision(True, REMOTE, uncached)
    return PrefillDecision(False, reason, uncached)
