"""kernels/decode_attention.cpp: decode attention read in place from the paged KV cache, on CPU."""

from __future__ import annotations

import logging

import pytest
import torch

from gpu_worker_svc.model.attention_metadata import build_step
from gpu_worker_svc.model.layers import attention as attention_module
from gpu_worker_svc.model.layers.attention import PagedAttention
from gpu_worker_svc.model.layers.kernels import cpu_kernels, kernel_build
from tests.gpu_worker_svc.model.test_decode_fast_paths import BLOCK, decode_batch

kernel = cpu_kernels.paged_decode_attention()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the CPU kernels cannot be built on this machine")


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Softmax attention of each decode over its own slots (its last `window` only, if given), in float64."""
    group = q.shape[1] // k_cache.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rows = []
    for i, n in enumerate(lengths.tolist()):
        first = max(0, n - window) if window else 0
        k = k_cache[slots[i, first:n]].double().repeat_interleave(group, 1)  # [n - first, Hq, D]
        v = v_cache[slots[i, first:n]].double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", q[i].double(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        rows.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v).flatten())
    return torch.stack(rows).float()


def random_case(heads: int, kv_heads: int, dim: int, lengths: list[int], seed: int = 0, spread: float = 6):
    g = torch.Generator().manual_seed(seed)
    num_slots = sum(lengths) + 64
    k_cache = torch.randn(num_slots, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_slots, kv_heads, dim, generator=g)
    width = max(lengths) + 5  # padded wider than the longest, as a step's table may be
    slots = torch.stack([torch.randperm(num_slots, generator=g)[:width] for _ in lengths])
    # q as the model makes it: the query heads of a wider qkv row, so its rows are strided.
    qkv = torch.randn(len(lengths), heads + 2 * kv_heads, dim, generator=g) * spread
    return qkv[:, :heads], k_cache, v_cache, slots, torch.tensor(lengths)


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (8, 8, 64), (32, 8, 128), (4, 1, 16), (16, 1, 256)])
def test_the_kernel_is_softmax_attention_over_each_decodes_own_slots(heads, kv_heads, dim):
    lengths = [1, 17, 300, 16, 95]
    q, k_cache, v_cache, slots, lens = random_case(heads, kv_heads, dim, lengths)
    out = kernel(q, k_cache, v_cache, slots, lens, dim**-0.5)
    assert out.shape == (len(lengths), heads * dim)
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, slots, lens), rtol=2e-5, atol=2e-5)


@needs_kernel
def test_scores_far_below_the_max_underflow_to_zero_as_float32s_exp_does():
    """Scores spread over hundreds: most weights underflow, and exp's cut-off must not make inf or NaN."""
    q, k_cache, v_cache, slots, lens = random_case(9, 3, 64, [1, 50, 300], spread=60)
    out = kernel(q, k_cache, v_cache, slots, lens, 0.125)
    expected = reference(q, k_cache, v_cache, slots, lens)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_a_decode_gives_the_same_bits_alone_and_in_any_batch():
    """The engine's determinism: a row's result may not depend on its batch-mates or the table's padding."""
    q, k_cache, v_cache, slots, lens = random_case(9, 3, 64, [40, 211, 7, 128])
    batched = kernel(q, k_cache, v_cache, slots, lens, 0.125)
    for i, n in enumerate(lens.tolist()):
        alone = kernel(q[i : i + 1], k_cache, v_cache, slots[i : i + 1, :n].contiguous(), lens[i : i + 1], 0.125)
        assert torch.equal(alone, batched[i : i + 1])
    reordered = kernel(q.flip(0), k_cache, v_cache, slots.flip(0).contiguous(), lens.flip(0), 0.125)
    assert torch.equal(reordered.flip(0), batched)


@needs_kernel
def test_a_decode_with_drafts_attends_each_query_to_its_own_prefix():
    """q [B, Q, Hq, D]: a decode's token and its drafts, query j seeing lengths[b, j] keys. Each row is
    the same bits as that query attended alone as a plain decode of its length."""
    heads, kv_heads, dim = 9, 3, 64
    q3, k_cache, v_cache, slots, _ = random_case(heads, kv_heads, dim, [60, 200, 9])
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, heads, dim, generator=g) * 6
    lengths = torch.tensor([[57, 58, 59, 60], [200, 200, 200, 200], [6, 7, 8, 8]])  # the last: a padded query
    out = kernel(q, k_cache, v_cache, slots, lengths, dim**-0.5)
    assert out.shape == (3, 4, heads * dim)
    for j in range(4):
        torch.testing.assert_close(
            out[:, j], reference(q[:, j], k_cache, v_cache, slots, lengths[:, j]), rtol=2e-5, atol=2e-5
        )
        for i in range(3):
            alone = kernel(q[i : i + 1, j], k_cache, v_cache, slots[i : i + 1], lengths[i : i + 1, j], dim**-0.5)
            assert torch.equal(alone, out[i : i + 1, j])


