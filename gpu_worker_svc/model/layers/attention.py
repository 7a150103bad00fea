"""Attention over the paged KV cache. On CPU in float32 every query, a decode's or a prefill's, goes to
a C++ kernel that reads the cache in place (kernels/decode_attention.cpp), so that a query's result
is the same bits wherever a step puts it. Elsewhere it is plain torch; GPU kernels plug in behind
the same call.

Every path takes a layer's sliding window (each query sees its last `window` keys only: Mistral,
Gemma's local layers), its score scale (Gemma's query_pre_attn_scalar) and Gemma 2's score
soft-capping (softcap * tanh(score / softcap), before the softmax: torch's SDPA has no such
step, so a capped layer's torch path spells the attention out). Blocks that fall out of every
window stay in the cache: prefix caching reads them as before, and no memory is freed.

The KV cache of one layer is a tensor [2, num_blocks, block_size, kv_heads, head_dim].
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker_svc.model.attention_metadata import AttentionMetadata, DecodeGroup
from gpu_worker_svc.model.layers.invariant_attention import InvariantContext, invariant_attention
from gpu_worker_svc.model.layers.kernels import cpu_kernels

# Queries per call of the decode kernel for a prefill chunk: each reads the keys up to its last
# query. 16 was fastest of 8-64 at 2048-token chunks, and within 25% of the best at 16 x 128.
PIECE = 16


class PagedAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        # What torch's SDPA is given: None for 1/sqrt(head_dim), which it computes itself, so that the torch
        # paths of a plain model keep their bits.
        self._sdpa_scale = scale
        self.window = window  # keys each query sees, its own included; None: all before it
        self.softcap = softcap  # Gemma 2's attn_logit_softcapping; None: scores as they are
        # The shapes kernels/decode_attention.cpp takes (all of Llama's and Qwen2's).
        self.cpu_kernel_fits = head_dim % 16 == 0 and head_dim <= 256

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]. Returns [T, Hq * D]."""
        k_cache, v_cache = kv_cache.view(2, -1, self.num_kv_heads, self.head_dim).unbind(0)
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        return self.attend(q, kv_cache, meta, k, v)

    def rope_writer(self, qkv: torch.Tensor, kv_cache: torch.Tensor) -> Callable | None:
        """kernels/rotary_cache.cpp, which rotates a step's queries and keys and writes its keys and
        values into the cache, where the decode kernel then takes every query (CPU, float32); else None."""
        if not self.kernel_takes_every_query(qkv.device.type, qkv.dtype) or kv_cache.dtype != torch.float32:
            return None  # torch's prefill attention reads the step's k, v, which the op does not return
        return cpu_kernels.rope_cache_write() if qkv.dim() == 2 and qkv.is_contiguous() else None

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The step's queries over the cache, which already holds the step's keys and values → [T, Hq * D].
        `k`, `v`: the step's own, which only torch's prefill attention reads (where the kernel does not run)."""
        k_cache, v_cache = kv_cache.view(2, -1, self.num_kv_heads, self.head_dim).unbind(0)
        if meta.invariant:
            return self._invariant(q, k_cache, v_cache, meta)
        if not meta.prefill_bounds and meta.decode_queries == 1:  # the common step: the decodes, in order
            return self._decode(q, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        kernel = self._cpu_kernel(q, k_cache)
        if kernel is not None and meta.prefill_bounds:
            self._prefill_as_decodes(kernel, q, k_cache, v_cache, meta, out)
        elif meta.prefill_bounds:
            assert k is not None and v is not None, "torch's prefill attention reads the step's own keys and values"
            self._prefill_sdpa(q, k, v, k_cache, v_cache, meta, out)
        if meta.decode_index is not None and meta.decode_queries > 1:  # decodes with draft tokens
            queries = q.index_select(0, meta.decode_query_rows).unflatten(0, (-1, meta.decode_queries))
            decodes = self._decode(queries, k_cache, v_cache, meta).flatten(0, 1).index_select(0, meta.decode_valid)
            out.flatten(1).index_copy_(0, meta.decode_index, decodes)
        elif meta.decode_index is not None:
            decodes = self._decode(q.index_select(0, meta.decode_index), k_cache, v_cache, meta)
            out.flatten(1).index_copy_(0, meta.decode_index, decodes)  # far cheaper than index_put on CPU
        return out.flatten(1)

    def _prefill_as_decodes(
        self,
        kernel: Callable,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        """Every prefill query through the decode kernel, in pieces of PIECE queries, each query over
        its own prefix of the chunk's context (already in the cache): a prompt's keys and values are
        then the same bits as if its tokens had been decoded one by one, alone or in any batch. So a
        request resumed elsewhere, recomputed after preemption or served from the prefix cache goes on
        with the tokens of an unbroken run, even where 8-bit activations (gguf, int8) would turn the
        last-bit differences of another attention into other tokens."""
        pieces = meta.derived.get("prefill_pieces")
        if pieces is None:  # the first layer lays them out; the others reuse them
            pieces = meta.derived["prefill_pieces"] = _prefill_pieces(meta)
        rows, slots, lengths, valid, dest = pieces
        queries = q.index_select(0, rows).unflatten(0, (-1, PIECE))
        attended = kernel(
            queries, k_cache, v_cache, slots, lengths, self.scale, self.window or 0, self.softcap or 0.0
        ).flatten(0, 1)
        out.flatten(1).index_copy_(0, dest, attended.index_select(0, valid))

    def _prefill_sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        """The prefill chunks through torch's SDPA, where the decode kernel does not run (GPU, bf16)."""
        runs = meta.derived.get("self_attending")
        if runs is None:  # the first layer finds them; the others reuse them
            runs = meta.derived["self_attending"] = _self_attending_runs(meta)
        for start, length, count in runs:  # chunks without a cached prefix attend to themselves, causally
            end = start + length * count
            out[start:end] = self._sdpa_batch(q[start:end], k[start:end], v[start:end], count)
        for (start, end), gather, mask in zip(meta.prefill_bounds, meta.prefill_gather, meta.prefill_mask):
            if gather is not None:  # the chunk's queries sit at the end of a longer context
                out[start:end] = self._sdpa(
                    q[start:end],
                    k_cache.index_select(0, gather),
                    v_cache.index_select(0, gather),
                    self._in_window(mask, gather.shape[0], gather.device),
                    causal=False,
                )

    def _invariant(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Each chunk, then the decodes group by group, each query over its context gathered from the cache."""
        key = f"invariant/{self.window}"  # sliding and global layers see different keys
        contexts = meta.derived.get(key)
        if contexts is None:  # the first layer lays out the step's contexts; the others reuse them
            contexts = meta.derived[key] = self._invariant_contexts(meta)
        prefills, decodes = contexts
        out = torch.empty_like(q)
        scale, cap = self.scale, self.softcap
        for (start, end), context in zip(meta.prefill_bounds, prefills):
            out[start:end] = invariant_attention(q[None, start:end], k_cache, v_cache, context, scale, cap)[0]
        for rows, context in decodes:
            attended = invariant_attention(q.index_select(0, rows)[:, None], k_cache, v_cache, context, scale, cap)
            out.index_copy_(0, rows, attended[:, 0])
        return out.flatten(1)

    def _invariant_contexts(
        self, meta: AttentionMetadata
    ) -> tuple[list[InvariantContext], list[tuple[torch.Tensor, InvariantContext]]]:
        """Each chunk's context; and each decode group's flat-batch rows, and its context."""
        prefills = [
            InvariantContext.of(gather[None], self._window_of(mask, gather)[None], self.num_kv_heads)
            for gather, mask in zip(meta.prefill_gather, meta.prefill_mask)
        ]
        decodes = []
        if meta.decode_index is not None:
            groups = meta.decode_groups or [
                DecodeGroup(torch.arange(meta.decode_index.numel()), meta.decode_gather, meta.decode_mask)
            ]
            for group in groups:
                allowed = self._window_of(group.mask, group.gather).view(group.gather.shape[0], 1, -1)
                decodes.append(
                    (
                        meta.decode_index.index_select(0, group.rows.to(meta.decode_index.device)),
                        InvariantContext.of(group.gather, allowed, self.num_kv_heads),
                    )
                )
        return prefills, decodes

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The single-token queries q [B, Hq, D] against their cached contexts → [B, Hq * D];
        or each decode's Q queries, q [B, Q, Hq, D] → [B, Q, Hq * D]."""
        kernel = self._cpu_kernel(q, k_cache)
        if kernel is not None:  # one call for all the decodes: it needs no padding to one length
            slots, lengths = decode_contexts(meta)
            return kernel(q, k_cache, v_cache, slots, lengths, self.scale, self.window or 0, self.softcap or 0.0)
        if not meta.decode_groups:
            return self._attend(q, k_cache, v_cache, meta.decode_gather, meta.decode_mask)
        out = q.new_empty(*q.shape[:-2], q.shape[-2] * q.shape[-1])
        for group in meta.decode_groups:  # contexts of widely different lengths, each group padded apart
            attended = self._attend(q.index_select(0, group.rows), k_cache, v_cache, group.gather, group.mask)
            out.index_copy_(0, group.rows, attended)
        return out

    def kernel_takes_every_query(self, device: str, dtype: torch.dtype) -> bool:
        """Whether every query, a decode's or a prefill's, goes to kernels/decode_attention.cpp."""
        return (
            self.cpu_kernel_fits
            and device == "cpu"
            and dtype == torch.float32
            and cpu_kernels.paged_decode_attention() is not None
        )

    def _cpu_kernel(self, q: torch.Tensor, k_cache: torch.Tensor) -> Callable | None:
        """kernels/decode_attention.cpp, for decodes (with their drafts or not) on CPU in float32; else None."""
        if (
            not self.cpu_kernel_fits
            or q.device.type != "cpu"
            or q.dtype != torch.float32
            or k_cache.dtype != torch.float32
        ):
            return None
        return cpu_kernels.paged_decode_attention()

    def _attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        gather: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        # index_select on the flattened slots is several times faster than advanced indexing.
        b, length = gather.shape
        flat = gather.flatten()
        kd = k_cache.index_select(0, flat).view(b, length, *k_cache.shape[1:]).transpose(1, 2)  # [B, Hkv, L, D]
        vd = v_cache.index_select(0, flat).view(b, length, *v_cache.shape[1:]).transpose(1, 2)
        mask = self._in_window(mask, length, q.device)
        if q.dim() == 4:  # [B, Q, Hq, D]: a decode's token and its drafts
            assert mask is not None, "a decode with drafts always has a mask"
            return self._attend_queries(q, kd, vd, mask)
        return self._scores_softmax_values(q.unsqueeze(2), kd, vd, mask, causal=False).flatten(1)

    def _attend_queries(self, q: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Q queries per decode, q [B, Q, Hq, D], over kd/vd [B, Hkv, L, D] → [B, Q, Hq * D].

        The G query heads that share a KV head go as G * Q rows of one (decode, KV head) pair: one
        CPU SDPA task with G * Q rows instead of G tasks of Q reading the same keys (~20% faster
        at 16 decodes of 5 queries, and the same bits; mask [B, 1, Q, L] tiled G times)."""
        b, queries, _, dim = q.shape
        group = self.num_heads // self.num_kv_heads
        rows = q.view(b, queries, self.num_kv_heads, group, dim).permute(0, 2, 3, 1, 4)
        od = self._scores_softmax_values(
            rows.reshape(b, self.num_kv_heads, group * queries, dim), kd, vd, mask.repeat(1, 1, group, 1), causal=False
        )
        return od.view(b, self.num_kv_heads, group, queries, dim).permute(0, 3, 1, 2, 4).reshape(b, queries, -1)

    def _sdpa_batch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int) -> torch.Tensor:
        """`count` chunks of one length, back to back, each attending to itself causally → [n, Hq, D].

        One call for all of them: a burst of equal prompts prefills in one step, and torch's CPU
        kernel then spreads (chunk, head) pairs over its threads, ~4x faster than a call per chunk
        for 16 chunks of 128 tokens; each pair's result is the same bits either way."""
        o = self._scores_softmax_values(
            q.unflatten(0, (count, -1)).transpose(1, 2),
            k.unflatten(0, (count, -1)).transpose(1, 2),
            v.unflatten(0, (count, -1)).transpose(1, 2),
            None,
            causal=True,
        )
        return o.transpose(1, 2).flatten(0, 1)

    def _sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
    ) -> torch.Tensor:
        """One sequence: q [n, Hq, D], k/v [ctx, Hkv, D] → [n, Hq, D].

        As a batch of one: given 3-D inputs, torch's CPU SDPA takes its unfused math path (a
        [heads, n, ctx] score matrix, tril, softmax), 5-7x slower than its flash kernel at 512 tokens.
        """
        o = self._scores_softmax_values(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, causal
        )
        return o[0].transpose(0, 1)

    def _in_window(self, mask: torch.Tensor | None, length: int, device: torch.device) -> torch.Tensor | None:
        """`mask` [..., L] (True: seen; each row a prefix of the L keys, None: all of them) narrowed to each
        row's last `window` keys; as it is without a window. Tensor ops only, so a CUDA graph captures it."""
        if self.window is None:
            return mask
        keys = torch.arange(length, device=device)
        if mask is None:
            return (keys >= length - self.window)[None]  # [1, L]: SDPA takes no 1-D mask
        return mask & (keys >= mask.sum(-1, keepdim=True) - self.window)

    def _window_of(self, mask: torch.Tensor | None, gather: torch.Tensor) -> torch.Tensor:
        """The mask of a context gathered from `gather`'s slots (its last dimension), in its window."""
        windowed = self._in_window(mask, gather.shape[-1], gather.device)
        assert windowed is not None, "the invariant layout gives every context a mask"
        return windowed

    def _scores_softmax_values(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
    ) -> torch.Tensor:
        """q [..., Hq, n, D] over k, v [..., Hkv, L, D] → [..., Hq, n, D]: torch's SDPA, with this layer's scale
        and window (a causal call with a window becomes a masked one). SDPA cannot cap scores, so a
        soft-capped layer spells the attention out, in float32 as HF's eager attention does its softmax."""
        n, length = q.shape[-2], k.shape[-2]
        if causal and (self.window is not None or self.softcap is not None):
            causal_mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
            mask = self._in_window(causal_mask, length, q.device)
            causal = False
        if self.softcap is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=self._sdpa_scale, enable_gqa=q.shape[-3] != k.shape[-3]
            )
        group = q.shape[-3] // k.shape[-3]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, -math.inf)
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _self_attending_runs(meta: AttentionMetadata) -> list[tuple[int, int, int]]:
    """(start, chunk length, chunks) of each run of adjacent prefill chunks without a cached prefix
    and of one length: each run is one attention call."""
    runs: list[tuple[int, int, int]] = []
    for (start, end), gather in zip(meta.prefill_bounds, meta.prefill_gather):
        if gather is not None:
            continue
        if runs and runs[-1][0] + runs[-1][1] * runs[-1][2] == start and runs[-1][1] == end - start:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((start, end - start, 1))
    return runs


