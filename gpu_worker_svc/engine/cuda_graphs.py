"""CUDA graphs for decode steps.

A decode step is dozens of small kernels per layer; on a GPU, launching them
costs more than running them. Each (batch, context) bucket is captured once on
first use, with static input buffers that every replay refills. Padded rows
write their K/V into a scratch block that no request owns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from gpu_worker_svc.model.attention_metadata import AttentionMetadata
from gpu_worker_svc.model.families.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_CONTEXT_BUCKET = 128


def _bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= n), None)


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    hidden: torch.Tensor
    gather: torch.Tensor  # meta.decode_gather, which a captured graph always has
    mask: torch.Tensor  # meta.decode_mask, likewise


class DecodeGraphs:
    def __init__(
        self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], scratch_slot: int, max_context: int
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.scratch_slot = scratch_slot
        self.context_buckets: tuple[int, ...] = tuple(
            MIN_CONTEXT_BUCKET << i for i in range(32) if MIN_CONTEXT_BUCKET << i <= max(max_context, 128) * 2
        )
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states of an all-decode step, or None when it fits no bucket (run it eagerly)."""
        if meta.prefill_bounds or meta.decode_gather is None or meta.decode_queries > 1:
            return None
        b, length = meta.decode_gather.shape
        bb, lb = _bucket(b, BATCH_BUCKETS), _bucket(length, self.context_buckets)
        if bb is None or lb is None:
            return None
        g = self.graphs.get((bb, lb)) or self._capture(bb, lb)
        g.input_ids[:b].copy_(input_ids)
        g.positions[:b].copy_(positions)
        g.meta.slot_mapping[:b].copy_(meta.slot_mapping)
        g.meta.slot_mapping[b:].fill_(self.scratch_slot)
        g.gather.zero_()
        g.gather[:b, :length].copy_(meta.decode_gather)
        g.mask.zero_()
        if meta.decode_mask is None:  # every context is `length` long
            g.mask[:b, :, :, :length] = True
        else:
            g.mask[:b, :, :, :length].copy_(meta.decode_mask)
        g.mask[b:, :, :, 0] = True  # padded rows attend to one slot, so they stay finite
        g.graph.replay()
        return g.hidden[:b]

    def _capture(self, b: int, length: int) -> _Graph:
        dev = self.kv_caches[0].device
        input_ids = torch.zeros(b, dtype=torch.long, device=dev)
        positions = torch.zeros(b, dtype=torch.long, device=dev)
        gather = torch.full((b, length), self.scratch_slot, dtype=torch.long, device=dev)
        mask = torch.zeros(b, 1, 1, length, dtype=torch.bool, device=dev)
        mask[:, :, :, 0] = True
        meta = AttentionMetadata(
            slot_mapping=torch.full((b,), self.scratch_slot, dtype=torch.long, device=dev),
            prefill_bounds=[],
            prefill_gather=[],
            prefill_mask=[],
            decode_index=torch.arange(b, device=dev),
            decode_gather=gather,
            decode_mask=mask,
        )
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):  # warm up kernels and allocator outside the graph
                self.model(input_ids, positions, meta, self.kv_caches)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.inference_mode():
            hidden = self.model(input_ids, positions, meta, self.kv_caches)
        log.info("captured a decode CUDA graph for batch %d, context %d", b, length)
        g = _Graph(graph, input_ids, positions, meta, hidden, gather, mask)
        self.graphs[(b, length)] = g
        return g
