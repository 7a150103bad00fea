"""Megatron-style tensor-parallel linear layers.

Each parameter carries a `weight_loader(param, tensor, shard_id)` that reads only
this rank's slice of a checkpoint tensor, so no rank ever materialises the full
model. Checkpoint tensors are `CheckpointTensor`s: `.shape` plus `.read(dim, start, end)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker_svc.model.layers.lora import LoraSlots
from gpu_worker_svc.model.parallel import TPGroup


def _new_param(shape: tuple[int, ...], dtype: torch.dtype, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows: each rank computes its slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.out_local = out_features // tp.world_size
        self.weight = _new_param((self.out_local, in_features), dtype, self.weight_loader)
        self.bias = _new_param((self.out_local,), dtype, self.weight_loader) if bias else None
        self.quant = None  # a quantized copy of the weight, set by quantize_model
        self.lora: LoraSlots | None = None  # LoRA adapters' slots, set by LoraModelSlots

    def weight_loader(self, param: nn.Parameter, tensor, shard_id=None) -> None:
        start, end = self.tp.shard(tensor.shape[0])
        param.data.copy_(tensor.read(0, start, end))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            y = self.quant.matmul(x)
            y = y if self.bias is None else y + self.bias
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora.add_to(y, x)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one matmul (gate and up projections)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPGroup, dtype: torch.dtype) -> None:
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias, tp, dtype)

    def weight_loader(self, param: nn.Parameter, tensor, shard_id: int) -> None:
        local = [s // self.tp.world_size for s in self.out_sizes]
        offset = sum(local[:shard_id])
        start, end = self.tp.shard(self.out_sizes[shard_id])
        param.data[offset : offset + local[shard_id]].copy_(tensor.read(0, start, end))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by heads. KV heads are replicated when TP exceeds their count."""

    def __init__(
        self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, tp: TPGroup, dtype: torch.dtype
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.world_size
        self.num_kv_heads = max(1, num_kv_heads // tp.world_size)
        # With fewer KV heads than ranks, groups of ranks share (replicate) one KV head.
        self.kv_head_start = (
            (tp.rank * num_kv_heads) // tp.world_size if num_kv_heads < tp.world_size else tp.rank * self.num_kv_heads
        )
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        nn.Module.__init__(self)
        self.tp = tp
        out_local = self.q_size + 2 * self.kv_size
        self.weight = _new_param((out_local, hidden), dtype, self.weight_loader)
        self.bias = _new_param((out_local,), dtype, self.weight_loader) if bias else None
        self.quant = None
        self.lora = None

    def weight_loader(self, param: nn.Parameter, tensor, shard_id: str) -> None:
        if shard_id == "q":
            start, offset, size = self.tp.rank * self.q_size, 0, self.q_size
        else:
            start = self.kv_head_start * self.head_dim
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size = self.kv_size
        param.data[offset : offset + size].copy_(tensor.read(0, start, start + size))


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns; partial sums are all-reduced.

    The bias is added on rank 0 only, before the all-reduce, so it is counted once. With reduce_results
    off, forward gives this rank's partial sum, for a caller that adds it to others before one all-reduce.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.reduce_results = reduce_results
        self.weight = _new_param((out_features, in_features // tp.world_size), dtype, self.weight_loader)
        self.bias = _new_param((out_features,), dtype, self.weight_loader) if bias else None
        self.quant = None  # a quantized copy of the weight, set by quantize_model
        self.lora: LoraSlots | None = None  # LoRA adapters' slots (TP 1 only), set by LoraModelSlots

    def weight_loader(self, param: nn.Parameter, tensor, shard_id=None) -> None:
        if param.dim() == 1:
            param.data.copy_(tensor.read())
            return
        start, end = self.tp.shard(tensor.shape[1])
        param.data.copy_(tensor.read(1, start, end))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp.is_driver else None
        if self.quant is not None:
            y = self.quant.matmul(x)
            y = y if bias is None else y + bias
        else:
            y = F.linear(x, self.weight, bias)
        if self.lora is not None:
            y = self.lora.add_to(y, x)
        return self.tp.all_reduce(y) if self.reduce_results else y
