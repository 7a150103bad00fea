"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2), built from tensor-parallel layers.

The other families whose maths differs from it in a few places (Qwen3's q/k norms, Phi-3's fused
checkpoint tensors) subclass these modules and override only those places (families/*.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker_svc.model.attention_metadata import AttentionMetadata
from gpu_worker_svc.model.checkpoint import CheckpointTensor
from gpu_worker_svc.model.config import ModelConfig
from gpu_worker_svc.model.fused_decode import FusedDecode
from gpu_worker_svc.model.layers.attention import PagedAttention
from gpu_worker_svc.model.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from gpu_worker_svc.model.layers.kernels import cpu_kernels
from gpu_worker_svc.model.layers.layernorm import RMSNorm
from gpu_worker_svc.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from gpu_worker_svc.model.layers.lora import LoraStep
from gpu_worker_svc.model.layers.rotary import RotaryEmbedding
from gpu_worker_svc.model.layers.smoothing import SmoothingGroup
from gpu_worker_svc.model.parallel import TPGroup


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.attention_bias, tp, dtype
        )
        # Llama's and Qwen3's attention_bias cover o_proj too; Qwen2 biases only q/k/v (config.py).
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_proj_bias, tp, dtype)
        self.attn = PagedAttention(
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            cfg.head_dim,
            cfg.attn_scale,
            cfg.window_of(layer),
            cfg.attn_softcap,
        )
        self.head_dim = cfg.head_dim

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.normalize_qk(self.qkv_proj(x))
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        heads, kv_heads = self.attn.num_heads, self.attn.num_kv_heads
        rope_writer = self.attn.rope_writer(qkv, kv_cache)
        if rope_writer is not None:  # CPU: one op rotates q and k and writes k and v into the cache
            q = rope_writer(qkv, rope[0], rope[1], meta.slot_mapping, kv_cache, heads, kv_heads)
            return self.o_proj(self.attn.attend(q, kv_cache, meta))
        # q and k sit side by side in qkv, so one rotary pass covers both.
        qk = RotaryEmbedding.apply(qkv[:, : q_size + kv_size].view(-1, heads + kv_heads, self.head_dim), rope)
        q, k = qk.split([heads, kv_heads], dim=1)
        v = qkv[:, q_size + kv_size :].view(-1, kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))

    def normalize_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """The projections as the rotary embedding takes them: Llama's as they are (Qwen3 normalizes q and k)."""
        return qkv


class LlamaMLP(nn.Module):
    """The SwiGLU MLP, intermediate_size wide unless `width` says otherwise (a MoE's shared expert); with
    reduce_results off it gives this rank's partial sum, for a block that all-reduces once for all."""

    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, width: int | None = None, reduce_results: bool = True
    ) -> None:
        super().__init__()
        n = width or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [n, n], False, tp, dtype)
        self.down_proj = RowParallelLinear(n, cfg.hidden_size, False, tp, dtype, reduce_results)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"  # Gemma's GeGLU; else SiLU (config.py allows no other)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        silu_mul = cpu_kernels.silu_mul() if not self.gelu and _cpu_rows(gate_up) else None
        if silu_mul is not None:  # CPU: one pass, kernels/silu_mul.cpp
            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act.mul_(up))  # in place: no second [T, n] buffer

    def divide_up_channels(self, s: torch.Tensor) -> None:
        """Scale down_proj's input channel j by 1 / s[j], through the up projection's row j."""
        up = slice(self.gate_up_proj.out_local // 2, None)
        self.gate_up_proj.weight.data[up] /= s[:, None]
        if self.gate_up_proj.bias is not None:
            self.gate_up_proj.bias.data[up] /= s


def _cpu_rows(x: torch.Tensor) -> bool:
    """Contiguous float32 rows on CPU [T, n]: what the CPU kernels take."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous()


class LlamaDecoderLayer(nn.Module):
    attention_class: type[LlamaAttention] = LlamaAttention

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = self.attention_class(cfg, tp, dtype, layer)
        # Gemma 3's sliding layers rotate with their own theta (LlamaModel.local_rotary).
        self.local_rope = cfg.rope_local_theta is not None and cfg.window_of(layer) is not None
        self.mlp = self.build_mlp(cfg, tp, dtype, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def build_mlp(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, layer_id: int) -> nn.Module:
        """Layer `layer_id`'s MLP: Llama's dense one (a MoE family's sparse layers take families/moe.py's)."""
        return LlamaMLP(cfg, tp, dtype)


class LlamaModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPGroup,
        dtype: torch.dtype,
        max_positions: int,
        layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer,
        fusable: bool = True,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        # One rotary table for all layers (the largest buffer after the weights), gathered once per step.
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype, cfg.rope_freq_factors
        )
        # Gemma 3's second table, for its sliding layers: their own theta, unscaled.
        self.local_rotary = (
            RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_local_theta, None, dtype)
            if cfg.rope_local_theta is not None
            else None
        )
        # Gemma: sqrt(hidden), rounded to the model's dtype first, as HF's; None: no scale.
        self.embed_scale = float(torch.tensor(cfg.embed_scale, dtype=dtype)) if cfg.embed_scale is not None else None
        self.layers = nn.ModuleList(layer_class(cfg, tp, dtype, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.fused_decode: FusedDecode | None = None  # set by fuse_decode, once the weights are final
        # Each token's LoRA adapter in the running step (model/lora_slots.py); None: no adapter slots.
        self.lora_step: LoraStep | None = None
        # Whether the layers compute exactly what the C++ op chains (a family with other maths says no).
        self.fusable = fusable

    def fuse_decode(self) -> bool:
        """Run the layers of plain decode steps in one C++ call where they allow it (fused_decode.py).
        Call it again after any change to the weights; returns whether it applies."""
        self.fused_decode = FusedDecode.of(self) if self.fusable else None
        return self.fused_decode is not None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list[torch.Tensor]
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        if self.embed_scale is not None:
            x = x * self.embed_scale
        rope = self.rotary.prepare(positions)  # once per step, shared by every layer
        # The fused C++ decode knows no LoRA: a step with adapters runs the Python layers.
        lora = self.lora_step is not None and self.lora_step.active
        if self.fused_decode is not None and not lora and self.fused_decode.fits(x, meta):
            x, residual = self.fused_decode(x, rope, kv_caches, meta)
        else:
            local = self.local_rotary.prepare(positions) if self.local_rotary is not None else rope
            for layer, kv_cache in zip(self.layers, kv_caches):
                x, residual = layer(local if layer.local_rope else rope, x, residual, kv_cache, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """The Llama family's causal LM, and the base of the families that differ from it in a few modules:
    a subclass names its decoder layer and whether the fused C++ decode computes its maths."""

    decoder_layer: type[LlamaDecoderLayer] = LlamaDecoderLayer
    fused_decode_computes_it = True
    captures_decode = True  # whether a CUDA graph can capture a decode step (engine/cuda_graphs.py)
    # Checkpoint names that load into a fused parameter: name -> (fused name, shard id).
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        cfg.check_tp(tp.world_size)
        self.config = cfg
        self.tp = tp
        self.model = LlamaModel(cfg, tp, dtype, max_positions, self.decoder_layer, self.fused_decode_computes_it)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def checkpoint_tensors(tensors: Iterator[CheckpointTensor], cfg: ModelConfig) -> Iterator[CheckpointTensor]:
        """The checkpoint's tensors under the names packed_modules_mapping knows (Phi-3 splits its fused ones)."""
        return tensors

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list[torch.Tensor]
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [N, vocab] on rank 0; None on the other ranks."""
        return self.lm_head.compute_logits(hidden)

    def attention(self) -> PagedAttention:
        """This rank's attention, whose shapes (heads, KV heads, head size) every layer shares."""
        layer: LlamaDecoderLayer = self.model.layers[0]  # type: ignore[assignment]  # a ModuleList's item
        return layer.self_attn.attn

    def smoothing_groups(self) -> list[SmoothingGroup]:
        """The linear layers whose input channels a producer can rescale (see layers/smoothing.py).

        o_proj has no such producer without per-head bookkeeping, and its inputs have few outliers.
        """
        groups = []
        for layer in self.model.layers:
            groups.append(SmoothingGroup(layer.self_attn.qkv_proj, layer.input_layernorm.divide_channels))
            # A MoE layer's norm feeds its router and experts too, which no smoothing scale reaches.
            if isinstance(layer.mlp, LlamaMLP):
                groups.append(SmoothingGroup(layer.mlp.gate_up_proj, layer.post_attention_layernorm.divide_channels))
                groups.append(SmoothingGroup(layer.mlp.down_proj, layer.mlp.divide_up_channels))
        groups.append(SmoothingGroup(self.lm_head, self.model.norm.divide_channels))
        return groups
