"""The tensor-parallel group a model shard belongs to.

Collectives are explicit calls made in the layers' `forward` (never hidden in
hooks), and every one is a no-op at TP=1 so the single-process path pays nothing.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(slots=True)
class TPGroup:
    """This process's rank and the size of its tensor-parallel group."""

    rank: int = 0
    world_size: int = 1
    # all_reduce adds the ranks' parts in rank order. Gloo's all-reduce adds them in an order that
    # depends on the tensor's size, so a row's sum would change with the rows beside it: batch
    # invariance needs this (at the cost of an all-gather's traffic).
    ordered: bool = False

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def shard(self, size: int) -> tuple[int, int]:
        """[start, end) of this rank's equal share of `size` (which must divide evenly)."""
        per = size // self.world_size
        return self.rank * per, (self.rank + 1) * per

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        if not self.ordered:
            dist.all_reduce(x)
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        total = parts[0]
        for part in parts[1:]:
            total += part
        return x.copy_(total)

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's `x` along the last dim, on rank 0 only (others get None)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_driver else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def all_reduce_min(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MIN)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.broadcast(x, src=0)
        return x


def init_tp_group(
    rank: int, world_size: int, init_method: str, device: str = "cpu", timeout_s: float = 600.0, ordered: bool = False
) -> TPGroup:
    """Join the process group; gloo on CPU, NCCL on CUDA."""
    if world_size > 1:
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "gloo":
            # Gloo picks an interface by hostname, which may not resolve in containers.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return TPGroup(rank=rank, world_size=world_size, ordered=ordered)


def destroy_tp_group(group: TPGroup) -> None:
    if group.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
