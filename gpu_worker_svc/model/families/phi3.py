"""Phi-3: the Llama decoder's maths, with q/k/v and gate/up fused into one tensor each in the checkpoint.

The model's own qkv_proj and gate_up_proj are already fused, but split by heads (and by halves) per
tensor-parallel rank, so the checkpoint's fused tensors are cut back into the q, k, v, gate and up
row ranges they hold: each rank then reads only its own rows of each, as for a Llama checkpoint.
LongRoPE scaling (Phi-3's 128k models) is the rotary embedding's (layers/rotary.py).
"""

from __future__ import annotations

from collections.abc import Iterator

from gpu_worker_svc.model.checkpoint import CheckpointTensor, split_rows
from gpu_worker_svc.model.config import ModelConfig
from gpu_worker_svc.model.families.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def checkpoint_tensors(tensors: Iterator[CheckpointTensor], cfg: ModelConfig) -> Iterator[CheckpointTensor]:
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        for tensor in tensors:
            if ".self_attn.qkv_proj." in tensor.name:
                yield from split_rows(tensor, "qkv_proj", [("q_proj", q), ("k_proj", kv), ("v_proj", kv)])
            elif ".mlp.gate_up_proj." in tensor.name:
                yield from split_rows(tensor, "gate_up_proj", [("gate_proj", inter), ("up_proj", inter)])
            else:
                yield tensor
