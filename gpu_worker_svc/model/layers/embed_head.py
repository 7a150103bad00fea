"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker_svc.model.parallel import TPGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        # Pad so every rank holds the same number of rows, which gather() needs.
        self.per_rank = -(-vocab_size // tp.world_size)
        self.vocab_start = tp.rank * self.per_rank
        self.vocab_end = min(self.vocab_start + self.per_rank, vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.quant = None  # the LM head's quantized copy, set by quantize_model

    def weight_loader(self, param: nn.Parameter, tensor, shard_id=None) -> None:
        n = self.vocab_end - self.vocab_start
        if n > 0:
            param.data[:n].copy_(tensor.read(0, self.vocab_start, self.vocab_end))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        in_shard = (ids >= self.vocab_start) & (ids < self.vocab_end)
        out = F.embedding((ids - self.vocab_start) * in_shard, self.weight) * in_shard.unsqueeze(-1)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Computes this rank's slice of the logits; rank 0 gathers the full row."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        local = self.quant.matmul(hidden) if self.quant is not None else F.linear(hidden, self.weight)
        logits = self.tp.gather_last_dim(local)
        return None if logits is None else logits[..., : self.vocab_size]
