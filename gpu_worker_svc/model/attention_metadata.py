"""Per-step attention inputs, built once per engine step and shared by every layer.

The flat batch mixes prefill chunks and single-token decodes in any order. A step is
described by three small integer arrays per sequence (tokens already cached,
tokens new this step, block table), which is all rank 0 has to broadcast: every
rank then builds identical metadata locally.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# Keys per tile of batch-invariant attention (layers/invariant_attention.py), which sums tile by
# tile: its contexts are padded to a multiple of it (and so to 12 keys or more, for its bmm).
# The layout is decided here, so the layers depend on this module and not the other way round.
TILE = 64


@dataclass(slots=True)
class StepBatch:
    """What one engine step computes, as rank 0 broadcasts it to the other ranks."""

    token_ids: torch.Tensor  # [T] long: the new tokens of every sequence, prefills first
    num_computed: torch.Tensor  # [B] long: tokens of each sequence already in the KV cache
    num_new: torch.Tensor  # [B] long: tokens of each sequence computed this step
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with 0
    step: int = 0  # the engine's step counter, so every rank labels its trace spans alike
    # [B] long: how many leading new tokens of each sequence also need their logits (prompt
    # logprobs); every rank takes part in the LM head's gather for them. None: none do.
    prompt_logits: torch.Tensor | None = None
    # [B] long: how many trailing new tokens of each sequence give logits to sample from: 1, or with
    # n-gram speculation 1 + its draft tokens. None: 1 each.
    num_logits: torch.Tensor | None = None
    # [B] long: each sequence's LoRA adapter slot (1..max_loras_per_batch), 0 for the base model.
    # None: no sequence uses an adapter.
    lora_slots: torch.Tensor | None = None

    def pack(self) -> torch.Tensor:
        """One int64 tensor: a 4-int header, then the arrays back to back."""
        b, m = self.block_tables.shape
        header = torch.tensor([self.token_ids.numel(), b, m, self.step], dtype=torch.long)
        prompt = self.prompt_logits if self.prompt_logits is not None else torch.zeros(b, dtype=torch.long)
        logits = self.num_logits if self.num_logits is not None else torch.ones(b, dtype=torch.long)
        lora = self.lora_slots if self.lora_slots is not None else torch.zeros(b, dtype=torch.long)
        return torch.cat(
            [header, self.token_ids, self.num_computed, self.num_new, prompt, logits, lora, self.block_tables.flatten()]
        )

    @staticmethod
    def packed_size(header: torch.Tensor) -> int:
        t, b, m = (int(x) for x in header[:3])
        return 4 + t + 5 * b + b * m

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> StepBatch:
        t, b, m, step = (int(x) for x in packed[:4])
        body = packed[4:]
        prompt = body[t + 2 * b : t + 3 * b]
        logits = body[t + 3 * b : t + 4 * b]
        lora = body[t + 4 * b : t + 5 * b]
        return cls(
            body[:t],
            body[t : t + b],
            body[t + b : t + 2 * b],
            body[t + 5 * b :].view(b, m),
            step,
            prompt if bool(prompt.any()) else None,
            logits if bool((logits != 1).any()) else None,
            lora if bool(lora.any()) else None,
        )

    def lora_select(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor | None:
        """LoraStep.select for this step: [T, n] one-hot of each new token's adapter slot among 1..n (n the
        highest slot in use); None when no sequence uses an adapter."""
        if self.lora_slots is None or not bool(self.lora_slots.any()):
            return None
        per_token = torch.repeat_interleave(self.lora_slots, self.num_new)
        n = int(self.lora_slots.max())
        return torch.nn.functional.one_hot(per_token, n + 1)[:, 1:].to(device=device, dtype=dtype)

    def logit_rows(self) -> torch.Tensor:
        """Flat-batch rows whose logits are sampled: each sequence's last num_logits rows, in order."""
        ends = torch.cumsum(self.num_new, 0) - 1
        if self.num_logits is None:
            return ends
        counts = self.num_logits
        first = torch.repeat_interleave(ends - counts + 1, counts)
        within = torch.arange(first.numel()) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        return first + within

    def prompt_logit_rows(self) -> torch.Tensor:
        """Flat-batch rows whose logits `prompt_logits` asks for, in batch order."""
        if self.prompt_logits is None:
            return torch.empty(0, dtype=torch.long)
        starts = torch.cumsum(self.num_new, 0) - self.num_new
        return torch.cat([torch.arange(s, s + k) for s, k in zip(starts.tolist(), self.prompt_logits.tolist())])


