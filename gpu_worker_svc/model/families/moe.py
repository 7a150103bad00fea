"""The Mixture-of-Experts decoder shared by the MoE families, and Qwen2-MoE, which is that decoder as it is.

Attention is Llama's (families/llama.py; Qwen3-MoE swaps in Qwen3's q/k norms), and each layer the
config marks sparse (ModelConfig.is_moe_layer) takes layers/moe.py's block instead of the dense MLP:
the router's top-k with the family's renormalisation, this rank's share of the experts, and Qwen2-MoE's
sigmoid-gated shared expert, all added by one all-reduce. Qwen2-MoE's q/k/v biases and shared expert
come from its config, so its class is this module's.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker_svc.model.config import ModelConfig
from gpu_worker_svc.model.families.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from gpu_worker_svc.model.layers.moe import SparseMoeBlock
from gpu_worker_svc.model.parallel import TPGroup


class MoeDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, layer_id: int) -> nn.Module:
        if not cfg.is_moe_layer(layer_id):
            return LlamaMLP(cfg, tp, dtype)
        shared = cfg.shared_expert_intermediate_size
        return SparseMoeBlock(
            cfg.hidden_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            cfg.norm_topk_prob,
            tp,
            dtype,
            LlamaMLP(cfg, tp, dtype, width=shared, reduce_results=False) if shared else None,
        )


class MoeForCausalLM(LlamaForCausalLM):
    """A Mixture-of-Experts causal LM with Llama's attention (Qwen2-MoE; the base of Mixtral and Qwen3-MoE)."""

    decoder_layer = MoeDecoderLayer
    fused_decode_computes_it = False  # decode_layers.cpp chains a dense MLP
    # The dispatch reads each expert's token count on the host (outside bf16's grouped GEMM, which
    # reads none but has not yet been captured on a GPU): decode steps run eagerly on CUDA.
    captures_decode = False
