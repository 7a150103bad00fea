"""Dynamic NTK and YaRN rope scaling: the frequencies and attention factor against transformers' own rope
init functions, and a model using each against HF's forward pass."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from gpu_worker_svc.engine.model_runner import ModelRunner, RunnerConfig
from gpu_worker_svc.model.config import ModelConfig
from gpu_worker_svc.model.layers.rotary import RotaryEmbedding
from tests.gpu_worker_svc.model.family_cases import TOL
from tests.gpu_worker_svc.model.paged_driver import PagedDriver
from tests.gpu_worker_svc.model.random_checkpoints import random_hf_model, random_prompts

ORIGINAL = 64  # the pretraining context of the configs below


def _llama(rope: dict, max_positions: int = 256, head_dim: int = 16) -> LlamaConfig:
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=64 // head_dim,
        num_key_value_heads=min(2, 64 // head_dim),
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_theta": 10000.0, **rope},
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _ours(config: LlamaConfig, served: int) -> RotaryEmbedding:
    cfg = ModelConfig.from_hf_dict(config.to_dict())
    return RotaryEmbedding(cfg.head_dim, served, cfg.rope_theta, cfg.rope_scaling, torch.float32)


def _hf_cos(inv_freq: torch.Tensor, attention: float, positions: int) -> torch.Tensor:
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs, freqs], -1).cos() * attention


YARN = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL, "beta_fast": 16, "beta_slow": 2},
    {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
        "mscale": 0.8,
        "mscale_all_dim": 0.5,
    },
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "attention_factor": 1.3},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": ORIGINAL, "truncate": False},
]


@pytest.mark.parametrize("rope", YARN, ids=["plain", "betas", "mscales", "attention-factor", "untruncated"])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_yarn_is_transformers_frequencies_and_attention_factor(rope, head_dim):
    config = _llama(rope, head_dim=head_dim)
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = _ours(config, 256)
    torch.testing.assert_close(ours.cos, _hf_cos(inv_freq, attention, 256), rtol=0, atol=1e-6)
    assert attention != 1.0 or rope.get("attention_factor") == 1.0


@pytest.mark.parametrize("served", [ORIGINAL // 2, ORIGINAL, 4 * ORIGINAL])
def test_dynamic_ntk_is_transformers_frequencies_for_the_served_context(served):
    """Within the original context HF's dynamic NTK is the plain rotation; past it, HF's for a sequence as
    long as the served context (rotary.py picks once: a KV cache cannot follow a theta that moves)."""
    config = _llama({"rope_type": "dynamic", "factor": 4.0}, max_positions=ORIGINAL)
    inv_freq, attention = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=served)
    torch.testing.assert_close(_ours(config, served).cos, _hf_cos(inv_freq, attention, served), rtol=0, atol=1e-6)


def _served_against_hf(folder, model, max_model_len: int, lengths: list[int], steps: int) -> None:
    """Greedy decoding of prompts batched, each step's logits within TOL of HF's full forward pass."""
    runner = ModelRunner(RunnerConfig(model=str(folder), num_blocks=64, max_model_len=max_model_len))
    try:
        driver = PagedDriver(runner)
        prompts = random_prompts(256, lengths, seed=7)
        seqs = [driver.add(p) for p in prompts]
        logits = driver.step({s: len(p) for s, p in zip(seqs, prompts)})
        for step in range(steps):
            for s, row in zip(seqs, logits):
                with torch.no_grad():
                    ref = model(torch.tensor([driver.tokens[s]])).logits[0, -1]
                err = (row - ref).abs().max().item()
                assert err <= TOL, f"sequence {s} step {step}: max |logit error| {err}"
                assert int(row.argmax()) == int(ref.argmax())
                driver.tokens[s].append(int(row.argmax()))
            if step + 1 < steps:
                logits = driver.step({s: 1 for s in seqs})
    finally:
        runner.shutdown()


def test_a_yarn_model_past_its_original_context_is_hfs(tmp_path):
    model = random_hf_model(_llama(YARN[2]), seed=21)
    model.save_pretrained(tmp_path)
    _served_against_hf(tmp_path, model, 256, [9, 70, 120], 24)  # up to 144 tokens, past ORIGINAL


def test_a_dynamic_ntk_model_within_its_original_context_is_hfs_and_past_it_says_so(tmp_path, caplog):
    model = random_hf_model(_llama({"rope_type": "dynamic", "factor": 2.0}, max_positions=ORIGINAL), seed=22)
    model.save_pretrained(tmp_path)
    _served_against_hf(tmp_path, model, ORIGINAL, [9, 30], ORIGINAL - 30)
    with caplog.at_level(logging.WARNING):
        ModelRunner(RunnerConfig(model=str(tmp_path), num_blocks=8, max_model_len=4 * ORIGINAL)).shutdown()
    assert "dynamic NTK's original 64" in caplog.text
