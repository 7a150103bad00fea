"""kernels/rotary_cache.cpp and kernels/silu_mul.cpp: a layer's rotary embedding with its KV cache
write, and its gated activation, each one CPU op, close to torch's spelling and the same bits for a
row at any row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker_svc.model.layers.kernels import cpu_kernels
from gpu_worker_svc.model.layers.rotary import RotaryEmbedding

rope_cache_write, silu_mul = cpu_kernels.rope_cache_write(), cpu_kernels.silu_mul()
pytestmark = pytest.mark.skipif(rope_cache_write is None, reason="the CPU kernels cannot be built here")

HEADS, KV_HEADS, DIM, BLOCKS, BLOCK = 9, 3, 64, 6, 4


def case(rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * DIM, generator=g)
    rotary = RotaryEmbedding(DIM, 256, 10000.0, None, torch.float32)
    cos, sin_signed = rotary.prepare(torch.randint(0, 256, (rows,), generator=g))
    slots = torch.randperm(BLOCKS * BLOCK, generator=g)[:rows]
    return qkv, cos, sin_signed, slots


def test_rope_cache_write_rotates_as_torch_and_writes_only_the_step_slots():
    qkv, cos, sin_signed, slots = case(7)
    cache = torch.zeros(2, BLOCKS, BLOCK, KV_HEADS, DIM)
    q = rope_cache_write(qkv, cos, sin_signed, slots, cache, HEADS, KV_HEADS)
    expected = RotaryEmbedding.apply(
        qkv[:, : (HEADS + KV_HEADS) * DIM].view(-1, HEADS + KV_HEADS, DIM), (cos, sin_signed)
    )
    assert q.shape == (7, HEADS, DIM) and q.is_contiguous()
    torch.testing.assert_close(q, expected[:, :HEADS], rtol=0, atol=1e-6)
    keys, values = cache.view(2, -1, KV_HEADS, DIM).unbind(0)
    torch.testing.assert_close(keys[slots], expected[:, HEADS:], rtol=0, atol=1e-6)
    assert torch.equal(values[slots], qkv[:, (HEADS + KV_HEADS) * DIM :].view(-1, KV_HEADS, DIM))
    untouched = torch.ones(BLOCKS * BLOCK, dtype=torch.bool)
    untouched[slots] = False
    assert not keys[untouched].any() and not values[untouched].any()


def test_rope_cache_write_gives_a_row_the_same_bits_alone_or_among_many():
    qkv, cos, sin_signed, slots = case(80, seed=1)  # past the op's 64-row grain: two threads share the rows
    together = torch.zeros(2, BLOCKS * 4, BLOCK * 4, KV_HEADS, DIM)
    alone = torch.zeros_like(together)
    slots = torch.randperm(together[0].numel() // (KV_HEADS * DIM))[:80]
    q = rope_cache_write(qkv, cos, sin_signed, slots, together, HEADS, KV_HEADS)
    for i in range(80):
        row = slice(i, i + 1)
        assert torch.equal(
            rope_cache_write(qkv[row], cos[row], sin_signed[row], slots[row], alone, HEADS, KV_HEADS), q[row]
        )
    assert torch.equal(alone, together)


def test_rope_cache_write_refuses_a_slot_outside_the_cache():
    qkv, cos, sin_signed, slots = case(2)
    cache = torch.zeros(2, BLOCKS, BLOCK, KV_HEADS, DIM)
    with pytest.raises(RuntimeError, match="a slot outside the cache"):
        rope_cache_write(qkv, cos, sin_signed, torch.tensor([0, BLOCKS * BLOCK]), cache, HEADS, KV_HEADS)
    assert not cache.any()  # checked before anything is written


@pytest.mark.parametrize("n", [1536, 1000, 7])  # whole vectors; a tail of 8; a tail alone
def test_silu_mul_is_torchs_within_float_rounding_at_any_magnitude(n):
    g = torch.Generator().manual_seed(n)
    gate = torch.randn(5, n, generator=g) * torch.tensor([0.01, 1.0, 10.0, 50.0, 100.0])[:, None]
    up = torch.randn(5, n, generator=g)
    out = silu_mul(torch.cat([gate, up], dim=1))
    expected = F.silu(gate.double()) * up.double()
    assert out.shape == (5, n) and torch.isfinite(out).all()
    torch.testing.assert_close(
        out.double(), expected, rtol=1e-6, atol=1e-35
    )  # below -87, e^g is 0: silu(g) is -0.0, not -1e-36


def test_silu_mul_gives_a_row_the_same_bits_alone_or_among_many():
    gate_up = torch.randn(300, 2 * 1000, generator=torch.Generator().manual_seed(3)) * 4
    together = silu_mul(gate_up)
    assert all(torch.equal(silu_mul(gate_up[i : i + 1]), together[i : i + 1]) for i in range(300))
