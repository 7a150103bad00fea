"""fp16 weights with fp32 arithmetic on CPU (fbgemm), behind `quantization="fp16"`.

fbgemm stores the packed weight in fp16 and widens it in registers (F16C), so a
decode step streams half the bytes of fp32 and its GEMM kernel is faster at small
batches too: ~2.5x fp32 for this model's shapes at batch 16. Only the weights are
rounded (11-bit mantissa, far finer than the Q4_1 codes the default model ships
with); activations and accumulation stay fp32.

Rows are not bit-identical across batch sizes: fbgemm's kernel for 1-2 row tails
rounds differently, as fp32 GEMMs also do. Tokens stay identical in practice, as
in fp32 mode; int8 is the mode with bitwise batch invariance.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker_svc.model.layers.int8 import require_fbgemm

# The overload itself: the packet would scan the arguments for the packed weight in Python first.
_FBGEMM_LINEAR_FP16 = torch.ops.quantized.linear_dynamic_fp16.default


class FP16Weight(nn.Module):
    """An fbgemm-packed fp16 copy of one linear layer's (sharded) weight."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        require_fbgemm("fp16")
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.float(), None)
        self.out_features = weight.shape[0]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # The model's activations are already 2-D fp32: no reshape or cast that would do nothing.
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        y = _FBGEMM_LINEAR_FP16(rows if rows.dtype == torch.float32 else rows.float(), self.packed)
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
