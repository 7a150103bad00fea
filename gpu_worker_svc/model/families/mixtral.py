"""Mixtral: every layer sparse, with the top-k routing weights renormalised (the softmax over the k chosen).

Its checkpoint names the MoE block `block_sparse_moe` and each expert's projections w1 (gate), w3 (up)
and w2 (down); they are read under Qwen-MoE's names, which families/moe.py's modules carry.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from gpu_worker_svc.model.checkpoint import CheckpointTensor
from gpu_worker_svc.model.config import ModelConfig
from gpu_worker_svc.model.families.moe import MoeForCausalLM

_EXPERT = re.compile(r"\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclass(slots=True)
class RenamedTensor:
    """A checkpoint tensor read as it is, under another name."""

    name: str
    source: CheckpointTensor

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    def read(self, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        return self.source.read(dim, start, end)


def mixtral_name(name: str) -> str:
    """`...block_sparse_moe.experts.3.w3.weight` -> `...mlp.experts.3.up_proj.weight`; the router likewise."""
    name = _EXPERT.sub(lambda m: f".mlp.experts.{m[1]}.{_PARTS[m[2]]}.weight", name)
    return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")


class MixtralForCausalLM(MoeForCausalLM):
    @staticmethod
    def checkpoint_tensors(tensors: Iterator[CheckpointTensor], cfg: ModelConfig) -> Iterator[CheckpointTensor]:
        for tensor in tensors:
            name = mixtral_name(tensor.name)
            yield tensor if name == tensor.name else RenamedTensor(name, tensor)