@needs_kernel
@pytest.mark.parametrize("window, softcap", [(16, 0.0), (1, 0.0), (50, 0.0), (0, 3.0), (24, 2.0)])
def test_a_window_sees_each_querys_last_keys_and_softcap_caps_the_scores(window, softcap):
    """Sliding-window layers (Mistral, Gemma) and Gemma 2's score capping: each decode over its last `window`
    keys, its scores capped to softcap * tanh(score / softcap), against float64; and each row the same bits
    alone as in the batch, though a batch-mate's window starts elsewhere."""
    heads, kv_heads, dim = 8, 2, 32
    lengths = [1, 17, 300, 16, 95, 40]
    q, k_cache, v_cache, slots, lens = random_case(heads, kv_heads, dim, lengths, seed=3)
    scale = 0.3
    out = kernel(q, k_cache, v_cache, slots, lens, scale, window, softcap)
    expected = reference(q, k_cache, v_cache, slots, lens, scale, window, softcap)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)
    for i, n in enumerate(lengths):
        alone = kernel(
            q[i : i + 1], k_cache, v_cache, slots[i : i + 1, :n].contiguous(), lens[i : i + 1], scale, window, softcap
        )
        assert torch.equal(alone, out[i : i + 1])


@needs_kernel
def test_a_window_applies_to_each_draft_query_by_its_own_length():
    """A decode with drafts (or a piece of a prefill chunk): query j's window ends at its own length."""
    heads, kv_heads, dim = 4, 2, 16
    _, k_cache, v_cache, slots, _ = random_case(heads, kv_heads, dim, [60, 200, 9], seed=4)
    q = torch.randn(3, 4, heads, dim, generator=torch.Generator().manual_seed(2)) * 6
    lengths = torch.tensor([[57, 58, 59, 60], [197, 198, 199, 200], [6, 7, 8, 8]])
    out = kernel(q, k_cache, v_cache, slots, lengths, dim**-0.5, 12, 0.0)
    for j in range(4):
        expected = reference(q[:, j], k_cache, v_cache, slots, lengths[:, j], window=12)
        torch.testing.assert_close(out[:, j], expected, rtol=2e-5, atol=2e-5)


@needs_kernel
def test_bad_inputs_are_errors_not_crashes():
    q, k_cache, v_cache, slots, lens = random_case(9, 3, 64, [10, 20])
    with pytest.raises(RuntimeError, match="a length outside"):
        kernel(q, k_cache, v_cache, slots, torch.tensor([10, 999]), 0.125)
    bad_slots = slots.clone()
    bad_slots[1, 19] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="a slot outside the cache"):
        kernel(q, k_cache, v_cache, bad_slots, lens, 0.125)
    bad_slots[1, 19], bad_slots[1, 20] = 0, -5  # past the row's length: never read, so allowed
    kernel(q, k_cache, v_cache, bad_slots, lens, 0.125)
    with pytest.raises(RuntimeError, match="float32 only"):
        kernel(q.double(), k_cache, v_cache, slots, lens, 0.125)
    with pytest.raises(RuntimeError, match="head_dim"):
        kernel(q[..., :40], k_cache[..., :40].contiguous(), v_cache[..., :40].contiguous(), slots, lens, 0.125)


@needs_kernel
@pytest.mark.parametrize("contexts", [[150, 150, 150], [150, 3000, 160, 90, 2900], [5, 60, 33]])
def test_the_layer_takes_the_kernel_for_decodes_and_agrees_with_the_torch_path(monkeypatch, contexts):
    """Equal contexts (no mask), contexts of one group with a mask, and groups of widely different lengths."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 9, 3, 64
    layer = PagedAttention(heads, kv_heads, dim)
    cache = torch.randn(2, 1024, BLOCK, kv_heads, dim)
    _, meta = build_step(decode_batch(contexts, num_blocks=1024), BLOCK)
    n = len(contexts)
    q, k, v = torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    calls = []
    monkeypatch.setattr(cpu_kernels, "paged_decode_attention", lambda: lambda *a: calls.append(1) or kernel(*a))
    by_kernel = layer(q, k, v, cache.clone(), meta)
    assert calls, "the decode step did not take the kernel"
    monkeypatch.setattr(cpu_kernels, "paged_decode_attention", lambda: None)
    meta.derived.clear()
    torch.testing.assert_close(by_kernel, layer(q, k, v, cache.clone(), meta), rtol=1e-5, atol=1e-5)


def test_a_machine_that_cannot_build_the_kernels_takes_the_torch_path(monkeypatch, caplog):
    def no_compiler(*_args) -> None:
        raise kernel_build.KernelBuildError("no C++ compiler (c++: not found)")

    monkeypatch.setattr(cpu_kernels, "find_library", no_compiler)
    with caplog.at_level(logging.WARNING):
        assert cpu_kernels.library.__wrapped__() is None
    assert "cannot run here (no C++ compiler (c++: not found))" in caplog.text
    monkeypatch.setattr(attention_module.cpu_kernels, "paged_decode_attention", lambda: None)
    layer = PagedAttention(9, 3, 64)
    _, meta = build_step(decode_batch([30, 40]), BLOCK)
    out = layer(
        torch.randn(2, 9, 64), torch.randn(2, 3, 64), torch.randn(2, 3, 64), torch.randn(2, 64, BLOCK, 3, 64), meta
    )
    assert out.shape == (2, 9 * 64) and torch.isfinite(out).all()
