"""Int8 weights with per-token int8 activations (W8A8) on CPU, behind `quantization="int8"`.

On this class of CPU (AVX2, no AVX-512) a batch-16 decode step of fp32 GEMMs costs
~110 ms, and torch's int4 kernel is no faster at that batch, because it dequantizes
to bf16 and AVX2 has no bf16 arithmetic. fbgemm's u8 x s8 integer GEMM does 4-5x
better at batch 16 and ~2.5x at batch 1 for this model's shapes.

Batch invariance (the engine's determinism rests on it) needs care: fbgemm's own
dynamic linear picks one activation scale for the whole batch, so a row's result
would depend on its batch-mates. Here each row is first divided by its own absmax,
which puts every row in [-1, 1], and then quantized with one fixed scale. The int32
accumulation is exact and the rest is elementwise, so row i's output depends on row
i alone.

AVX2's vpmaddubsw adds pairs of u8 x s8 products into int16 with saturation, so
the two code ranges must keep 2 * max|a| * max|w| < 2**15. Activations get the 8
bits (codes 1..255 around 128) and weights 7 (symmetric per output channel, +-63):
2 * 255 * 63 = 32130, so it never saturates. That split measured 3x closer to fp32
than 7-bit activations with 8-bit weights; the remaining error is activation
outliers, which `smoothing.py` moves into the weights first.

Large batches (prefill chunks of `ONEDNN_MIN_ROWS` rows or more) go to oneDNN's
int8 GEMM on the same codes instead: ~20% faster than fbgemm at 2048 rows, slower
below ~512. Both accumulate exactly in int32 and apply the same two scales, and on AVX2
their results are bitwise equal, so batch invariance holds across the switch. On
AVX-512 (an AMD EPYC with VNNI, measured) they are not: a third of the outputs differ
in the last bit. Each process therefore checks the two kernels against each other once
(`onednn_int8_agrees`) and leaves oneDNN out where they differ.
The cost is a second packed copy of the int8 weights.
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Rows scaled to [-1, 1] map onto codes 1..255 around a zero point of 128.
_ACT_SCALE = 1 / 127
_ACT_ZERO_POINT = 128
_WEIGHT_QMAX = 63
# Rows from which oneDNN's int8 GEMM beats fbgemm's (measured on AVX2 for this model's shapes).
ONEDNN_MIN_ROWS = 512
# The ops' overloads, called directly: through the overload packet an op that takes a packed
# (torchbind) weight first scans its arguments in Python, ~9 us a call, ~1 ms of a decode step.
# (ModelRunner's step also turns off the __torch_function__ check that such a weight makes costly.)
_FBGEMM_LINEAR = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32.default


def require_fbgemm(mode: str) -> None:
    """fbgemm (torch's x86 backend for the int8 and fp16 kernels) needs an x86 CPU with AVX2."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError(f"quantization {mode} needs torch's fbgemm backend (an x86 CPU with AVX2)")


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel 7-bit codes (int8 storage) of `w` [N, K] and their fp32 scales [N]."""
    scale = (w.float().abs().amax(1) / _WEIGHT_QMAX).clamp(min=1e-10)
    codes = (w.float() / scale[:, None]).round().clamp(-_WEIGHT_QMAX, _WEIGHT_QMAX).to(torch.int8)
    return codes, scale


class Int8Weight(nn.Module):
    """fbgemm-packed int8 weights replacing one linear layer's (sharded) weight."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        require_fbgemm("int8")
        codes, scale = quantize_int8(weight)
        self.packed = self.packed_fbgemm(codes, scale)
        self.out_features = weight.shape[0]
        self.onednn = _OneDNNInt8.try_pack(codes, scale) if onednn_int8_agrees() else None

    @staticmethod
    def packed_fbgemm(codes: torch.Tensor, scale: torch.Tensor) -> torch.ScriptObject:
        """int8 codes and their per-channel scales, packed for fbgemm's GEMM."""
        with warnings.catch_warnings():  # quantized tensors are deprecated, but fbgemm's prepack still takes one
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch._make_per_channel_quantized_tensor(
                codes, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0
            )
        previous = torch.backends.quantized.engine
        torch.backends.quantized.engine = "fbgemm"  # the packed weight keeps the backend it was packed for
        try:
            return torch.ops.quantized.linear_prepack(qweight, None)
        finally:
            torch.backends.quantized.engine = previous

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step makes 121 of these calls; the model's activations are already 2-D fp32, and
        # skipping the reshape and casts that do nothing saves ~4% of a batch-1 step.
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if rows.dtype != torch.float32:
            rows = rows.float()
        absmax = rows.abs().amax(-1, keepdim=True).clamp_(min=1e-10)
        unit_rows = rows / absmax
        if self.onednn is not None and rows.shape[0] >= ONEDNN_MIN_ROWS:
            y = self.onednn.matmul(unit_rows)
        else:
            y = _FBGEMM_LINEAR(unit_rows, _ACT_SCALE, _ACT_ZERO_POINT, self.packed)
        y = y.mul_(absmax)
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)


