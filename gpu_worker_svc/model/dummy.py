"""Random weights in a real model's shape (vLLM's `--load-format dummy`), for GPU benchmarks.

`dummy:<shape>` as the model name selects one of the shapes below; no file is read.
"""

from __future__ import annotations

import torch

from gpu_worker_svc.model.config import ModelConfig
from gpu_worker_svc.model.families.llama import LlamaForCausalLM

DUMMY_PREFIX = "dummy:"

SHAPES: dict[str, ModelConfig] = {
    # So small that a step's model compute is negligible: what is left is the engine's host work.
    "tiny": ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_ids=[2],
        name="dummy-tiny",
    ),
    "smollm2-135m": ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        eos_token_ids=[2],
        name="dummy-smollm2-135m",
    ),
    "llama-3.2-1b": ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        eos_token_ids=[128001],
        name="dummy-llama-3.2-1b",
    ),
}


def is_dummy(model: object) -> bool:
    return isinstance(model, str) and model.startswith(DUMMY_PREFIX)


def dummy_config(model: str) -> ModelConfig:
    shape = model[len(DUMMY_PREFIX) :]
    if shape not in SHAPES:
        raise ValueError(f"unknown dummy shape {shape!r}; known: {', '.join(SHAPES)}")
    return SHAPES[shape]


@torch.no_grad()
def init_dummy_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Small random weights (std 0.02) so activations stay finite; norms at 1."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed + model.tp.rank)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=g)
