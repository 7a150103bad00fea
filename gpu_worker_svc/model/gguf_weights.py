"""Gives a loaded model the GGUF file's own Q4_0, Q4_1 and Q8_0 blocks, for `quantization="gguf"`.

Each linear layer and the LM head whose checkpoint tensors are all of one of those types gets a
GGUFWeight (layers/gguf.py) built from the file's bytes, and drops its fp32 copy. The layers' own
weight loaders place the rows, so tensor-parallel shards, fused q/k/v and gate/up, and llama.cpp's
Q/K row order come out as they do for the fp32 weights; a block never straddles two ranks (blocks run
along the input dimension, so a row-parallel shard must start on a block). Other tensor types, and
layers that cannot be cut on blocks, keep the fp32 weights of the ordinary load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from gpu_worker_svc.model.checkpoint import GGUFCheckpoint, GGUFCheckpointTensor, open_checkpoint, unpermute_rows
from gpu_worker_svc.model.layers.embed_head import ParallelLMHead
from gpu_worker_svc.model.layers.gguf import KERNEL_TYPES, GGUFWeight, block_row_bytes
from gpu_worker_svc.model.layers.kernels import cpu_kernels
from gpu_worker_svc.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from gpu_worker_svc.model.loader import fused_parameter
from shardline.core.model_path import resolve_model_path

log = logging.getLogger(__name__)


@dataclass(slots=True)
class BlockRows:
    """A checkpoint tensor read as its raw blocks: `read` takes element indices, as the layers' weight
    loaders give them, and returns uint8 rows of whole blocks."""

    tensor: GGUFCheckpointTensor
    qtype: GGMLQuantizationType

    @property
    def shape(self) -> tuple[int, ...]:
        return self.tensor.shape

    def read(self, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        t = self.tensor
        if dim == 1:
            block, size = GGML_QUANT_SIZES[self.qtype]
            end = t.shape[1] if end is None else end
            if start % block or end % block:
                raise ValueError(f"{t.name}: columns {start}..{end} do not fall on {self.qtype.name} blocks")
            rows = t.file.raw_rows(t.gguf_name).reshape(t.shape[0], -1)[:, start // block * size : end // block * size]
        else:
            rows = t.file.raw_rows(t.gguf_name, start, end if dim == 0 else None).reshape(-1, self._row_bytes())
        if t.unpermute_head_dim is not None:
            rows = unpermute_rows(rows, t.unpermute_head_dim)
        return torch.from_numpy(np.array(rows))  # a copy: the file's map is read-only

    def _row_bytes(self) -> int:
        return block_row_bytes(self.qtype, self.tensor.shape[1])


def load_gguf_blocks(model: nn.Module, model_path: str | Path | None) -> int:
    """Swap in GGUFWeights wherever the file's blocks fit (see the module docstring); returns how many."""
    if cpu_kernels.gguf_linear() is None:
        log.warning("quantization gguf: the CPU kernels cannot be built here, so the weights stay fp32")
        return 0
    path = resolve_model_path(model_path)
    ckpt = open_checkpoint(path)
    if not isinstance(ckpt, GGUFCheckpoint):
        raise ValueError(f"quantization gguf needs a .gguf model, not {path}")
    cfg = model.config
    modules = {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)) and m.quant is None
    }
    parts: dict[str, list[tuple[BlockRows, object]]] = {}
    for tensor in ckpt.tensors(cfg):
        name = tensor.name
        # A tied head shares the embedding's tensor: the head multiplies it, the embedding looks rows up.
        if cfg.tie_word_embeddings and name == "model.embed_tokens.weight":
            name = "lm_head.weight"
        name, shard_id = fused_parameter(name)
        module_name, kind = name.rsplit(".", 1)
        if kind == "weight" and module_name in modules:
            qtype = ckpt.file.tensors[tensor.gguf_name].qtype
            parts.setdefault(module_name, []).append((BlockRows(tensor, qtype), shard_id))
    count = 0
    for module_name, shards in parts.items():
        module = modules[module_name]
        qtypes = {rows.qtype for rows, _ in shards}
        if len(qtypes) != 1 or (qtype := qtypes.pop()) not in KERNEL_TYPES:
            continue
        out_features, in_features = module.weight.shape
        try:
            # Zeros: the rows a vocab-padded head holds past the vocabulary stay zero blocks (scale 0).
            blocks = torch.zeros(out_features, block_row_bytes(qtype, in_features), dtype=torch.uint8)
            for rows, shard_id in shards:
                module.weight_loader(blocks, rows, shard_id)
        except ValueError as exc:
            log.info("%s keeps fp32 weights: %s", module_name, exc)
            continue
        module.quant = GGUFWeight(qtype, blocks, in_features)
        if not isinstance(module, ParallelLMHead) or not cfg.tie_word_embeddings:
            module.weight = None  # the tied embedding's lookups still need the fp32 rows
        count += 1
    return count
