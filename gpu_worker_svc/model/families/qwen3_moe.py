"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm per head) over families/moe.py's Mixture-of-Experts decoder.

Its router renormalises the top-k weights when the config sets norm_topk_prob; layers listed in
mlp_only_layers, or off the decoder_sparse_step grid, keep a dense MLP (ModelConfig.is_moe_layer).
"""

from __future__ import annotations

from gpu_worker_svc.model.families.moe import MoeDecoderLayer, MoeForCausalLM
from gpu_worker_svc.model.families.qwen3 import Qwen3Attention


class Qwen3MoeDecoderLayer(MoeDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3MoeForCausalLM(MoeForCausalLM):
    decoder_layer = Qwen3MoeDecoderLayer
