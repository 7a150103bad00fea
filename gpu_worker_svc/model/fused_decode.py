"""A decode step's decoder layers in one C++ call, where the model allows it (kernels/decode_layers.cpp).

On CPU the default model's batch-1 decode step spends about a third of its time in Python between
its ~600 small ops. Where every layer runs the ops that kernels/decode_layers.cpp chains (GGUF
weights, float32, one rank, no biases, the decode-attention kernel), a step of plain decodes
(one query each) runs them in one call instead. The op spells out families/llama.py's layers, op for op,
so a token's result is the same bits either way: a prefill, which keeps the Python layers, writes
the K/V a decode would have written, and the engine's determinism holds across the two (tested).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_worker_svc.model.attention_metadata import AttentionMetadata
from gpu_worker_svc.model.layers.attention import decode_contexts
from gpu_worker_svc.model.layers.gguf import GGUFWeight
from gpu_worker_svc.model.layers.kernels import cpu_kernels


@dataclass(frozen=True, slots=True)
class FusedDecode:
    """The layers' weights as the op takes them, gathered once after the model's weights are final."""

    op: Callable
    norms: list[torch.Tensor]  # per layer: input, post-attention
    panels: list[torch.Tensor]  # per layer: qkv, o, gate_up, down
    types: list[int]
    out_features: list[int]
    num_heads: int
    num_kv_heads: int
    scale: float
    eps: float

    @classmethod
    def of(cls, model: torch.nn.Module) -> FusedDecode | None:
        """For a LlamaModel whose every layer the op can run; None otherwise (the Python layers then run)."""
        op = cpu_kernels.llama_decode_layers()
        layers = list(model.layers)
        if op is None or not layers or model.embed_tokens.tp.world_size != 1:
            return None
        norms, panels, types, out_features = [], [], [], []
        for layer in layers:
            attn = layer.self_attn
            linears = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            weights = [linear.quant for linear in linears]
            if not attn.attn.cpu_kernel_fits or any(linear.bias is not None for linear in linears):
                return None
            paged = attn.attn
            if paged.window is not None or paged.softcap is not None or paged.scale != paged.head_dim**-0.5:
                return None  # the op chains plain causal attention at 1 / sqrt(head_dim)
            if any(not isinstance(w, GGUFWeight) or w.isa for w in weights):  # isa: a test's chosen build
                return None
            layer_norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(norm.weight.dtype != torch.float32 or norm.weight.device.type != "cpu" for norm in layer_norms):
                return None
            if layer_norms[0].weight.numel() % 16 or {n.eps for n in layer_norms} != {layers[0].input_layernorm.eps}:
                return None  # kernels/rms_norm.cpp takes rows of 16-float vectors; the op takes one eps
            norms += [norm.weight for norm in layer_norms]
            panels += [w.panels for w in weights]
            types += [int(w.qtype) for w in weights]
            out_features += [w.out_features for w in weights]
        first = layers[0].self_attn.attn
        return cls(
            op,
            norms,
            panels,
            types,
            out_features,
            first.num_heads,
            first.num_kv_heads,
            first.head_dim**-0.5,
            layers[0].input_layernorm.eps,
        )

    @staticmethod
    def fits(x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether the step is plain decodes, one query each, of float32 CPU rows."""
        return (
            not meta.prefill_bounds
            and meta.decode_queries == 1
            and not meta.invariant
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.dim() == 2
            and x.is_contiguous()
        )

    def __call__(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's output and residual, as the Python layers would return them."""
        slots, lengths = decode_contexts(meta)
        return self.op(
            x,
            self.norms,
            self.panels,
            self.types,
            self.out_features,
            rope[0],
            rope[1],
            kv_caches,
            meta.slot_mapping,
            slots,
            lengths,
            self.num_heads,
            self.num_kv_heads,
            self.scale,
            self.eps,
        )
