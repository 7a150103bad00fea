"""RMSNorm, with the residual add fused in (computed in float32, as HF does).

In float32 on CPU it is one op, kernels/rms_norm.cpp, for any number of rows: a decode step runs
61 norms, and torch.rms_norm is a composite of seven small ops (~25 us a call; 1.4 ms of an 11 ms
step). Where the kernels cannot be built, a decode step's few rows call torch.rms_norm, bitwise
equal to HF's spelled-out form (tested), and a prefill's take HF's form, far faster there (0.31
against 2.08 ms at 2048 rows). In bf16 torch.rms_norm is not bitwise HF's, and on CUDA it may be
a fused kernel, so those keep HF's form.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker_svc.model.layers.kernels import cpu_kernels

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
        kernels = cpu_kernels.rms_norm() if self._kernel_fits(x, residual) else None
        if kernels is not None:  # one op for the add and the norm, whatever the row count
            if residual is None:
                return kernels[0](x, self.weight, self.eps)
            out, residual = kernels[1](x, residual, self.weight, self.eps)
            return out, residual
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

    def _kernel_fits(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """kernels/rms_norm.cpp takes contiguous float32 rows on CPU whose size is a multiple of 16."""
        return (
            x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.dim() == 2
            and x.is_contiguous()
            and self.weight.dtype == torch.float32
            and x.shape[1] % 16 == 0
            and (residual is None or (residual.is_contiguous() and residual.shape == x.shape))
        )

    def check_paths_agree(self) -> None:
        """RuntimeError unless a row's norm is the same bits in a step of 3 rows as in one of many, at
        this size (batch invariance). The kernel takes both; without it, torch.rms_norm must give HF's
        form bitwise: measured so on AVX2 for the hidden sizes of common models, but another CPU or
        torch build may round otherwise."""
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


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm, which scales by (1 + weight): the one is added to the checkpoint's weight at load, so
    the norm is RMSNorm's, kernels included. HF adds it in float32 at each call; in float32 that is the
    same, in bfloat16 the sum is rounded to the model's dtype once."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__(hidden, eps, dtype)
        self.weight.weight_loader = lambda p, t, s=None: p.data.copy_(t.read().float() + 1)  # type: ignore[attr-defined]
