"""Attention whose result for a query depends on nothing but that query and its own keys.

torch's CPU `scaled_dot_product_attention` is not like that. Its result for a query changes in
the last bits with how many other queries share the call and how far the keys are padded
(measured on torch 2.13, AVX2: a 300-token prefix prefilled alone, or as the start of a
337-token prompt, gives keys that differ by ~2e-7). In float32 that rarely changes a token. In
int8 it does: a ~1e-7 change can move an activation across a rounding boundary of its 8-bit
code, and greedy tokens then differ between a prefix-cache hit and a full prefill, between a
request alone and in a batch, and between a first run and its resume after a worker failure.
The int8 GEMMs are exact, so attention is the one part of an int8 step that has to be fixed.

Here every operation has a fixed shape per row, or adds exact zeros only:
- scores: one bmm, q rows x keys. Measured: bmm gives a row the same bits whatever the keys
  (12 or more) and the rows beside it, as long as a matrix has 4, 8, or 12 or more rows; other
  counts take other kernels, so a short matrix (a decode's) is padded.
- softmax: max (exact) and exp (elementwise); its sum is summed per TILE keys, then tile by tile
  in order (masked keys give exact zeros, so padding adds nothing).
- probabilities x values: a bmm per TILE keys, whose partial results are also added tile by
  tile in order: one bmm over all keys would block its reduction by the padded length.

It costs more than the fused kernel: a few more ops per layer, padded decode matrices, and the
gathers of whole tiles (`python -m benchmarks.batch_invariance`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gpu_worker_svc.model.attention_metadata import TILE

# Queries per piece of a long prefill chunk: bounds its score matrix, and each piece reads only the
# keys up to its own last query's (about half the work of the whole square, as a causal kernel does).
QUERY_PIECE = 256


def padded_rows(rows: int) -> int:
    """Rows per matrix that bmm rounds alike: 4, 8, and 12 or more. Other counts below 12 take other
    GEMM kernels, which round differently (measured); a matrix is padded to the next good count."""
    return rows if rows >= 12 else 4 if rows <= 4 else 8 if rows <= 8 else 12


@dataclass(slots=True)
class InvariantContext:
    """The keys of S sequences' queries (n each), and which of them each query may not see."""

    rows: torch.Tensor  # [Hkv * S * L]: rows of a cache viewed as [slots * Hkv, D], head-major
    hidden: torch.Tensor  # [S, n, L] bool: True where a query must not see a key
    shape: tuple[int, int, int]  # (Hkv, S, L)
    # The queries in pieces of at most QUERY_PIECE: (first, end, keys read), the keys cut after the
    # last one any query of the piece sees (a multiple of TILE).
    pieces: list[tuple[int, int, int]]
    # The gathered keys and values, [Hkv * S * L, D] each: allocated by the first layer, refilled by
    # the others (fresh megabytes per layer cost page faults that took longer than the gather).
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @classmethod
    def of(cls, slots: torch.Tensor, allowed: torch.Tensor, kv_heads: int) -> InvariantContext:
        """slots [S, L] (L a multiple of TILE), allowed [S, n, L] (each query sees at least one key).

        Gathered head-major, in D-long rows: a gather by slot, then a transposing copy, costs more."""
        heads = torch.arange(kv_heads, device=slots.device).view(kv_heads, 1, 1)
        n, length = allowed.shape[1], allowed.shape[2]
        pieces = []
        for first in range(0, n, QUERY_PIECE):
            end = min(first + QUERY_PIECE, n)
            seen = int(allowed[:, first:end].any(1).any(0).nonzero().max()) + 1
            pieces.append((first, end, min(length, -(-seen // TILE) * TILE)))
        return cls((slots[None] * kv_heads + heads).flatten(), ~allowed, (kv_heads, *slots.shape), pieces)


def invariant_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context: InvariantContext,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [S, n, Hq, D] over the keys and values of `context`, in caches [slots, Hkv, D].
    Returns [S, n, Hq, D]: softmax(q k^T * scale) v per head (scale None: 1 / sqrt(D)), each score
    capped first to softcap * tanh(score / softcap) where a softcap is given (Gemma 2)."""
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else scale
    d = q.shape[3]
    hkv, s_, length = context.shape
    if context.keys is None:
        context.keys = k_cache.new_empty(context.rows.numel(), d)
        context.values = v_cache.new_empty(context.rows.numel(), d)
    k = torch.index_select(k_cache.view(-1, d), 0, context.rows, out=context.keys).view(hkv, s_, length, d)
    v = torch.index_select(v_cache.view(-1, d), 0, context.rows, out=context.values).view(hkv, s_, length, d)
    if len(context.pieces) == 1:
        return _attend(q, k, v, context.hidden, scale, softcap)
    out = torch.empty_like(q)
    for first, end, keys in context.pieces:  # a long chunk: each piece's rows come out the same bits
        out[:, first:end] = _attend(
            q[:, first:end], k[:, :, :keys], v[:, :, :keys], context.hidden[:, first:end, :keys], scale, softcap
        )
    return out


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    """q [S, n, Hq, D]; k, v [Hkv, S, L, D]; hidden [S, n, L] → [S, n, Hq, D]."""
    s_, n, hq, d = q.shape
    hkv, length = k.shape[0], k.shape[2]
    group = hq // hkv
    batch, rows, tiles = hkv * s_, n * group, length // TILE
    # Each (KV head, sequence) is one matrix of rows (position, query head in its group). Zero rows
    # pad a short one (a decode): their scores are exactly 0 and are never exponentiated, so they
    # stay 0 through the product with the values, which drops them.
    padded = padded_rows(rows)
    q_rows = q.new_zeros(batch, padded, d) if padded > rows else q.new_empty(batch, rows, d)
    torch.mul(
        q.view(s_, n, hkv, group, d).permute(2, 0, 1, 3, 4),
        scale,
        out=q_rows[:, :rows].view(hkv, s_, n, group, d),
    )
    scores = torch.bmm(q_rows, k.reshape(batch, length, d).transpose(1, 2))
    real = scores[:, :rows]
    if softcap is not None:  # elementwise: each score's own bits, whatever the layout
        real.div_(softcap).tanh_().mul_(softcap)
    real.view(hkv, s_, n, group, length).masked_fill_(hidden[None, :, :, None], -math.inf)
    real.sub_(real.amax(-1, keepdim=True)).exp_()
    tiled = scores.view(batch, padded, tiles, TILE)
    denominator = _in_order(tiled[:, :rows].sum(-1).movedim(-1, 0))  # [batch, rows]
    partial = torch.bmm(tiled.transpose(1, 2).reshape(batch * tiles, padded, TILE), v.reshape(batch * tiles, TILE, d))
    out = _in_order(partial.view(batch, tiles, padded, d)[:, :, :rows].movedim(1, 0)).div_(denominator[..., None])
    return out.view(hkv, s_, n, group, d).permute(1, 2, 0, 3, 4).reshape(s_, n, hq, d)


def _in_order(per_tile: torch.Tensor) -> torch.Tensor:
    """The sum over the first dimension, tile after tile: the same additions for a row however many
    (all-zero) tiles follow its last key. (cumsum along a middle dimension was 10x slower.)"""
    total = per_tile[0].clone()
    for tile in per_tile[1:]:
        total += tile
    return total


def check_invariant_attention(heads: tuple[int, int, int] = (9, 3, 64), positions: int = 300) -> None:
    """RuntimeError unless this machine's kernels give a query the same bits in every layout a step
    can put it in. The rules above (rows per matrix, keys per tile) were measured on one CPU and
    torch build; another (AVX-512, MKL_CBWR, ...) may dispatch to kernels that round otherwise."""
    q_heads, kv_heads, d = heads
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(positions, h, d, generator=g) for h in (q_heads, kv_heads, kv_heads))

    def queries(first: int, end: int, extra_tiles: int = 0) -> torch.Tensor:
        length = (-(-end // TILE) + extra_tiles) * TILE
        slots = torch.arange(length).clamp(max=end - 1)[None]
        allowed = torch.ones(end - first, length, dtype=torch.bool).tril(first)[None]
        return invariant_attention(q[None, first:end], k, v, InvariantContext.of(slots, allowed, kv_heads))[0]

    whole = queries(0, positions)
    same = all(torch.equal(queries(a, b, x), whole[a:b]) for a, b, x in ((0, 37, 1), (37, positions, 0), (100, 102, 2)))
    decoded = [5, 63, 64, 200, positions - 1]
    length = -(-positions // TILE) * TILE
    slots = torch.stack([torch.arange(length).clamp(max=p) for p in decoded])
    allowed = torch.stack([torch.arange(length) <= p for p in decoded])[:, None]
    out = invariant_attention(q[decoded][:, None], k, v, InvariantContext.of(slots, allowed, kv_heads))
    same = same and all(torch.equal(out[i, 0], whole[p]) for i, p in enumerate(decoded))
    if not same:
        raise RuntimeError(
            "batch-invariant attention does not hold with this machine's torch kernels (their "
            "rounding depends on shapes differently than where it was measured): run without it"
        )
