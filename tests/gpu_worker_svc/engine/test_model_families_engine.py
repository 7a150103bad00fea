"""The model families beyond Llama's through the engine: continuous batching, chunked prefill and the
prefix cache give HF's greedy tokens, each with HF's logprob (tests/gpu_worker_svc/model/family_cases.py), for
the Mixture-of-Experts families too (their experts split between the ranks at TP 2)."""

from __future__ import annotations

import pytest
import torch

from gpu_worker_svc.engine.batch_scheduler import SchedulerConfig
from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.model_runner import RunnerConfig
from gpu_worker_svc.engine.sampling_params import SamplingParams
from tests.gpu_worker_svc.model.family_cases import GREEDY_STEPS, LOGPROB_TOL, MOE_CASES, SavedModel, save_cases

pytestmark = pytest.mark.slow

ENGINE_CASES = ["qwen3-gqa4x2-headdim32-qknorm", "phi3-gqa4x2-fused-vocab250", *MOE_CASES]
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