def _prefill_pieces(
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the CPU kernel, the step's prefill queries as "decodes" of PIECE queries each: the flat-batch
    row of every query [N * PIECE] (a chunk's last piece repeats its last query), each piece's context
    slots [N, L], each query's context length [N, PIECE], and the places of the real queries among the
    N * PIECE with their flat-batch rows. The kernel reads a piece's keys up to its last query's only,
    so the causal square costs about half, as a causal kernel's does, plus half a piece."""
    rows, contexts, lengths, real = [], [], [], []
    offsets = torch.arange(PIECE)
    for (start, end), gather in zip(meta.prefill_bounds, meta.prefill_gather):
        n = end - start
        context = meta.slot_mapping[start:end] if gather is None else gather  # the chunk ends its context
        own = (torch.arange(0, n, PIECE)[:, None] + offsets[None, :]).flatten()  # [pieces * PIECE]
        real.append(own < n)
        own = own.clamp(max=n - 1)
        rows.append(own + start)
        lengths.append(own + (len(context) - n + 1))  # query i of the chunk sees its context's first c + i + 1
        contexts.append(context.expand(len(own) // PIECE, -1))
    flat, real_rows = torch.cat(rows), torch.cat(real)
    slots = torch.zeros(len(flat) // PIECE, max(c.shape[1] for c in contexts), dtype=torch.long)  # 0: never read
    first = 0
    for c in contexts:
        slots[first : first + c.shape[0], : c.shape[1]] = c
        first += c.shape[0]
    valid = real_rows.nonzero().flatten()
    return flat, slots, torch.cat(lengths).view(-1, PIECE), valid, flat[valid]


def decode_contexts(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """For the CPU kernel, in the step's order of decodes: each one's context slots [B, L], and its
    length [B] (with drafts, each query's [B, Q]). Worked out by the first layer that asks, kept
    for the others in meta.derived."""
    contexts = meta.derived.get("decode_contexts")
    if contexts is None:
        contexts = meta.derived["decode_contexts"] = _decode_contexts(meta)
    return contexts


def _decode_contexts(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """decode_contexts, worked out. Groups go back into one table: the kernel reads each decode's
    own length only, so padding to the longest costs it nothing."""
    parts = [(g.rows, g.gather, g.mask) for g in meta.decode_groups] or [
        (slice(None), meta.decode_gather, meta.decode_mask)
    ]
    decodes, queries = sum(gather.shape[0] for _, gather, _ in parts), meta.decode_queries
    slots = torch.zeros(decodes, max(gather.shape[1] for _, gather, _ in parts), dtype=torch.long)  # 0: never read
    lengths = torch.empty(decodes, queries, dtype=torch.long)
    for rows, gather, mask in parts:
        b, width = gather.shape
        slots[rows, :width] = gather
        # mask [b, 1, Q, width]: the keys each query sees, a prefix of its decode's slots; None: all of them
        lengths[rows] = width if mask is None else mask.view(b, queries, width).sum(-1)
    return slots, lengths if queries > 1 else lengths.view(decodes)
