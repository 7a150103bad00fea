"""Batch invariance in int8, the mode whose rounding made it matter: a request's tokens and logprobs
are bitwise the same alone or batched, chunked, preempted, from the prefix cache or not, and when
resumed from a prefix of its own output (as the scheduler resumes a request whose worker died).
With torch's SDPA for prefills (measured, int8, 10 such requests of 30 tokens), no request had the
same logprobs alone as batched, and 5 of 10 resumes went on with other tokens."""

from __future__ import annotations

import random

import pytest

from gpu_worker_svc.engine.batch_scheduler import SchedulerConfig
from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.model_runner import RunnerConfig
from gpu_worker_svc.engine.ngram_proposer import SpeculativeConfig
from gpu_worker_svc.engine.sampling_params import SamplingParams
from gpu_worker_svc.model.layers.kernels import cpu_kernels

pytestmark = pytest.mark.slow

RESUME_AT = 7


@pytest.fixture(scope="module", params=["flag", "flag, torch attention", "default"])
def engine(request):
    """With the flag, through the decode kernel (which takes every CPU query) or, where it cannot run,
    invariant_attention; and without the flag: one rank's steps are then invariant all the same, as
    the kernel attends every prefill query as its own decode."""
    # 40 blocks of 16 tokens hold about 3 of these requests at once: a batch of 10 preempts. Chunks of
    # at most 96 tokens split the longer prompts over several steps.
    with pytest.MonkeyPatch.context() as patch:
        if request.param.endswith("torch attention"):
            patch.setattr(cpu_kernels, "paged_decode_attention", lambda: None)
        e = LLMEngine(
            EngineConfig(
                runner=RunnerConfig(quantization="int8", batch_invariant=request.param != "default", num_blocks=40),
                scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=96),
            )
        )
        yield e
        e.shutdown()


def _requests() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(5)
    return [
        (
            [rng.randrange(100, 49000) for _ in range(rng.randrange(20, 260))],
            SamplingParams(max_tokens=16, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True, logprobs=2),
        )
        for i in range(8)
    ]


def _run(engine: LLMEngine, requests, resume_from: list[list[int]] | None = None) -> tuple[dict, dict]:
    """Every request's (tokens, logprobs), and the run's preemption and prefix-cache counts."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params, output_token_ids=resume_from[i] if resume_from else None)
    results: dict[str, tuple[list, list]] = {str(i): ([], []) for i in range(len(requests))}
    counts = {"preempted": 0, "cached": 0, "accepted": 0}
    while engine.has_unfinished:
        step = engine.step()
        for out in step.outputs:
            results[out.request_id][0].extend(out.new_token_ids)
            results[out.request_id][1].extend((lp.token_id, lp.logprob, tuple(lp.top)) for lp in out.logprobs or [])
        if step.stats is not None:
            counts["preempted"] += step.stats.num_preempted
            counts["cached"] += step.stats.prefix_cache_hit_tokens
            counts["accepted"] += step.stats.num_accepted_tokens
    return results, counts


def test_int8_tokens_and_logprobs_are_bitwise_the_same_however_run(engine):
    requests = _requests()
    batched, counts = _run(engine, requests)
    assert counts["preempted"] > 0
    for i, request in enumerate(requests):
        alone, _ = _run(engine, [request])
        assert alone["0"] == batched[str(i)], f"request {i}"
        again, again_counts = _run(engine, [request])  # its prompt now from the prefix cache
        assert again_counts["cached"] >= len(request[0]) - 16 and again["0"] == alone["0"], f"request {i}"
    resumed, _ = _run(engine, requests, [batched[str(i)][0][:RESUME_AT] for i in range(len(requests))])
    for i in range(len(requests)):
        assert resumed[str(i)][0] == batched[str(i)][0][RESUME_AT:], f"request {i}"
        assert resumed[str(i)][1] == batched[str(i)][1][RESUME_AT:], f"request {i}"


def test_int8_drafts_change_no_bit_of_tokens_or_logprobs(engine):
    """N-gram speculation computes a decode and its drafts as one chunk: under batch invariance its
    tokens and logprobs are bitwise those of decoding one token a step."""
    rng = random.Random(9)
    phrase = [rng.randrange(100, 49000) for _ in range(9)]
    requests = _requests()[:4] + [
        (phrase * 6, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2))
    ]
    one_by_one, _ = _run(engine, requests)
    engine.config.speculative = SpeculativeConfig(num_speculative_tokens=4)
    try:
        drafted, counts = _run(engine, requests)
    finally:
        engine.config.speculative = SpeculativeConfig()
    assert counts["accepted"] > 0
    assert drafted == one_by_one
