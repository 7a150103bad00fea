"""Prompt logprobs (vLLM's `prompt_logprobs`): the model's logprob of each prompt token given the ones
before it, which evaluation harnesses score completions with. Checked against HF transformers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpu_worker_svc.engine.batch_scheduler import SchedulerConfig
from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.model_runner import RunnerConfig
from gpu_worker_svc.engine.sampling_params import SamplingParams
from gpu_worker_svc.model.attention_metadata import StepBatch

ASK = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=3)


def _engine(num_blocks: int | None = None) -> LLMEngine:
    # Chunks of at most 32 tokens: a 70-token prompt's logprobs come from three prefill steps.
    return LLMEngine(
        EngineConfig(
            runner=RunnerConfig(num_blocks=num_blocks, cpu_kv_bytes=64 << 20, quantization="none"),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
        )
    )


@pytest.fixture(scope="module")
def engine():
    e = _engine()
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(100, 49152, (70,), generator=torch.Generator().manual_seed(11)).tolist()


@pytest.fixture(scope="module")
def reference(engine, prompt):
    """One run that asked for them, and one that did not."""
    asked = engine.generate([prompt], ASK)[0]
    plain = engine.generate([prompt], dataclasses.replace(ASK, prompt_logprobs=None))[0]
    return asked, plain


def _values(result) -> list[float]:
    return [lp.logprob for lp in result.prompt_logprobs]


@pytest.mark.slow
def test_prompt_logprobs_equal_hf_transformers(reference, prompt, hf_default_model):
    asked, plain = reference
    with torch.no_grad():
        hf = torch.log_softmax(hf_default_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert [lp.token_id for lp in asked.prompt_logprobs] == prompt[1:]
    want = [hf[j, prompt[j + 1]].item() for j in range(len(prompt) - 1)]
    assert max(abs(a - b) for a, b in zip(_values(asked), want)) < 1e-3
    # vLLM's rank: how many tokens are at least as likely. Random prompt tokens rank in the thousands,
    # among near-ties, so a 1e-4 difference in a logprob may move one a place (measured: 67 of 69 equal).
    hf_ranks = [int((hf[j] >= hf[j, prompt[j + 1]]).sum()) for j in range(len(prompt) - 1)]
    assert all(abs(lp.rank - r) <= 1 + r // 1000 for lp, r in zip(asked.prompt_logprobs, hf_ranks))
    assert sum(lp.rank == r for lp, r in zip(asked.prompt_logprobs, hf_ranks)) >= 0.9 * len(hf_ranks)
    for j, lp in enumerate(asked.prompt_logprobs):
        assert len(lp.top) == 3 and [t for t, _ in lp.top] == hf[j].topk(3).indices.tolist()
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1] >= lp.logprob or lp.token_id in [t for t, _ in lp.top]
    # Asking changes nothing else: the tokens are the ones a plain run samples.
    assert asked.token_ids == plain.token_ids and plain.prompt_logprobs is None
    assert asked.logprobs is None


@pytest.mark.slow
def test_a_cached_prompt_is_computed_again_for_its_logprobs(engine, reference, prompt):
    asked, _ = reference
    engine.add_request("again", prompt, ASK)  # the reference runs left every full block cached
    hits = computed = 0
    first = None
    while engine.has_unfinished:
        step = engine.step()
        hits += step.stats.prefix_cache_hit_tokens if step.stats else 0
        computed += step.stats.num_prefill_tokens if step.stats else 0
        first = first or next((o for o in step.outputs if o.offset == 0), None)
    assert hits == 0 and computed >= len(prompt) - 1
    assert [lp.token_id for lp in first.prompt_logprobs] == prompt[1:]
    assert _values(first) == pytest.approx(_values(asked), abs=1e-4)
    # A request without them still gets the cache's blocks.
    engine.add_request("plain", prompt, dataclasses.replace(ASK, prompt_logprobs=None))
    step = engine.step()
    assert step.stats.prefix_cache_hit_tokens == 64
    while engine.has_unfinished:
        engine.step()


@pytest.mark.slow
def test_prompt_logprobs_survive_preemption(reference, prompt):
    asked, _ = reference
    tiny = _engine(num_blocks=9)  # 144 token slots: three 70-token prompts preempt each other
    try:
        prompts = [prompt, prompt[::-1], prompt[5:] + prompt[:5]]
        results = tiny.generate(prompts, dataclasses.replace(ASK, max_tokens=12))
    finally:
        tiny.shutdown()
    assert _values(results[0]) == pytest.approx(_values(asked), abs=1e-4)
    for p, r in zip(prompts, results):
        assert [lp.token_id for lp in r.prompt_logprobs] == p[1:]


@pytest.mark.slow
def test_a_resumed_request_sends_none_and_a_one_token_prompt_sends_an_empty_list(engine, reference, prompt):
    asked, _ = reference
    engine.add_request("resumed", prompt, ASK, output_token_ids=asked.token_ids[:2])
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step().outputs
    assert all(o.prompt_logprobs is None for o in outputs)
    assert [t for o in outputs for t in o.new_token_ids] == asked.token_ids[2:]
    assert engine.generate([[prompt[0]]], ASK)[0].prompt_logprobs == []


def test_a_step_batch_carries_its_prompt_rows_to_every_rank():
    batch = StepBatch(
        torch.arange(9),
        torch.tensor([0, 5, 3]),
        torch.tensor([4, 1, 4]),
        torch.tensor([[1, 2], [3, 0], [4, 0]]),
        step=7,
        prompt_logits=torch.tensor([3, 0, 4]),
    )
    back = StepBatch.unpack(batch.pack())
    assert back.prompt_logits.tolist() == [3, 0, 4] and back.block_tables.tolist() == [[1, 2], [3, 0], [4, 0]]
    assert back.prompt_logit_rows().tolist() == [0, 1, 2, 5, 6, 7, 8]
    plain = StepBatch.unpack(dataclasses.replace(batch, prompt_logits=None).pack())
    assert plain.prompt_logits is None and plain.prompt_logit_rows().numel() == 0
    assert plain.num_new.tolist() == [4, 1, 4] and plain.step == 7
