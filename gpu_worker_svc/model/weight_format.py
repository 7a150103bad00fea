"""Which weight format a worker runs when its setting is "auto" (the default).

A .gguf model on CPU keeps the file's own Q4_0/Q4_1/Q8_0 blocks ("gguf"): a decode step reads 4.5
to 8.5 bits a weight instead of 32, and the kernels' batched products beat fp32 oneDNN at every
batch size measured (docs/benchmarks.md, "CPU weight formats"). Anything else, or a machine where
the kernels cannot be built, runs the model's dtype.
"""

from __future__ import annotations

import logging

import torch

from gpu_worker_svc.model.dummy import is_dummy
from gpu_worker_svc.model.layers.kernels import cpu_kernels
from shardline.core.model_path import resolve_model_path

log = logging.getLogger(__name__)


def resolve_weight_format(quantization: str | None, model: str | None, device: str, dtype: torch.dtype) -> str | None:
    """The format to load: None for the model's dtype, else a CPU_WEIGHT_FORMATS name.

    `quantization` None and "none" both mean the model's dtype; "auto" picks (see the module docstring).
    """
    if quantization in (None, "none"):
        return None
    if quantization != "auto":
        return quantization
    if device != "cpu" or dtype != torch.float32 or is_dummy(model) or resolve_model_path(model).suffix != ".gguf":
        return None
    if cpu_kernels.gguf_linear() is None:
        log.warning("weights: the GGUF kernels cannot be built here, so the model runs dequantized to fp32")
        return None
    return "gguf"