@functools.cache
def onednn_int8_agrees() -> bool:
    """Whether oneDNN's int8 GEMM gives fbgemm's results bit for bit on this CPU and torch build,
    checked once per process on this model family's shapes (a few ms): where it does not, a row's
    output would change with the size of its batch, and fbgemm takes every batch."""
    generator = torch.Generator().manual_seed(5)
    for n, k in ((960, 576), (3072, 576), (576, 1536)):
        codes, scale = quantize_int8(torch.randn(n, k, generator=generator))
        onednn = _OneDNNInt8.try_pack(codes, scale)
        if onednn is None:
            return False
        rows = torch.randn(ONEDNN_MIN_ROWS, k, generator=generator)
        unit_rows = rows / rows.abs().amax(-1, keepdim=True).clamp_(min=1e-10)
        weight = Int8Weight.packed_fbgemm(codes, scale)
        if not torch.equal(onednn.matmul(unit_rows), _FBGEMM_LINEAR(unit_rows, _ACT_SCALE, _ACT_ZERO_POINT, weight)):
            logger.info("oneDNN's int8 GEMM rounds otherwise than fbgemm's on this CPU: fbgemm takes every batch")
            return False
    return True


class _OneDNNInt8:
    """The same int8 codes packed for oneDNN's u8 x s8 GEMM (activation codes as fbgemm makes them)."""

    @classmethod
    def try_pack(cls, codes: torch.Tensor, scale: torch.Tensor) -> _OneDNNInt8 | None:
        """None where this torch build or CPU has no oneDNN int8 GEMM: fbgemm then takes every batch."""
        if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")):
            return None
        try:
            return cls(codes, scale)
        except RuntimeError:
            return None

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor) -> None:
        self.packed = torch.ops.onednn.qlinear_prepack(codes, None)
        self.scale = scale.float()
        self.zero_point = torch.zeros_like(scale, dtype=torch.long)

    def matmul(self, unit_rows: torch.Tensor) -> torch.Tensor:
        """`unit_rows` are rows already divided by their absmax."""
        quantized = torch.quantize_per_tensor(unit_rows, _ACT_SCALE, _ACT_ZERO_POINT, torch.quint8)
        # The quint8 tensor's storage holds the codes as plain bytes: a uint8 tensor over it reads them
        # where int_repr() would copy them (~1 ms per 2048-row GEMM, 4% of a 16 x 128-token prefill).
        codes = torch.empty(0, dtype=torch.uint8).set_(
            quantized.untyped_storage(), quantized.storage_offset(), quantized.shape, quantized.stride()
        )
        return torch.ops.onednn.qlinear_pointwise(
            codes,
            _ACT_SCALE,
            _ACT_ZERO_POINT,
            self.packed,
            self.scale,
            self.zero_point,
            None,
            1.0,
            0,
            torch.float32,
            "none",
            [],
            "",
        )
