"""N-gram speculation with the real default model: the tokens are those of decoding one by one.

The drafts only change how many tokens a step computes: every kept token is the one the sampler
picks at its index with its own random draw, so greedy and seeded requests give the same tokens
with speculation or without, batched, preempted or resumed.
"""

from __future__ import annotations

import random

import pytest

from gpu_worker_svc.engine.batch_scheduler import SchedulerConfig
from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.model_runner import RunnerConfig
from gpu_worker_svc.engine.ngram_proposer import SpeculativeConfig
from gpu_worker_svc.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


def _engine(num_blocks: int | None = None) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            runner=RunnerConfig(num_blocks=num_blocks, cpu_kv_bytes=64 << 20),
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
        )
    )


@pytest.fixture(scope="module")
def engine():
    e = _engine()
    yield e
    e.shutdown()


def _prompts() -> list[list[int]]:
    """Half of them a phrase said over and over, which the model goes on repeating: drafts hit."""
    rng = random.Random(3)
    prompts = []
    for i in range(8):
        phrase = [rng.randrange(100, 49000) for _ in range(rng.randrange(5, 14))]
        prompts.append(phrase * 5 if i % 2 == 0 else [rng.randrange(100, 49000) for _ in range(rng.randrange(10, 60))])
    return prompts


PARAMS = [
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=3),
    SamplingParams(max_tokens=37, temperature=0.8, top_p=0.95, top_k=50, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.0, min_tokens=6, logprobs=1),
    SamplingParams(max_tokens=33, temperature=1.0, min_p=0.1, seed=5, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[1000]),
    SamplingParams(max_tokens=29, temperature=0.6, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
]


def _run(engine: LLMEngine, k: int, requests, resume_from: list[list[int]] | None = None):
    """Each request's tokens and logprobs, and the run's draft, accepted and preempted counts."""
    engine.config.speculative = SpeculativeConfig(num_speculative_tokens=k)
    try:
        for i, (prompt, params) in enumerate(requests):
            engine.add_request(str(i), prompt, params, output_token_ids=resume_from[i] if resume_from else None)
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
        logprobs: dict[str, list] = {str(i): [] for i in range(len(requests))}
        counts = {"drafts": 0, "accepted": 0, "preempted": 0}
        while engine.has_unfinished:
            step = engine.step()
            for out in step.outputs:
                assert out.offset == len(tokens[out.request_id]) + (
                    len(resume_from[int(out.request_id)]) if resume_from else 0
                )
                tokens[out.request_id] += out.new_token_ids
                logprobs[out.request_id] += [
                    (lp.token_id, lp.rank, lp.logprob, [t for t, _ in lp.top]) for lp in out.logprobs or []
                ]
            if step.stats is not None:
                counts["drafts"] += step.stats.num_draft_tokens
                counts["accepted"] += step.stats.num_accepted_tokens
                counts["preempted"] += step.stats.num_preempted
        return tokens, logprobs, counts
    finally:
        engine.config.speculative = SpeculativeConfig()


def _same_logprobs(a: list, b: list) -> None:
    assert [x[:2] + x[3:] for x in a] == [y[:2] + y[3:] for y in b]
    assert all(abs(x[2] - y[2]) < 1e-4 for x, y in zip(a, b))


@pytest.fixture(scope="module")
def one_by_one(engine):
    return _run(engine, 0, list(zip(_prompts(), PARAMS)))


def test_speculation_gives_the_tokens_of_decoding_one_by_one(engine, one_by_one):
    plain_tokens, plain_logprobs, _ = one_by_one
    tokens, logprobs, counts = _run(engine, 4, list(zip(_prompts(), PARAMS)))
    assert counts["accepted"] > 20 and counts["drafts"] > counts["accepted"]
    assert tokens == plain_tokens
    for i, params in enumerate(PARAMS):
        assert len(logprobs[str(i)]) == (len(tokens[str(i)]) if params.logprobs is not None else 0)
        _same_logprobs(logprobs[str(i)], plain_logprobs[str(i)])
    assert len(tokens["1"]) == 37 and len(tokens["5"]) == 29  # max_tokens holds with drafts past it
    assert engine.block_pool.num_used_blocks == 0


def test_each_request_alone_and_resumed_gives_the_same_tokens(engine, one_by_one):
    plain_tokens = one_by_one[0]
    requests = list(zip(_prompts(), PARAMS))
    for i in (0, 1, 2):
        alone, _, counts = _run(engine, 3, [requests[i]])
        assert alone["0"] == plain_tokens[str(i)]
    cut = 9
    resumed, _, _ = _run(engine, 4, requests, [plain_tokens[str(i)][:cut] for i in range(len(requests))])
    assert all(resumed[str(i)] == plain_tokens[str(i)][cut:] for i in range(len(requests)))


def test_penalties_and_logit_biases_count_the_drafts(engine):
    prompt = _prompts()[0]
    for params in (
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.05),
        SamplingParams(
            max_tokens=24, temperature=0.7, seed=4, ignore_eos=True, presence_penalty=0.2, frequency_penalty=0.1
        ),
        SamplingParams(max_tokens=24, temperature=0.7, seed=4, ignore_eos=True, logit_bias={prompt[2]: 1.5, 500: 2.0}),
    ):
        tokens, _, counts = _run(engine, 4, [(prompt, params)])
        assert counts["accepted"] > 0, params
        assert tokens == _run(engine, 0, [(prompt, params)])[0], params


def test_speculation_under_kv_pressure_preempts_and_still_gives_the_same_tokens(one_by_one):
    tiny = _engine(num_blocks=14)  # about 3 of these requests at once
    try:
        requests = list(zip(_prompts(), PARAMS))
        plain, _, plain_counts = _run(tiny, 0, requests)
        tokens, _, counts = _run(tiny, 4, requests)
        # Both runs preempt. Drafts take only blocks left free (test_scheduler_drafts.py), but how
        # often each run preempts follows its timing: requests that run ahead need blocks sooner.
        assert plain_counts["preempted"] > 0 and counts["preempted"] > 0 and counts["accepted"] > 0
        assert tokens == plain == one_by_one[0]
        assert tiny.block_pool.num_used_blocks == 0
    finally:
        tiny.shutdown()
