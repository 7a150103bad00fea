"""The CPU decode step's shortcuts change nothing but speed: they are bitwise the long way round."""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from gpu_worker_svc.model.attention_metadata import StepBatch, build_step
from gpu_worker_svc.model.layers.attention import PagedAttention
from gpu_worker_svc.model.layers.layernorm import RMSNorm

BLOCK = 16


def decode_batch(contexts: list[int]) -> StepBatch:
    blocks = -(-(max(contexts) + 1) // BLOCK)
    tables = torch.randperm(64)[: len(contexts) * blocks].view(len(contexts), blocks)
    n = len(contexts)
    return StepBatch(torch.zeros(n, dtype=torch.long), torch.tensor(contexts), torch.ones(n, dtype=torch.long), tables)


def test_decodes_of_one_length_need_no_mask():
    _, meta = build_step(decode_batch([40, 40, 40]), BLOCK)
    assert meta.decode_mask is None
    _, meta = build_step(decode_batch([40, 17, 40]), BLOCK)
    assert meta.decode_mask is not None
    assert meta.decode_mask[1, 0, 0].tolist() == [True] * 18 + [False] * 23


def test_unmasked_decode_attention_is_bitwise_the_masked_one():
    torch.manual_seed(0)
    heads, kv_heads, dim, n = 9, 3, 64, 4
    attention = PagedAttention(heads, kv_heads, dim)
    cache = torch.randn(2, 64, BLOCK, kv_heads, dim)
    _, meta = build_step(decode_batch([150] * n), BLOCK)
    q, k, v = torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    unmasked = attention(q, k, v, cache, meta)
    meta.decode_mask = torch.ones(n, 1, 1, meta.decode_gather.shape[1], dtype=torch.bool)
    assert torch.equal(unmasked, attention(q, k, v, cache, meta))


def test_cpu_rms_norm_is_bitwise_hf():
    torch.manual_seed(0)
    ours, hf = RMSNorm(576, 1e-5, torch.float32), LlamaRMSNorm(576, eps=1e-5)
    weight = torch.rand(576) + 0.5
    ours.weight.data.copy_(weight)
    hf.weight.data.copy_(weight)
    for rows in (1, 3, 16, 130):
        x, residual = torch.randn(rows, 576) * 4, torch.randn(rows, 576)
        assert torch.equal(ours(x), hf(x))
        out, summed = ours(x, residual)
        assert torch.equal(summed, x + residual) and torch.equal(out, hf(x + residual))