@dataclass(slots=True)
class AttentionMetadata:
    """Where each new token's K/V goes and what each query attends to."""

    slot_mapping: torch.Tensor  # [T] long: cache slot (block * block_size + offset) of each new token
    prefill_bounds: list[tuple[int, int]]  # [start, end) of each multi-token chunk in the flat batch
    prefill_gather: list[torch.Tensor | None]  # slots of positions [0, context) when a prefix is cached, else None
    prefill_mask: list[torch.Tensor | None]  # [n, context] bool causal mask of such a chunk, shared by every layer
    # [B_decode] flat-batch index of each single-token chunk. With draft tokens (decode_queries > 1):
    # the flat-batch rows of every decode query, in order.
    decode_index: torch.Tensor | None
    decode_gather: torch.Tensor | None  # [B_decode, L] slots of each decode's context, padded
    # [B_decode, 1, Q, L] bool: True where a key is attended. None when every decode's context is
    # L long and Q is 1 (always so at batch 1): SDPA is then cheaper, and its result is bitwise the same.
    decode_mask: torch.Tensor | None
    # On CPU, decodes whose contexts differ widely, split into groups each padded only to its own
    # longest; empty: one group, the two fields above (always so on CUDA, whose graphs take one).
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    # Batch-invariant attention (layers/invariant_attention.py): every chunk and decode gathers its
    # context from the cache, padded to a multiple of its TILE keys, and has a mask.
    invariant: bool = False
    # N-gram speculation: a decode with draft tokens has a query for its last token and one per
    # draft, all attended in one call with the plain decodes, each padded to Q queries:
    decode_queries: int = 1  # Q, the most queries of one decode
    decode_query_rows: torch.Tensor | None = None  # [B_decode * Q] flat-batch rows (padding repeats the last)
    decode_valid: torch.Tensor | None = None  # places in [B_decode * Q] of the real queries, as decode_index
    # What the first layer derives from the fields above for all of them (invariant: the gathers' rows).
    derived: dict[str, Any] = field(default_factory=dict)

    def tensors(self) -> list[tuple[tuple[str, int | None], torch.Tensor]]:
        """Every tensor of the metadata, keyed by (field, place in its list or None); not the groups'."""
        found: list[tuple[tuple[str, int | None], torch.Tensor]] = []
        for name in _TENSOR_FIELDS:
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                found.append(((name, None), value))
            elif isinstance(value, list):
                found += [((name, i), t) for i, t in enumerate(value) if t is not None]
        return found

    def replace_tensors(self, tensors: list[tuple[tuple[str, int | None], torch.Tensor]]) -> None:
        """Puts tensors() back, moved: the same keys, new tensors."""
        for (name, i), t in tensors:
            if i is None:
                setattr(self, name, t)
            else:
                getattr(self, name)[i] = t


_TENSOR_FIELDS = (
    "slot_mapping",
    "prefill_gather",
    "prefill_mask",
    "decode_index",
    "decode_gather",
    "decode_mask",
    "decode_query_rows",
    "decode_valid",
)


@dataclass(slots=True)
class DecodeGroup:
    """Some of a step's decodes, whose contexts are within 2x of each other."""

    rows: torch.Tensor  # [b] long: their places among the step's decodes
    gather: torch.Tensor  # [b, L] slots of each one's context, padded to the group's longest
    mask: torch.Tensor | None  # [b, 1, 1, L] bool, or None when all are L long


