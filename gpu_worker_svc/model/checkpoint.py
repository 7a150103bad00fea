"""Checkpoint sources: each yields named tensors that are read lazily, a slice at a time.

A tensor is read only through `read(dim, start, end)`, so a tensor-parallel rank
pulls its own shard from disk (safetensors slices, GGUF rows) and never the model.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from gpu_worker_svc.model.config import ModelConfig
from shardline.core.gguf_file import GGUFError, GGUFFile


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupt or incomplete."""


class CheckpointTensor(Protocol):
    name: str
    shape: tuple[int, ...]

    def read(self, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor: ...


@dataclass(slots=True)
class SafetensorsTensor:
    name: str
    shape: tuple[int, ...]
    handle: object  # safetensors' lazy slice
    file: Path

    def read(self, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        try:
            if dim is None:
                return self.handle[:]
            index = [slice(None)] * len(self.shape)
            index[dim] = slice(start, end)
            return self.handle[tuple(index)]
        except SafetensorError as exc:
            raise CheckpointError(f"{self.file}: cannot read tensor {self.name!r} ({exc})") from exc


@dataclass(slots=True)
class RowRange:
    """Rows [offset, offset + shape[0]) of a fused checkpoint tensor, read as a tensor of its own:
    a rank's slice of it is a slice of the fused tensor's rows, so no rank reads the rest."""

    name: str
    shape: tuple[int, ...]
    source: CheckpointTensor
    offset: int

    def read(self, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        rows = self.shape[0]
        if dim is None:
            return self.source.read(0, self.offset, self.offset + rows)
        if dim == 0:
            return self.source.read(0, self.offset + start, self.offset + (rows if end is None else end))
        return self.source.read(dim, start, end)[self.offset : self.offset + rows]


def split_rows(tensor: CheckpointTensor, fused: str, parts: list[tuple[str, int]]) -> list[RowRange]:
    """A fused tensor (`...qkv_proj.weight`) as its parts (`...q_proj.weight`, ...), each `rows` rows in order;
    CheckpointError naming it when its rows are not the parts' sum."""
    want = sum(rows for _, rows in parts)
    if not tensor.shape or tensor.shape[0] != want:
        raise CheckpointError(
            f"tensor {tensor.name!r} has shape {tuple(tensor.shape)}, but the config implies {want} rows "
            f"({' + '.join(f'{name} {rows}' for name, rows in parts)})"
        )
    out, offset = [], 0
    for name, rows in parts:
        out.append(RowRange(tensor.name.replace(fused, name), (rows, *tensor.shape[1:]), tensor, offset))
        offset += rows
    return out


class SafetensorsCheckpoint:
    """A Hugging Face folder: one model.safetensors, or shards listed in model.safetensors.index.json."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index}: invalid safetensors index ({exc})") from exc
            self.files = sorted({folder / f for f in weight_map.values()})
        else:
            self.files = sorted(folder.glob("*.safetensors"))
        if not self.files:
            raise CheckpointError(f"{folder}: no *.safetensors files found")
        for f in self.files:
            if not f.is_file():
                raise CheckpointError(f"{f}: checkpoint shard listed in the index is missing")

    def config(self) -> ModelConfig:
        return ModelConfig.from_hf_folder(self.folder)

    def tensors(self, cfg: ModelConfig) -> Iterator[CheckpointTensor]:
        for path in self.files:
            try:
                f = safe_open(str(path), framework="pt")
                for name in f.keys():
                    handle = f.get_slice(name)
                    yield SafetensorsTensor(name, tuple(handle.get_shape()), handle, path)
            except SafetensorError as exc:
                raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({exc})") from exc


_GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def gguf_to_hf_name(name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for unknown tensors."""
    parts = name.split(".")
    if parts[0] == "blk":
        mapped = _GGUF_NAMES.get(parts[2])
        return f"model.layers.{parts[1]}.{mapped}.{parts[3]}" if mapped else None
    mapped = _GGUF_NAMES.get(parts[0])
    return f"{mapped}.{parts[1]}" if mapped else None


def unpermute_rows(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """llama.cpp's Q/K row order within each head back to HF's (a permutation of whole rows)."""
    return rows.reshape(-1, head_dim // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


@dataclass(slots=True)
class GGUFCheckpointTensor:
    name: str
    shape: tuple[int, ...]
    gguf_name: str
    file: GGUFFile
    # llama.cpp stores Q/K rows permuted within each head; undo it per head like HF's reverse_permute.
    unpermute_head_dim: int | None = None

    def read(self, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        if dim == 0 or dim is None:
            rows = self.file.load(self.gguf_name, start, end if dim == 0 else None)
        else:  # column slices: dequantize whole rows, then cut (blocks run along columns)
            rows = self.file.load(self.gguf_name)
            rows = rows[:, start:end] if dim == 1 else np.take(rows, range(start, end), axis=dim)
        if self.unpermute_head_dim is not None:
            rows = unpermute_rows(rows, self.unpermute_head_dim)
        rows = np.ascontiguousarray(rows)
        # Unquantized tensors are views of the read-only file map; torch wants writable memory.
        return torch.from_numpy(rows if rows.flags.writeable else rows.copy())


class GGUFCheckpoint:
    """One .gguf file, dequantized tensor by tensor to the runtime dtype."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.file = _open_gguf(path, path.stat().st_mtime_ns)
        except GGUFError as exc:
            raise CheckpointError(str(exc)) from exc

    def config(self) -> ModelConfig:
        tensors = self.file.tensors
        factors = self.file.load("rope_freqs.weight").reshape(-1).tolist() if "rope_freqs.weight" in tensors else None
        return ModelConfig.from_gguf_metadata(self.file.metadata, self.path, "output.weight" in tensors, factors)

    def tensors(self, cfg: ModelConfig) -> Iterator[CheckpointTensor]:
        permute = cfg.architecture in ("LlamaForCausalLM", "MistralForCausalLM")
        for gname, info in self.file.tensors.items():
            name = gguf_to_hf_name(gname)
            if name is None:
                continue
            head_dim = cfg.head_dim if permute and (".q_proj." in name or ".k_proj." in name) else None
            yield GGUFCheckpointTensor(name, info.shape, gname, self.file, head_dim)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: Path, mtime_ns: int) -> GGUFFile:
    """Parsed once per process: reading the config and then the weights would otherwise parse the
    header (with its whole tokenizer vocabulary) twice."""
    return GGUFFile(path)


def open_checkpoint(path: Path) -> SafetensorsCheckpoint | GGUFCheckpoint:
    if not path.exists():
        raise CheckpointError(f"{path}: model path not found")
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path}: expected a .gguf file or a Hugging Face folder")
        return GGUFCheckpoint(path)
    ggufs = sorted(path.glob("*.gguf"))
    if not (path / "config.json").is_file() and len(ggufs) == 1:
        return GGUFCheckpoint(ggufs[0])
    return SafetensorsCheckpoint(path)
