"""The model families' test cases: small random configs built by transformers, saved as safetensors, and
HF's greedy run of each (tokens and logits), shared by the model-level and the engine-level parity tests.
The Mixture-of-Experts cases have 4 to 8 experts, top-2, so at TP 2 each rank holds half the experts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from tests.gpu_worker_svc.model.random_checkpoints import random_hf_model, random_prompts

TOL = 1e-4  # max |ours - HF| over a step's logits, float32
LOGPROB_TOL = 1e-4  # max |ours - HF| of a sampled token's logprob, float32
GREEDY_STEPS = 32
PROMPT_LENGTHS = [1, 9, 40, 70]
_SHAPE = dict(hidden_size=64, intermediate_size=128, max_position_embeddings=256, pad_token_id=0, bos_token_id=1)

CASES: dict[str, PretrainedConfig] = {
    # head_dim 32 is not hidden / heads (16): Qwen3 takes it from the config.
    "qwen3-gqa4x2-headdim32-qknorm": Qwen3Config(
        vocab_size=251,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=3,
        tie_word_embeddings=False,
        eos_token_id=2,
        **_SHAPE,
    ),
    # attention_bias puts a bias on all four projections, o_proj's included (unlike Qwen2).
    "qwen3-mha4-attnbias-tied": Qwen3Config(
        vocab_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        num_hidden_layers=2,
        attention_bias=True,
        tie_word_embeddings=True,
        eos_token_id=2,
        **_SHAPE,
    ),
    # The fused qkv_proj and gate_up_proj split by heads and halves per rank, with an uneven vocab.
    "phi3-gqa4x2-fused-vocab250": Phi3Config(
        vocab_size=250,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=3,
        tie_word_embeddings=False,
        eos_token_id=2,
        **_SHAPE,
    ),
    "phi3-mha8-fused-tied": Phi3Config(
        vocab_size=256,
        num_attention_heads=8,
        num_key_value_heads=8,
        num_hidden_layers=2,
        tie_word_embeddings=True,
        eos_token_id=2,
        **_SHAPE,
    ),
    # Every layer sparse; the top-2 weights renormalised; experts intermediate_size wide.
    "mixtral-gqa4x2-8experts-top2": MixtralConfig(
        vocab_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        eos_token_id=2,
        **_SHAPE,
    ),
    # q/k norms, norm_topk_prob, and layer 1 dense (mlp_only_layers) between two sparse ones.
    "qwen3moe-gqa4x2-8experts-normtopk-denselayer1": Qwen3MoeConfig(
        vocab_size=251,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
        eos_token_id=2,
        **_SHAPE,
    ),
    # q/k/v biases, the sigmoid-gated shared expert, no renormalisation, every other layer sparse.
    "qwen2moe-mha4-4experts-shared-sparsestep2": Qwen2MoeConfig(
        vocab_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        decoder_sparse_step=2,
        tie_word_embeddings=True,
        eos_token_id=2,
        **_SHAPE,
    ),
    # A window of 12 keys, far shorter than the prompts (40, 70) and the 32 decoded tokens: every layer slides.
    "mistral-gqa4x2-window12": MistralConfig(
        vocab_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        sliding_window=12,
        tie_word_embeddings=False,
        eos_token_id=2,
        **_SHAPE,
    ),
    # Sliding layers (window 16) alternating with global ones; soft-capping small enough to bite (scores
    # and logits here are of order 1 to 10); query_pre_attn_scalar not head_dim; tied embeddings.
    "gemma2-gqa4x2-window16-softcaps": Gemma2Config(
        vocab_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=3,
        sliding_window=16,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=4.0,
        eos_token_id=2,
        attn_implementation="eager",  # HF's SDPA path cannot cap scores
        **_SHAPE,
    ),
    # Two sliding layers (window 10, their own rope theta) then a global one (theta 1e6, linear scaling),
    # q/k norms, head_dim 32 (not hidden / heads).
    "gemma3-gqa4x2-window10-qknorm": Gemma3TextConfig(
        vocab_size=250,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=3,
        sliding_window=10,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        query_pre_attn_scalar=32,
        eos_token_id=2,
        **_SHAPE,
    ),
}
MOE_CASES = [
    "mixtral-gqa4x2-8experts-top2",
    "qwen3moe-gqa4x2-8experts-normtopk-denselayer1",
    "qwen2moe-mha4-4experts-shared-sparsestep2",
]


@dataclass(slots=True)
class SavedModel:
    folder: Path
    prompts: list[list[int]]
    greedy: list[list[int]]  # HF's greedy continuation of each prompt, GREEDY_STEPS tokens
    logits: list[torch.Tensor]  # HF's logits at each position of prompt + continuation, [len, vocab]


@torch.no_grad()
def _hf_greedy(model: PreTrainedModel, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens (no EOS stop) and its logits at every position of the whole sequence."""
    ids = list(prompt)
    for _ in range(GREEDY_STEPS):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :], model(torch.tensor([ids])).logits[0].float()


def save_cases(tmp_path_factory: pytest.TempPathFactory, names: list[str]) -> dict[str, SavedModel]:
    """Each named case built with its own seed, saved by save_pretrained, with HF's greedy run of its prompts."""
    saved = {}
    for seed, (name, config) in enumerate(CASES.items()):
        if name not in names:
            continue
        model = random_hf_model(config, seed=seed + 40)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        prompts = random_prompts(config.vocab_size, PROMPT_LENGTHS, seed=seed + 40)
        refs = [_hf_greedy(model, p) for p in prompts]
        saved[name] = SavedModel(folder, prompts, [r[0] for r in refs], [r[1] for r in refs])
    return saved
