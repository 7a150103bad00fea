"""RMSNorm, with the residual add fused in (computed in float32, as HF does).

In float32 on CPU, for a decode step's few rows, it calls torch.rms_norm: one
dispatch instead of seven small ones (a decode step runs 61 norms), and bitwise
equal to HF's spelled-out form (tested). For a prefill's rows HF's form is far
faster (0.31 against 2.08 ms at 2048 rows, measured here). In bf16 torch.rms_norm
is not bitwise HF's, and on CUDA it may be a fused kernel, so those keep HF's form.
"""

from __future__ import annotations

import torch
from torch import nn

# torch.rms_norm's CPU path is the faster below this size (64 rows of 576), HF's form above it.
_FUSED_MAX_ELEMENTS = 64 * 576


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = lambda p, t, s=None: p.data.copy_(t.read())  # type: ignore[attr-defined]

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32 and not x.is_cuda and x.numel() < _FUSED_MAX_ELEMENTS:
            out = torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        else:
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)

    def check_paths_agree(self) -> None:
        """RuntimeError unless this machine's torch.rms_norm gives HF's form bitwise, at this size: a
        row's norm must not depend on how many rows share its step (batch invariance). Measured so on
        AVX2 for the hidden sizes of common models; another CPU or torch build may round otherwise."""
        g = torch.Generator().manual_seed(0)
        rows = torch.randn(2 * _FUSED_MAX_ELEMENTS // self.weight.numel() + 1, self.weight.numel(), generator=g)
        few = torch.cat([self(rows[i : i + 3]) for i in range(0, rows.shape[0], 3)])  # torch.rms_norm
        if not torch.equal(few, self(rows)):  # HF's form
            raise RuntimeError(
                "batch invariance does not hold with this machine's torch.rms_norm (it rounds "
                "otherwise than the norm of a prefill's rows): run without it"
            )

    def divide_channels(self, s: torch.Tensor) -> None:
        """Scale output channel j by 1 / s[j] (int8 smoothing moves s into the next layer's weight)."""
        self.weight.data /= s
