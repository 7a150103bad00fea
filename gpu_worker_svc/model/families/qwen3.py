"""Qwen3: the Llama decoder with an RMSNorm over each query and key head before the rotary embedding.

Qwen3 has no q/k/v biases by default (attention_bias covers all four projections when set) and takes
head_dim from its config, which need not be hidden_size / num_heads; both come through ModelConfig.
The fused C++ decode chains Llama's ops, without the q/k norms, so Qwen3 keeps the Python layers.
"""

from __future__ import annotations

import torch

from gpu_worker_svc.model.config import ModelConfig
from gpu_worker_svc.model.families.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from gpu_worker_svc.model.layers.layernorm import RMSNorm
from gpu_worker_svc.model.parallel import TPGroup


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__(cfg, tp, dtype, layer)
        # One weight of head_dim each, shared by every head, so every rank holds it whole.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def normalize_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [T, q + 2 kv] with each q and k head normalized: the heads of all tokens as the rows of one norm."""
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.head_dim))
        k = self.k_norm(k.reshape(-1, self.head_dim))
        assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)  # no residual: one tensor back
        return torch.cat([q.view(-1, q_size), k.view(-1, kv_size), v], dim=-1)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer = Qwen3DecoderLayer
    fused_decode_computes_it = False  # decode_layers.cpp has no q/k norm
