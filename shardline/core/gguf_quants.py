"""Vectorised dequantization of the common GGUF block formats.

`gguf.quants.dequantize` walks the data in small row groups; on the default
model that is over half of the load time. These whole-array versions give
bit-identical results (tests compare them with the gguf package) and leave every
other format to the package.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    return raw.reshape(-1, block_bytes)


def _q8_0(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, 34)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    return d * b[:, 2:].view(np.int8).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # Element j of a block is the low nibble of byte j (j < 16) or the high nibble of byte j - 16.
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)


def _q4_0(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, 18)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    return d * (_nibbles(b[:, 2:]) - 8.0)


def _q4_1(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, 20)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    return d * _nibbles(b[:, 4:]) + m


_FAST = {GGMLQuantizationType.Q8_0: _q8_0, GGMLQuantizationType.Q4_0: _q4_0, GGMLQuantizationType.Q4_1: _q4_1}


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of `raw` (uint8 bytes of whole blocks), reshaped to `shape`."""
    fast = _FAST.get(qtype)
    if fast is not None:
        return fast(np.ascontiguousarray(raw)).reshape(shape)
    rows = shape[0] if len(shape) > 1 else 1
    return gguf_dequantize(raw.reshape(rows, -1), qtype).reshape(shape)
