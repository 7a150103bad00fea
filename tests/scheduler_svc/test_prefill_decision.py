"""The per-request decision to prefill on a prefill worker, and the router's estimate it reads."""

import pytest

from scheduler_svc import prefill_decision as pd
from scheduler_svc.live_request import LiveRequest
from scheduler_svc.prefill_decision import decide_prefill
from scheduler_svc.router import Router
from scheduler_svc.worker_registry import WorkerRegistry
from shardline.proto import sampling_pb2, worker_pb2

MIN_TOKENS = 512


@pytest.mark.parametrize(
    ("role", "tokens", "cached", "prefill_workers", "logprobs", "tp", "remote", "reason"),
    [
        ("decode", 2048, 0, 1, False, 1, True, pd.REMOTE),
        ("decode", 512, 0, 2, False, 1, True, pd.REMOTE),  # the threshold itself is long enough
        ("decode", 511, 0, 1, False, 1, False, pd.SHORT_PROMPT),
        ("decode", 2048, 2048, 1, False, 1, False, pd.CACHED_ON_DECODE_WORKER),
        ("decode", 2048, 1600, 1, False, 1, False, pd.CACHED_ON_DECODE_WORKER),  # 448 left to prefill
        ("decode", 2048, 1024, 1, False, 1, True, pd.REMOTE),  # 1,024 left: still worth moving
        ("decode", 2048, 0, 0, False, 1, False, pd.NO_PREFILL_WORKER),
        ("decode", 2048, 0, 1, True, 1, False, pd.PROMPT_LOGPROBS),
        ("decode", 2048, 0, 1, False, 3, False, pd.TENSOR_PARALLEL),
        ("both", 2048, 0, 1, False, 1, False, pd.AGGREGATED_WORKER),
    ],
)
def test_only_a_long_uncached_prompt_on_a_decode_worker_is_prefilled_remotely(
    role, tokens, cached, prefill_workers, logprobs, tp, remote, reason
) -> None:
    decision = decide_prefill(role, tokens, cached, prefill_workers, MIN_TOKENS, logprobs, tp)
    assert (decision.remote, decision.reason) == (remote, reason)
    assert decision.uncached_tokens == tokens - cached


def _request(request_id: str, prompt: list[int]) -> LiveRequest:
    return LiveRequest(
        request_id=request_id,
        gateway_id="gw",
        model="m",
        priority=0,
        prompt_token_ids=prompt,
        params=sampling_pb2.SamplingParameters(),
        eos_token_ids=[],
        arrival_ts=0.0,
    )


def test_the_route_says_how_much_of_a_prompt_its_worker_was_sent_before() -> None:
    registry = WorkerRegistry(overcommit=1.0, heartbeat_timeout_s=10)
    registry.add(worker_pb2.WorkerInfo(worker_id="d", model="m", block_size=4, max_num_seqs=8, role="decode"))
    router = Router(load_slack=0.25)
    prompt = list(range(100, 140))  # ten blocks of 4
    first = router.route(_request("a", prompt), registry.with_room("m"))
    assert (first.worker.worker_id, first.cached_tokens) == ("d", 0)
    # Its whole chain is remembered, past the four blocks affinity looks at.
    assert router.route(_request("b", prompt + [7, 8]), registry.with_room("m")).cached_tokens == 40
    # A prompt that shares only its first 24 tokens: six blocks known.
    assert router.route(_request("c", prompt[:24] + [1] * 30), registry.with_room("m")).cached_tokens == 24
