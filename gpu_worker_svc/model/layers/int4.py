"""Int4 weight-only linear layers for CPU (gpt-fast style), behind `quantization="int4"`.

On a CPU decode step the weights are the traffic: fp32 weights stream ~540 MB per
step for the default model, which bounds a batch-1 step by memory bandwidth and a
batch-16 step by fp32 GEMM speed. Groups of 32 weights along the input dimension
are stored as 4-bit codes with a bf16 scale and zero each (the shape of GGUF's
Q4_1 blocks), and torch's packed int4 CPU kernel computes x_bf16 @ W^T from them.
Rows are independent in that kernel, so batch invariance (and with it the
engine's determinism) holds; numerics are bf16-level, not fp32 parity.
"""

from __future__ import annotations

import torch
from torch import nn

GROUP_SIZE = 32


def quantize_int4(w: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric per-group 4-bit codes of `w` [N, K]: (packed uint8 [N, K/2], scales and zeros bf16 [K/G, N, 2])."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4 needs the input dimension ({k}) to be a multiple of {group_size}")
    groups = w.float().view(n, k // group_size, group_size)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    codes = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
    # The kernel decodes (code - 8) * scale + zero, so the zero point sits at the group's middle.
    scales_zeros = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), scales_zeros


class Int4Weight(nn.Module):
    """A packed int4 replacement for one linear layer's (sharded) weight."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        packed, scales_zeros = quantize_int4(weight)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_zeros", scales_zeros, persistent=False)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]).to(torch.bfloat16), self.packed, GROUP_SIZE, self.scales_zeros
        )
        return y.to(x.dtype).view(*shape[:-1], -1)
