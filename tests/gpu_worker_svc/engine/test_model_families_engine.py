"""The model families beyond Llama's, and Mistral's sliding window, through the engine: continuous batching,
chunked prefill and the prefix cache give HF's greedy tokens, each with HF's logprob
(tests/gpu_worker_svc/model/family_cases.py), for the Mixture-of-Experts families too (their experts split
between the ranks at TP 2)."""

from __future__ import annotations

import pytest
import torch

from gpu_worker_svc.engine.batch_scheduler import SchedulerConfig
from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.model_runner import RunnerConfig
from gpu_worker_svc.engine.ngram_proposer import SpeculativeConfig
from gpu_worker_svc.engine.sampling_params import SamplingParams
from gpu_worker_svc.model.layers.kernels import cpu_kernels
from tests.gpu_worker_svc.model.family_cases import GREEDY_STEPS, LOGPROB_TOL, MOE_CASES, SavedModel, save_cases

pytestmark = pytest.mark.slow

ENGINE_CASES = [
    "qwen3-gqa4x2-headdim32-qknorm",
    "phi3-gqa4x2-fused-vocab250",
    # Windows of 12 and 16 keys: the prefix cache's hits (blocks of 16) and the chunks (BUDGET) start
    # past the window of later queries.
    "mistral-gqa4x2-window12",
    "gemma2-gqa4x2-window16-softcaps",
    "gemma3-gqa4x2-window10-qknorm",
    *MOE_CASES,
]
BUDGET = 24  # tokens a step: the 70-token prompt's prefill takes several chunks


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SavedModel]:
    return save_cases(tmp_path_factory, ENGINE_CASES)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", ENGINE_CASES)
def test_engine_batched_chunked_and_from_the_prefix_cache_gives_hf_greedy(saved_models, case, tp):
    """Through the engine: prompts batched, prefills chunked by a small step budget; then the same prompts
    again, now from the prefix cache. Each run's tokens are HF's, each token's logprob within LOGPROB_TOL."""
    saved = saved_models[case]
    engine = LLMEngine(
        EngineConfig(
            runner=RunnerConfig(model=str(saved.folder), tp_size=tp, num_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=BUDGET),
        )
    )
    params = SamplingParams(max_tokens=GREEDY_STEPS, temperature=0.0, ignore_eos=True, logprobs=0)
    try:
        for run in ("cold", "from the prefix cache"):
            for i, prompt in enumerate(saved.prompts):
                engine.add_request(str(i), prompt, params)
            tokens: dict[str, list[int]] = {str(i): [] for i in range(len(saved.prompts))}
            logprobs: dict[str, list[float]] = {str(i): [] for i in range(len(saved.prompts))}
            cached = prefill_steps = 0
            while engine.has_unfinished:
                step = engine.step()
                for out in step.outputs:
                    tokens[out.request_id] += out.new_token_ids
                    logprobs[out.request_id] += [lp.logprob for lp in out.logprobs or []]
                if step.stats is not None:
                    cached += step.stats.prefix_cache_hit_tokens
                    prefill_steps += step.stats.num_prefill_tokens > 0
            assert (cached > 0) == (run != "cold"), f"{run}: {cached} prefix-cache hit tokens"
            if run == "cold":  # 120 prompt tokens at most BUDGET a step: the 70-token prompt takes several chunks
                assert prefill_steps >= sum(map(len, saved.prompts)) // BUDGET, f"{prefill_steps} prefill steps"
            for i, prompt in enumerate(saved.prompts):
                assert tokens[str(i)] == saved.greedy[i], f"{run}: prompt {i}"
                ref = torch.log_softmax(saved.logits[i][len(prompt) - 1 : len(prompt) - 1 + GREEDY_STEPS], -1)
                want = ref.gather(1, torch.tensor(saved.greedy[i])[:, None])[:, 0]
                err = (torch.tensor(logprobs[str(i)]) - want).abs().max().item()
                assert err <= LOGPROB_TOL, f"{run}: prompt {i}: max |logprob error| {err}"
    finally:
        engine.shutdown()


WINDOWED_CASES = ["mistral-gqa4x2-window12", "gemma2-gqa4x2-window16-softcaps", "gemma3-gqa4x2-window10-qknorm"]


@pytest.mark.parametrize("attention", ["cpu kernel", "torch"])
@pytest.mark.parametrize("case", WINDOWED_CASES)
def test_engine_with_ngram_drafts_gives_hf_greedy_past_the_window(saved_models, case, attention, monkeypatch):
    """N-gram speculation: a decode's drafts are queries of their own, each with its own window, through
    the CPU kernel or torch's attention. The tokens are HF's greedy ones, with drafts run and some kept."""
    if attention == "torch":
        monkeypatch.setattr(cpu_kernels, "paged_decode_attention", lambda: None)
    saved = saved_models[case]
    engine = LLMEngine(
        EngineConfig(
            runner=RunnerConfig(model=str(saved.folder), num_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=BUDGET),
            speculative=SpeculativeConfig(num_speculative_tokens=3),
        )
    )
    params = SamplingParams(max_tokens=GREEDY_STEPS, temperature=0.0, ignore_eos=True)
    try:
        for i, prompt in enumerate(saved.prompts):
            engine.add_request(str(i), prompt, params)
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(saved.prompts))}
        drafts = accepted = 0
        while engine.has_unfinished:
            step = engine.step()
            for out in step.outputs:
                tokens[out.request_id] += out.new_token_ids
            if step.stats is not None:
                drafts += step.stats.num_draft_tokens
                accepted += step.stats.num_accepted_tokens
    finally:
        engine.shutdown()
    assert drafts > 0 and accepted > 0, (drafts, accepted)
    for i in range(len(saved.prompts)):
        assert tokens[str(i)] == saved.greedy[i], f"prompt {i}"
