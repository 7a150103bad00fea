"""The CPU step's shortcuts change nothing but speed: they are bitwise the long way round, or take the fast kernel."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from gpu_worker_svc.model.attention_metadata import StepBatch, _decode_context, build_step
from gpu_worker_svc.model.layers.attention import PagedAttention
from gpu_worker_svc.model.layers.kernels import cpu_kernels
from gpu_worker_svc.model.layers.layernorm import RMSNorm

BLOCK = 16


def decode_batch(contexts: list[int], num_blocks: int = 64) -> StepBatch:
    blocks = -(-(max(contexts) + 1) // BLOCK)
    tables = torch.randperm(num_blocks)[: len(contexts) * blocks].view(len(contexts), blocks)
    n = len(contexts)
    return StepBatch(torch.zeros(n, dtype=torch.long), torch.tensor(contexts), torch.ones(n, dtype=torch.long), tables)


@pytest.fixture(params=["kernel", "torch"])
def decode_path(request, monkeypatch) -> str:
    """Decode attention by kernels/decode_attention.cpp, or by the torch path it replaces on CPU."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_kernels, "paged_decode_attention", lambda: None)
    elif cpu_kernels.paged_decode_attention() is None:
        pytest.skip("the CPU kernels cannot be built on this machine")
    return request.param


def test_decodes_of_one_length_need_no_mask():
    _, meta = build_step(decode_batch([40, 40, 40]), BLOCK)
    assert meta.decode_mask is None
    _, meta = build_step(decode_batch([40, 25, 40]), BLOCK)
    assert meta.decode_mask is not None
    assert meta.decode_mask[1, 0, 0].tolist() == [True] * 26 + [False] * 15


def test_a_long_context_is_attended_apart_from_short_ones(decode_path):
    """One long context must not make every short decode of the step gather and attend over its
    length in every layer: decodes split into groups within 2x of each other, with the same result."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 9, 3, 64
    attention = PagedAttention(heads, kv_heads, dim)
    contexts = [150, 3000, 160, 90, 2900]
    batch = decode_batch(contexts, num_blocks=1024)
    cache = torch.randn(2, 1024, BLOCK, kv_heads, dim)
    _, meta = build_step(batch, BLOCK)
    assert meta.decode_gather is None
    assert [g.rows.tolist() for g in meta.decode_groups] == [[3, 0, 2], [4, 1]]
    assert [g.gather.shape[1] for g in meta.decode_groups] == [161, 3001]
    n = len(contexts)
    q, k, v = torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    grouped = attention(q, k, v, cache, meta)
    one_group = dataclasses.replace(meta, decode_groups=[])
    one_group.decode_gather, one_group.decode_mask = _decode_context(
        batch.block_tables, batch.num_computed + 1, BLOCK, "cpu"
    )
    torch.testing.assert_close(grouped, attention(q, k, v, cache, one_group), rtol=1e-5, atol=1e-6)


def test_unmasked_decode_attention_is_bitwise_the_masked_one(decode_path):
    torch.manual_seed(0)
    heads, kv_heads, dim, n = 9, 3, 64, 4
    attention = PagedAttention(heads, kv_heads, dim)
    cache = torch.randn(2, 64, BLOCK, kv_heads, dim)
    _, meta = build_step(decode_batch([150] * n), BLOCK)
    q, k, v = torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    unmasked = attention(q, k, v, cache, meta)
    meta.decode_mask = torch.ones(n, 1, 1, meta.decode_gather.shape[1], dtype=torch.bool)
    assert torch.equal(unmasked, attention(q, k, v, cache, meta))


def _norms() -> tuple[RMSNorm, LlamaRMSNorm]:
    ours, hf = RMSNorm(576, 1e-5, torch.float32), LlamaRMSNorm(576, eps=1e-5)
    weight = torch.rand(576) + 0.5
    ours.weight.data.copy_(weight)
    hf.weight.data.copy_(weight)
    return ours, hf


def test_cpu_rms_norm_without_the_kernel_is_bitwise_hf(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "rms_norm", lambda: None)
    torch.manual_seed(0)
    ours, hf = _norms()
    for rows in (1, 3, 16, 63, 64, 65, 130, 2048):  # torch.rms_norm below 64 rows, HF's form from there
        x, residual = torch.randn(rows, 576) * 4, torch.randn(rows, 576)
        assert torch.equal(ours(x), hf(x))
        out, summed = ours(x, residual)
        assert torch.equal(summed, x + residual) and torch.equal(out, hf(x + residual))


@pytest.mark.skipif(cpu_kernels.rms_norm() is None, reason="the CPU kernels cannot be built here")
def test_the_norm_kernel_is_hf_within_rounding_and_a_rows_own_at_any_row_count():
    torch.manual_seed(0)
    ours, hf = _norms()
    x, residual = torch.randn(2048, 576) * 4, torch.randn(2048, 576)
    whole, summed = ours(x, residual)
    assert torch.equal(summed, x + residual)  # the add is exact either way
    torch.testing.assert_close(whole, hf(x + residual), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(ours(x), hf(x), rtol=2e-6, atol=2e-6)
    for first, rows in ((0, 1), (5, 3), (100, 64), (300, 700)):
        part = slice(first, first + rows)
        assert torch.equal(ours(x[part], residual[part])[0], whole[part])


def test_a_worker_checks_that_its_two_norm_paths_agree(monkeypatch):
    # Batch invariance needs a row's norm to be the same bits whichever path its step's row count
    # picks: two torch paths where the norm kernel cannot be built.
    monkeypatch.setattr(cpu_kernels, "rms_norm", lambda: None)
    norm = RMSNorm(576, 1e-5, torch.float32)
    norm.weight.data.uniform_(0.5, 1.5)
    norm.check_paths_agree()  # so on this machine
    fused = torch.rms_norm
    monkeypatch.setattr(torch, "rms_norm", lambda x, shape, w, eps: fused(x, shape, w, eps * 1.01))
    with pytest.raises(RuntimeError, match="torch.rms_norm"):
        norm.check_paths_agree()


def test_prefill_attention_takes_the_flash_kernel(monkeypatch):
    # Given 3-D inputs torch's CPU SDPA falls back to its unfused math path, 5-7x slower at 512
    # tokens: a prefill chunk, fresh or after a cached prefix, must reach the flash kernel where
    # the decode kernel does not take prefills (GPU, bf16; here: without the kernel).
    monkeypatch.setattr(cpu_kernels, "paged_decode_attention", lambda: None)
    torch.manual_seed(0)
    heads, kv_heads, dim = 9, 3, 64
    attention = PagedAttention(heads, kv_heads, dim)
    cache = torch.zeros(2, 64, BLOCK, kv_heads, dim)
    tables = torch.arange(8).view(1, 8)
    for cached, new in ((0, 40), (32, 20)):  # a first chunk; a chunk after 32 cached tokens
        _, meta = build_step(
            StepBatch(torch.zeros(new, dtype=torch.long), torch.tensor([cached]), torch.tensor([new]), tables), BLOCK
        )
        q, k, v = torch.randn(new, heads, dim), torch.randn(new, kv_heads, dim), torch.randn(new, kv_heads, dim)
        with torch.profiler.profile() as prof:
            attention(q, k, v, cache, meta)
        ops = {event.key for event in prof.key_averages()}
        assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops, (cached, sorted(ops))
        assert "aten::_scaled_dot_product_attention_math" not in ops


def test_chunks_of_one_length_attend_in_one_call_bitwise_as_apart(monkeypatch):
    """Without the decode kernel, a burst's prompts prefill in one SDPA call per run of equal chunks;
    each chunk's result is the same bits as attending alone (so batching never changes its tokens)."""
    monkeypatch.setattr(cpu_kernels, "paged_decode_attention", lambda: None)
    torch.manual_seed(0)
    heads, kv_heads, dim = 9, 3, 64
    attention = PagedAttention(heads, kv_heads, dim)
    cache = torch.randn(2, 256, BLOCK, kv_heads, dim)
    # Three 40-token prompts, a cached-prefix chunk, two 17-token prompts and a decode.
    computed, new = [0, 0, 0, 32, 0, 0, 50], [40, 40, 40, 8, 17, 17, 1]
    tables = torch.randperm(256)[: len(new) * 4].view(len(new), 4)
    batch = StepBatch(torch.zeros(len(new), dtype=torch.long), torch.tensor(computed), torch.tensor(new), tables)
    _, meta = build_step(batch, BLOCK)
    total = sum(new)
    q, k, v = torch.randn(total, heads, dim), torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    together = attention(q, k, v, cache.clone(), meta)
    assert meta.derived["self_attending"] == [(0, 40, 3), (128, 17, 2)]
    starts = [0, 40, 80, 128, 145]
    for start, n in zip(starts, [40, 40, 40, 17, 17]):
        alone = attention._sdpa(q[start : start + n], k[start : start + n], v[start : start + n], None, causal=True)
        assert torch.equal(together[start : start + n], alone.flatten(1))


