"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's differences, each made in one place.

- GeGLU, the gate through tanh-approximated GELU: LlamaMLP, by the config's hidden_act;
- the embeddings scaled by sqrt(hidden_size), rounded to the model's dtype: LlamaModel, by embed_scale;
- RMSNorms that scale by (1 + weight): OffsetRMSNorm, which adds the one at load;
- a norm after the attention, and one before and one after the MLP, besides the input norm;
- the score scale query_pre_attn_scalar ** -0.5 and Gemma 2's attention soft-capping, inside the
  paged attention (every path: the CPU kernel and the torch ones);
- sliding-window layers alternating with global ones (ModelConfig.sliding_layers), each enforced by
  its layer's attention;
- Gemma 2's final logit soft-capping; Gemma 3's q/k norms (Qwen3's, with Gemma's norm) and its
  sliding layers' own rope theta (LlamaModel.local_rotary).

The fused C++ decode chains Llama's ops, so Gemma keeps the Python layers.
"""

from __future__ import annotations

import torch

from gpu_worker_svc.model.attention_metadata import AttentionMetadata
from gpu_worker_svc.model.config import ModelConfig
from gpu_worker_svc.model.families.llama import LlamaDecoderLayer, LlamaForCausalLM
from gpu_worker_svc.model.families.qwen3 import Qwen3Attention
from gpu_worker_svc.model.layers.layernorm import OffsetRMSNorm
from gpu_worker_svc.model.layers.smoothing import SmoothingGroup
from gpu_worker_svc.model.parallel import TPGroup


class Gemma2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__(cfg, tp, dtype, layer)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(h, eps, dtype)
        self.post_attention_layernorm = OffsetRMSNorm(h, eps, dtype)
        self.pre_feedforward_layernorm = OffsetRMSNorm(h, eps, dtype)
        self.post_feedforward_layernorm = OffsetRMSNorm(h, eps, dtype)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As Llama's, the residual added by the next norm; the attention's and the MLP's outputs each normed
        before they join it."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(rope, x, kv_cache, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3Attention(Qwen3Attention):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__(cfg, tp, dtype, layer)
        self.q_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_class = Gemma3Attention


class Gemma2ForCausalLM(LlamaForCausalLM):
    decoder_layer = Gemma2DecoderLayer
    fused_decode_computes_it = False  # decode_layers.cpp has neither Gemma's norms nor GeGLU

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__(cfg, tp, dtype, max_positions)
        self.model.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [N, vocab] on rank 0, soft-capped as HF caps them (Gemma 2); None on the other ranks."""
        logits = self.lm_head.compute_logits(hidden)
        cap = self.config.final_softcap
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def smoothing_groups(self) -> list[SmoothingGroup]:
        """As Llama's, but the MLP's input comes from the pre-feedforward norm."""
        groups = []
        for layer in self.model.layers:
            groups.append(SmoothingGroup(layer.self_attn.qkv_proj, layer.input_layernorm.divide_channels))
            groups.append(SmoothingGroup(layer.mlp.gate_up_proj, layer.pre_feedforward_layernorm.divide_channels))
            groups.append(SmoothingGroup(layer.mlp.down_proj, layer.mlp.divide_up_channels))
        groups.append(SmoothingGroup(self.lm_head, self.model.norm.divide_channels))
        return groups


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    decoder_layer = Gemma3DecoderLayer
