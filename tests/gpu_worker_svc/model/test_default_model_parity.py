"""The default model (SmolLM2-135M-Instruct, GGUF Q4_1) against HF transformers, at TP 1 and 3."""

from __future__ import annotations

import pytest
import torch

from gpu_worker_svc.engine.model_runner import ModelRunner, RunnerConfig
from tests.gpu_worker_svc.model.paged_driver import PagedDriver

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[1, 3], ids=["tp1", "tp3"])
def runner(request):
    r = ModelRunner(RunnerConfig(tp_size=request.param, num_blocks=128, quantization="none"))
    yield r
    r.shutdown()


@pytest.fixture(scope="module")
def hf_reference(hf_default_model, prompts):
    with torch.no_grad():
        logits = [hf_default_model(torch.tensor([p])).logits[0, -1] for p in prompts]
        greedy = [
            hf_default_model.generate(
                torch.tensor([p]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    return logits, greedy


def test_logits_match_hf(runner, prompts, hf_reference):
    driver = PagedDriver(runner)
    seqs = [driver.add(p) for p in prompts]
    ours = driver.step({s: len(p) for s, p in zip(seqs, prompts)})
    for row, ref in zip(ours, hf_reference[0]):
        assert (row - ref).abs().max().item() <= 1e-3


def test_greedy_continuations_match_hf(runner, prompts, hf_reference):
    ours = PagedDriver(runner).greedy(prompts, steps=32)
    assert ours == hf_reference[1]