@pytest.mark.skipif(cpu_kernels.paged_decode_attention() is None, reason="the CPU kernels cannot be built here")
@pytest.mark.parametrize("chunks", [[50], [20, 30], [1, 33, 16]])
def test_a_prefills_queries_are_the_bits_of_decoding_its_tokens_one_by_one(chunks):
    """On CPU a prefill's queries go through the decode kernel: its keys, values and outputs are the
    bits that decoding its tokens one at a time would give, however it is chunked and batched. A
    request recomputed elsewhere (failover, preemption) then goes on with the same tokens."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 9, 3, 64
    attention = PagedAttention(heads, kv_heads, dim)
    total = sum(chunks)
    q, k, v = torch.randn(total, heads, dim), torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    blocks = torch.randperm(64)
    tables = blocks[:8].view(1, 8)
    other = blocks[8:16].view(1, 8)  # a batch-mate's: a 40-token prompt prefilled alongside
    cache = torch.zeros(2, 64, BLOCK, kv_heads, dim)
    prefilled, done = [], 0
    for n in chunks:
        batch = StepBatch(
            torch.zeros(n + 40, dtype=torch.long),
            torch.tensor([done, 0]),
            torch.tensor([n, 40]),
            torch.cat([tables, other]),
        )
        _, meta = build_step(batch, BLOCK)
        mate = torch.randn(40, heads, dim), torch.randn(40, kv_heads, dim), torch.randn(40, kv_heads, dim)
        rows = slice(done, done + n)
        out = attention(
            torch.cat([q[rows], mate[0]]), torch.cat([k[rows], mate[1]]), torch.cat([v[rows], mate[2]]), cache, meta
        )
        prefilled.append(out[:n])
        done += n
    prefilled = torch.cat(prefilled)
    for position in range(total):  # each token decoded alone, over the same cache
        batch = StepBatch(torch.zeros(1, dtype=torch.long), torch.tensor([position]), torch.tensor([1]), tables)
        _, meta = build_step(batch, BLOCK)
        row = slice(position, position + 1)
        decoded = attention(q[row], k[row], v[row], cache.clone(), meta)
        assert torch.equal(decoded[0], prefilled[position]), position
