"""A fast, read-only GGUF file parser.

`gguf.GGUFReader` builds a numpy view for every element of every metadata array,
which costs about 4.5 s on the default model's 49k-token vocabulary. Model load
time is a product goal (5 s), so this reader parses the header with `struct` and
maps the tensor data lazily. It relies on the `gguf` package for the format's
constants (value types, quantization block sizes) and for dequantization.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from shardline.core.gguf_quants import dequantize

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


class GGUFError(ValueError):
    """A GGUF file is missing, truncated, corrupt or unsupported."""


@dataclass(slots=True)
class GGUFTensor:
    """One tensor's location in the file; data is read only when asked for."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy / torch order: the last dim is contiguous
    data_offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """Metadata and lazily mapped tensors of one GGUF file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: GGUF file not found")
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # empty file
                raise GGUFError(f"{self.path}: not a GGUF file ({exc})") from exc
        self._pos = 0
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensor] = {}
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, ValueError) as exc:
            if isinstance(exc, GGUFError):
                raise
            raise GGUFError(f"{self.path}: corrupt or truncated GGUF header ({exc})") from exc

    # -- header parsing ---------------------------------------------------
    def _read(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self._map, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _read_str(self) -> str:
        n = self._read("<Q")
        if self._pos + n > len(self._map):
            raise GGUFError(f"{self.path}: truncated string in GGUF header")
        s = self._map[self._pos : self._pos + n].decode("utf-8")
        self._pos += n
        return s

    def _read_value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._read_str()
        if vtype == GGUFValueType.ARRAY:
            etype = GGUFValueType(self._read("<I"))
            count = self._read("<Q")
            if etype in _SCALAR_FORMATS:
                # Numeric arrays (token types, scores) are read in one slice.
                dtype = np.dtype(_SCALAR_FORMATS[etype].replace("?", "b"))
                end = self._pos + count * dtype.itemsize
                if end > len(self._map):
                    raise GGUFError(f"{self.path}: truncated array in GGUF header")
                arr = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos).copy()
                self._pos = end
                return arr.tolist()
            return [self._read_value(etype) for _ in range(count)]
        return self._read(_SCALAR_FORMATS[vtype])

    def _parse(self) -> None:
        if self._map[:4] != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (bad magic {self._map[:4]!r})")
        self._pos = 4
        version = self._read("<I")
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: unsupported GGUF version {version}")
        n_tensors = self._read("<Q")
        n_kv = self._read("<Q")
        for _ in range(n_kv):
            key = self._read_str()
            self.metadata[key] = self._read_value(GGUFValueType(self._read("<I")))
        infos = []
        for _ in range(n_tensors):
            name = self._read_str()
            n_dims = self._read("<I")
            dims = [self._read("<Q") for _ in range(n_dims)]
            qtype = GGMLQuantizationType(self._read("<I"))
            offset = self._read("<Q")
            infos.append((name, dims, qtype, offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = (self._pos + alignment - 1) // alignment * alignment
        for name, dims, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elements = int(np.prod(dims)) if dims else 1
            nbytes = n_elements // block * type_size
            start = data_start + offset
            if start + nbytes > len(self._map):
                raise GGUFError(
                    f"{self.path}: truncated GGUF file: tensor {name!r} needs bytes "
                    f"{start}..{start + nbytes} but the file has {len(self._map)}"
                )
            # GGUF lists dims fastest-first; numpy and torch want them slowest-first.
            self.tensors[name] = GGUFTensor(name, qtype, tuple(reversed(dims)), start, nbytes)

    # -- tensor access ----------------------------------------------------
    def raw_rows(self, name: str, row_start: int = 0, row_end: int | None = None) -> np.ndarray:
        """The stored bytes of rows [row_start, row_end) of a 2-D (or 1-D) tensor."""
        t = self.tensors[name]
        rows = t.shape[0] if len(t.shape) > 1 else 1
        row_end = rows if row_end is None else row_end
        row_bytes = t.nbytes // rows
        start = t.data_offset + row_start * row_bytes
        return np.frombuffer(self._map, dtype=np.uint8, count=(row_end - row_start) * row_bytes, offset=start)

    def load(self, name: str, row_start: int = 0, row_end: int | None = None) -> np.ndarray:
        """Rows [row_start, row_end) of a tensor, dequantized to float32 (or float16/bfloat16 as stored)."""
        t = self.tensors[name]
        raw = self.raw_rows(name, row_start, row_end)
        if len(t.shape) > 1:
            n_rows = (t.shape[0] if row_end is None else row_end) - row_start
            shape = (n_rows, *t.shape[1:])
        else:
            shape = t.shape
        if t.qtype == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(shape)
        if t.qtype == GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(shape)
        if t.qtype == GGMLQuantizationType.BF16:
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
        try:
            return dequantize(raw, t.qtype, shape)
        except NotImplementedError as exc:
            raise GGUFError(f"{self.path}: tensor {name!r} has unsupported type {t.qtype.name}") from exc

    def close(self) -> None:
        self._map.close()
