"""Swap a loaded model's linear weights for a quantized copy (`RunnerConfig.quantization`).

CPU modes, fastest first (SmolLM2-135M on a 2-core AVX2 machine, batch-16 decode step); "gguf",
the GGUF file's own blocks (model/gguf_weights.py, layers/gguf.py), is not a re-quantization and
is set up apart:
- "int8": 7-bit weights and per-token 8-bit activations through fbgemm's integer GEMM,
  with SmoothQuant smoothing calibrated at load. Rows are bitwise batch-invariant.
- "fp16": fp16 weights, fp32 arithmetic (fbgemm). Numerics within fp16 weight rounding.
- "int4": group-wise int4 weights through torch's packed int4 kernel (smallest weights).

Without one, float32 weights on CPU are still repacked for oneDNN
(`pack_fp32_for_onednn`): no rounding, only another summation order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gpu_worker_svc.model.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from gpu_worker_svc.model.layers.fp16 import FP16Weight
from gpu_worker_svc.model.layers.int4 import Int4Weight
from gpu_worker_svc.model.layers.int8 import Int8Weight
from gpu_worker_svc.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from gpu_worker_svc.model.layers.onednn import OneDNNWeight
from gpu_worker_svc.model.layers.smoothing import smooth

# The formats quantize_model makes; gpu_worker_svc/model/cpu_weight_formats.py names them with the others.
QUANTIZATIONS = {"int8": Int8Weight, "fp16": FP16Weight, "int4": Int4Weight}


def quantize_model(model: nn.Module, method: str, calibrate: Callable[[], None] | None = None) -> int:
    """Quantize every tensor-parallel linear layer and the LM head in place; returns how many.

    `calibrate` runs one full-precision prefill; int8 needs it to smooth activation outliers.
    """
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {sorted(QUANTIZATIONS)}, got {method!r}")
    scales = {}
    if method == "int8":
        if calibrate is None:
            raise ValueError("int8 quantization needs a calibration prefill")
        scales = smooth(model.smoothing_groups(), calibrate)
    return _swap_weights(
        model,
        lambda module, weight: QUANTIZATIONS[method](weight * scales[module][None, :] if module in scales else weight),
    )


def pack_fp32_for_onednn(model: nn.Module) -> int:
    """Give every linear layer and the LM head a oneDNN-packed copy of its fp32 weight; returns how many."""
    return _swap_weights(model, lambda module, weight: OneDNNWeight(weight))


def _swap_weights(model: nn.Module, make: Callable[[nn.Module, torch.Tensor], nn.Module]) -> int:
    # A tied LM head shares its weight with the embedding, whose lookups still need it.
    embeddings = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
    }
    count = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)) and module.quant is None:
            module.quant = make(module, module.weight.data)
            if id(module.weight) not in embeddings:
                module.weight = None
            count += 1
    return count
