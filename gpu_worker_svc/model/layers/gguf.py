"""GGUF's Q4_0, Q4_1 and Q8_0 weights kept in the file's own blocks on CPU, behind `quantization="gguf"`.

A batch-1 decode step on CPU is bound by the bytes of weight it streams: the default model's
linear layers and LM head are 96 MB as the file stores them (Q4_1, and Q8_0 for the tied
embedding), against 540 MB dequantized to fp32. kernels/gguf_linear.cpp multiplies the blocks as
they are, as llama.cpp does: each activation row is quantized to int8 blocks of 32, every block's
dot product is exact in integers, and only the sum over a row's blocks is fp32. A row's output
depends on that row alone, bit for bit, so the engine's batch invariance holds.

At load the blocks of every 16 rows are interleaved into panels (`panels_of`; the layout is in
kernels/gguf_dot.h): the same bytes, reordered so that one vector instruction computes 16 rows'
block sums, and a batch's rows share each block's unpacked weights.

Numerics: the weights are the file's (no rounding beyond what its author chose); the activations
gain int8 rounding per block of 32, as in llama.cpp.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from gpu_worker_svc.model.layers.kernels import cpu_kernels

# The block formats the kernel multiplies as stored; other GGUF types are dequantized at load.
KERNEL_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)


def block_row_bytes(qtype: GGMLQuantizationType, in_features: int) -> int:
    """Bytes of one weight row of `in_features` elements in `qtype`'s blocks."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    if in_features % block:
        raise ValueError(f"{qtype.name} rows hold whole blocks of {block}; {in_features} inputs do not fit")
    return in_features // block * type_size


_SCALES = {GGMLQuantizationType.Q4_0: 1, GGMLQuantizationType.Q4_1: 2, GGMLQuantizationType.Q8_0: 1}  # fp16 per block
LANES = 16  # weight rows per panel


def panels_of(qtype: GGMLQuantizationType, blocks: torch.Tensor) -> torch.Tensor:
    """The file's rows of blocks, uint8 [N, row bytes], as panels uint8 [ceil(N / 16), row bytes * 16].

    Panel (g, b) is block b of rows 16 g .. 16 g + 15: their fp16 scales lane by lane, then their
    codes in 4-byte words, word c of every row before word c + 1 (kernels/gguf_dot.h). Rows past N
    are zero blocks, whose outputs are never stored."""
    n, row_bytes = blocks.shape
    block_size = GGML_QUANT_SIZES[qtype][1]
    padded = torch.zeros(-(-n // LANES) * LANES, row_bytes, dtype=torch.uint8)
    padded[:n] = blocks
    grouped = padded.view(-1, LANES, row_bytes // block_size, block_size).transpose(1, 2)  # [G, blocks, 16, bytes]
    scales = 2 * _SCALES[qtype]
    parts = [grouped[..., 2 * j : 2 * j + 2].flatten(2) for j in range(_SCALES[qtype])]  # each: 16 fp16
    words = grouped[..., scales:].unflatten(-1, (-1, 4)).transpose(2, 3)  # [G, blocks, words, 16, 4]
    return torch.cat([*parts, words.flatten(2)], dim=2).flatten(1).contiguous()


def blocks_of_panels(qtype: GGMLQuantizationType, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """panels_of undone: the file's rows of blocks, uint8 [out_features, row bytes]."""
    block_size = GGML_QUANT_SIZES[qtype][1]
    groups, bytes_per_group = panels.shape
    blocks = bytes_per_group // (LANES * block_size)
    view = panels.view(groups, blocks, LANES * block_size)
    scales = 2 * _SCALES[qtype]
    parts = [view[..., LANES * 2 * j : LANES * 2 * (j + 1)].unflatten(-1, (LANES, 2)) for j in range(_SCALES[qtype])]
    words = view[..., LANES * scales :].unflatten(-1, (-1, LANES, 4)).transpose(2, 3).flatten(3)  # [G, b, 16, q]
    rows = torch.cat([*parts, words], dim=3).transpose(1, 2).reshape(groups * LANES, blocks * block_size)
    return rows[:out_features].contiguous()


class GGUFWeight(nn.Module):
    """One linear layer's (sharded) weight as GGUF blocks, given as the file's rows (uint8 [out_features,
    row bytes]) and kept as panels of 16 rows (`panels`)."""

    def __init__(self, qtype: GGMLQuantizationType, blocks: torch.Tensor, in_features: int, isa: str = "") -> None:
        super().__init__()
        if qtype not in KERNEL_TYPES:
            raise ValueError(f"the GGUF kernel takes {', '.join(t.name for t in KERNEL_TYPES)}, not {qtype.name}")
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != block_row_bytes(qtype, in_features):
            raise ValueError(
                f"{qtype.name} weight of {in_features} inputs: expected uint8 rows of "
                f"{block_row_bytes(qtype, in_features)} bytes, got {blocks.dtype} {tuple(blocks.shape)}"
            )
        op = cpu_kernels.gguf_linear()
        if op is None:
            raise RuntimeError("the GGUF kernel needs Shardline's CPU kernels, which cannot be built here")
        self._op = op
        self.qtype = qtype
        self.register_buffer("panels", panels_of(qtype, blocks), persistent=False)
        self.in_features = in_features
        self.out_features = blocks.shape[0]
        self.isa = isa  # "" picks the best this CPU runs; tests name one to compare the builds

    def file_blocks(self) -> torch.Tensor:
        """The weight as the file stores it: uint8 [out_features, row bytes]."""
        return blocks_of_panels(self.qtype, self.panels, self.out_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # The model's activations are already 2-D fp32 and contiguous: no reshape or cast that does nothing.
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        y = self._op(rows, self.panels, int(self.qtype), self.out_features, self.isa)
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
