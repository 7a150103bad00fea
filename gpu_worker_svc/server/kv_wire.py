"""KV blocks on the wire: the KvChunk stream of the KvTransfer service, cut into slabs and put back.

A transfer is a header (the sender's layout and block count), then each block as one or more
slabs, layer ranges of at most SLAB_BYTES, in order. The sizes make any gRPC channel carry it,
and a receiver holds at most one transfer's blocks, which it refuses past its own cache's size.
The assembler checks only the framing; the engine checks the layout, sizes and hash chain again
when it imports (engine/kv_transfer.py), so a payload is judged in one place.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from gpu_worker_svc.engine.kv_transfer import KvBlocks, KvLayout, KvTransferError
from shardline.proto import worker_pb2

# A slab's KV bytes at most: well under gRPC's default 4 MB limit, so a channel with default options
# carries it too, and large enough that per-message costs stay small (a block of the default model
# is 720 KiB: one slab).
SLAB_BYTES = 1 << 20


def header_message(layout: KvLayout, blocks: KvBlocks) -> worker_pb2.KvChunk:
    header = worker_pb2.KvTransferHeader(
        model=layout.model,
        config_fingerprint=layout.config_fingerprint,
        weight_format=layout.weight_format,
        dtype=layout.dtype,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        tp_size=layout.tp_size,
        num_blocks=len(blocks),
    )
    if blocks.parent_hash is not None:
        header.parent_hash = blocks.parent_hash
    if blocks.chain_root is not None:
        header.chain_root = blocks.chain_root
    return worker_pb2.KvChunk(header=header)


def layout_of(header: worker_pb2.KvTransferHeader) -> KvLayout:
    return KvLayout(
        model=header.model,
        config_fingerprint=header.config_fingerprint,
        weight_format=header.weight_format,
        dtype=header.dtype,
        block_size=header.block_size,
        num_layers=header.num_layers,
        num_kv_heads=header.num_kv_heads,
        head_dim=header.head_dim,
        tp_size=header.tp_size,
    )


def kv_chunks(layout: KvLayout, blocks: KvBlocks, slab_bytes: int = SLAB_BYTES) -> Iterator[worker_pb2.KvChunk]:
    """The header, then every block's slabs: as many whole layers as fit in `slab_bytes`, at least one."""
    yield header_message(layout, blocks)
    layer_bytes = layout.block_bytes // layout.num_layers
    per_slab = max(1, slab_bytes // layer_bytes)
    raw = blocks.kv.contiguous().view(torch.uint8).numpy()  # [blocks, layers, bytes of a layer...]
    for index, (tokens, block_hash) in enumerate(zip(blocks.token_ids, blocks.block_hashes)):
        for first in range(0, layout.num_layers, per_slab):
            n = min(per_slab, layout.num_layers - first)
            slab = worker_pb2.KvBlockSlab(
                block_index=index,
                block_hash=block_hash,
                token_ids=tokens if first == 0 else (),
                first_layer=first,
                num_layers=n,
                kv=raw[index, first : first + n].tobytes(),
            )
            yield worker_pb2.KvChunk(slab=slab)


class KvAssembler:
    """Rebuilds a transfer from its chunks; raises KvTransferError naming the field on bad framing,
    and KvLayoutMismatch on a header of another layout than `expected` (before any buffer is made)."""

    def __init__(self, max_blocks: int, expected: KvLayout) -> None:
        self._max_blocks = max_blocks  # the receiver's cache: more could never be imported
        self._expected = expected
        self.layout: KvLayout | None = None
        self._parent: int | None = None
        self._chain_root: int | None = None
        self._kv: np.ndarray | None = None  # [blocks, layers, bytes of a layer]
        self._kv_tensor: torch.Tensor | None = None
        self._tokens: list[list[int]] = []
        self._hashes: list[int] = []
        self._next_layer = 0  # of the block being received, the last in _hashes

    def add(self, chunk: worker_pb2.KvChunk) -> None:
        part = chunk.WhichOneof("part")
        if part == "header":
            self._header(chunk.header)
        elif part == "slab":
            self._slab(chunk.slab)
        else:
            raise KvTransferError("part", "a chunk holds neither a header nor a slab")

    def _header(self, header: worker_pb2.KvTransferHeader) -> None:
        if self.layout is not None:
            raise KvTransferError("header", "a transfer has one header")
        layout = layout_of(header)
        self._expected.check_matches(layout)
        if header.num_blocks > self._max_blocks:
            raise KvTransferError(
                "header.num_blocks", f"{header.num_blocks} blocks, this cache holds {self._max_blocks}"
            )
        self._kv_tensor = torch.empty((header.num_blocks, *layout.block_shape), dtype=layout.torch_dtype)
        layer_bytes = layout.block_bytes // layout.num_layers
        self._kv = self._kv_tensor.view(torch.uint8).numpy().reshape(header.num_blocks, layout.num_layers, layer_bytes)
        self._parent = header.parent_hash if header.HasField("parent_hash") else None
        self._chain_root = header.chain_root if header.HasField("chain_root") else None
        self.layout = layout

    def _slab(self, slab: worker_pb2.KvBlockSlab) -> None:
        layout, kv = self.layout, self._kv
        if layout is None or kv is None:
            raise KvTransferError("header", "the header must come first")
        starts_block = self._next_layer in (0, layout.num_layers)
        if starts_block:
            if slab.block_index != len(self._hashes) or slab.block_index >= kv.shape[0]:
                raise KvTransferError("slab.block_index", f"{slab.block_index}, expected block {len(self._hashes)}")
            if slab.first_layer != 0:
                raise KvTransferError("slab.first_layer", f"{slab.first_layer}: a block starts at layer 0")
            self._hashes.append(slab.block_hash)
            self._tokens.append(list(slab.token_ids))
            self._next_layer = 0
        elif (
            slab.block_index != len(self._hashes) - 1
            or slab.first_layer != self._next_layer
            or slab.block_hash != self._hashes[-1]
        ):
            raise KvTransferError("slab", f"expected layer {self._next_layer} of block {len(self._hashes) - 1}")
        n = slab.num_layers
        if n < 1 or slab.first_layer + n > layout.num_layers:
            raise KvTransferError("slab.num_layers", f"{n} layers from {slab.first_layer} of {layout.num_layers}")
        expected = n * kv.shape[2]
        if len(slab.kv) != expected:
            raise KvTransferError("slab.kv", f"{len(slab.kv)} bytes for {n} layers, expected {expected}")
        kv[slab.block_index, slab.first_layer : slab.first_layer + n] = np.frombuffer(slab.kv, np.uint8).reshape(n, -1)
        self._next_layer = slab.first_layer + n

    def finish(self) -> tuple[KvLayout, KvBlocks]:
        """The transfer, once its last slab is in."""
        if self.layout is None or self._kv_tensor is None:
            raise KvTransferError("header", "the stream ended before its header")
        total = self._kv_tensor.shape[0]
        partial = bool(self._hashes) and self._next_layer != self.layout.num_layers
        done = len(self._hashes) - partial
        if done != total:
            raise KvTransferError("slab", f"the stream ended with {done} of {total} blocks complete")
        return self.layout, KvBlocks(self._parent, self._tokens, self._hashes, self._kv_tensor, self._chain_root)