# A decode joins a group while its context is at most this many times the group's shortest:
# padding then costs a group at most that factor, and a long context (8k tokens) no longer makes
# every short decode of the step gather and attend over its length, in every layer.
DECODE_GROUP_SPREAD = 2


def build_step(
    batch: StepBatch,
    block_size: int,
    device: torch.device | str = "cpu",
    invariant: bool = False,
    group_decodes: bool | None = None,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions [T] and attention metadata for a step; `invariant` lays it out for invariant_attention.

    A sequence's chunk of draft tokens (num_logits > 1) is attended as a decode of several queries;
    under `invariant` as a chunk of its own, like a prefill's. `group_decodes`: split decodes by
    context length (DecodeGroup); None: on CPU only, as CUDA graphs take one group.
    """
    if group_decodes is None:
        group_decodes = str(device) == "cpu"
    num_new = batch.num_new.tolist()
    num_logits = batch.num_logits.tolist() if batch.num_logits is not None and not invariant else [1] * len(num_new)
    # Every sequence a plain decode (the common step): one token each, at its computed length, and
    # none of the per-sequence work of chunks. Built with a few whole-batch ops, whatever the batch.
    all_decodes = len(batch.token_ids) == len(num_new) and num_new == num_logits
    positions, slot_mapping = _positions_and_slots(batch, block_size, all_decodes)
    if all_decodes:
        chunks, decodes = _Chunks(), list(range(len(num_new)))
    else:
        chunks, decodes = _chunks_and_decodes(batch, block_size, device, invariant, num_logits)
    layout = _decode_layout(batch, decodes, block_size, device, invariant, group_decodes)
    meta = AttentionMetadata(
        slot_mapping.to(device),
        chunks.bounds,
        chunks.gathers,
        chunks.masks,
        layout.index,
        layout.gather,
        layout.mask,
        layout.groups,
        invariant,
        decode_queries=layout.queries,
        decode_query_rows=layout.query_rows,
        decode_valid=layout.valid,
    )
    return positions.to(device), meta


def _positions_and_slots(batch: StepBatch, block_size: int, all_decodes: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's position in its sequence, and the KV-cache slot it is written to."""
    if all_decodes:
        positions = batch.num_computed.clone()
        seq_of_token = torch.arange(len(batch.num_new))
    else:
        seq_of_token = torch.repeat_interleave(torch.arange(len(batch.num_new)), batch.num_new)
        starts = torch.cumsum(batch.num_new, 0) - batch.num_new
        positions = batch.num_computed[seq_of_token] + torch.arange(len(seq_of_token)) - starts[seq_of_token]
    bt = batch.block_tables
    return positions, bt[seq_of_token, positions // block_size] * block_size + positions % block_size


@dataclass(slots=True)
class _Chunks:
    """The prefill chunks of a step: each one's token range, and its keys and mask (None: the chunk
    is its whole context, and attends causally to itself)."""

    bounds: list[tuple[int, int]] = field(default_factory=list)
    gathers: list[torch.Tensor | None] = field(default_factory=list)
    masks: list[torch.Tensor | None] = field(default_factory=list)


def _chunks_and_decodes(
    batch: StepBatch, block_size: int, device: torch.device | str, invariant: bool, num_logits: list[int]
) -> tuple[_Chunks, list[int]]:
    """The step's prefill chunks, and the sequence index of each decode (with its drafts, if any)."""
    chunks, decodes = _Chunks(), []
    bt = batch.block_tables
    start = 0
    for i, (c, n) in enumerate(zip(batch.num_computed.tolist(), batch.num_new.tolist())):
        if n == num_logits[i]:
            decodes.append(i)
        else:
            chunks.bounds.append((start, start + n))
            if c == 0 and not invariant:
                chunks.gathers.append(None)
                chunks.masks.append(None)
            else:
                pos = _padded(c + n, invariant)
                chunks.gathers.append((bt[i, pos // block_size] * block_size + pos % block_size).to(device))
                # The chunk ends the context: query i sees positions up to c + i (never the padding).
                chunks.masks.append(torch.ones(n, len(pos), dtype=torch.bool, device=device).tril(c))
        start += n
    return chunks, decodes


@dataclass(slots=True)
class _DecodeLayout:
    """Where a step's decodes read their queries and keys: AttentionMetadata's decode_* fields."""

    index: torch.Tensor | None = None
    gather: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    query_rows: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    groups: list[DecodeGroup] = field(default_factory=list)
    queries: int = 1


def _decode_layout(
    batch: StepBatch,
    decodes: list[int],
    block_size: int,
    device: torch.device | str,
    invariant: bool,
    group_decodes: bool,
) -> _DecodeLayout:
    """The decodes' query rows, their contexts' slots and masks, in one group or split by context length."""
    layout = _DecodeLayout()
    if not decodes:
        return layout
    bt = batch.block_tables
    rows = torch.tensor(decodes)
    ends = torch.cumsum(batch.num_new, 0) - 1
    n = batch.num_new[rows]
    ctx = batch.num_computed[rows] + n  # keys: the context through the decode's last query
    layout.queries = queries = int(n.max())
    if queries == 1:
        layout.index = ends[rows].to(device)
    else:
        j = torch.arange(queries)
        padded = (ends[rows] - n + 1)[:, None] + torch.minimum(j[None, :], (n - 1)[:, None])
        real = (j[None, :] < n[:, None]).flatten()
        layout.query_rows, layout.valid = padded.flatten().to(device), real.nonzero().flatten().to(device)
        layout.index = padded.flatten()[real].to(device)
    split = _by_context(ctx.tolist()) if group_decodes else []
    if len(split) > 1:
        layout.groups = [
            DecodeGroup(
                torch.tensor(g).to(device),
                *_decode_context(bt[rows[g]], ctx[g], block_size, device, invariant, n[g], queries),
            )
            for g in split
        ]
    else:
        layout.gather, layout.mask = _decode_context(bt[rows], ctx, block_size, device, invariant, n, queries)
    return layout


def _padded(length: int, invariant: bool) -> torch.Tensor:
    """Positions [0, length), or under `invariant` to a multiple of TILE, the padding repeating the
    last position (a real slot, so it holds finite values; the masks hide it)."""
    if not invariant:
        return torch.arange(length)
    return torch.arange(-(-length // TILE) * TILE).clamp_(max=length - 1)


def _decode_context(
    tables: torch.Tensor,
    ctx: torch.Tensor,
    block_size: int,
    device: torch.device | str,
    invariant: bool = False,
    num_queries: torch.Tensor | None = None,
    queries: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Slots of each decode's context, padded to the longest, and the mask of the padding (None: none).

    With `queries` > 1, decode i has num_queries[i] of them, the last at position ctx[i] - 1: query j
    sees the keys up to its own position (a padded query, the keys of the decode's last one)."""
    pos = _padded(int(ctx.max()), invariant)
    gather = (tables[:, pos // block_size] * block_size + pos % block_size).to(device)
    if queries == 1:
        if int(ctx.min()) == len(pos) and not invariant:
            return gather, None
        return gather, (torch.arange(len(pos))[None, :] < ctx[:, None])[:, None, None, :].to(device)
    assert num_queries is not None
    seen = torch.minimum(ctx[:, None] - num_queries[:, None] + 1 + torch.arange(queries)[None, :], ctx[:, None])
    return gather, (torch.arange(len(pos))[None, None, :] < seen[:, :, None])[:, None].to(device)


def _by_context(lengths: list[int]) -> list[list[int]]:
    """Indices of `lengths` in groups whose longest is at most DECODE_GROUP_SPREAD x their shortest."""
    groups: list[list[int]] = []
    shortest = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if not groups or lengths[i] > DECODE_GROUP_SPREAD * shortest:
            groups.append([])
            shortest = lengths[i]
        groups[-1].append(i)
    return groups
