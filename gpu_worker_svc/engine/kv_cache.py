"""Sizing and allocating the paged KV cache of one tensor-parallel rank."""

from __future__ import annotations

import logging

import torch

from gpu_worker_svc.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    """K and V of `block_size` tokens across every layer, for this rank's KV heads."""
    attn = model.model.layers[0].self_attn.attn
    per_token = 2 * model.config.num_layers * attn.num_kv_heads * attn.head_dim * dtype.itemsize
    return per_token * block_size


def num_blocks_for(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype, device: str,
                   cpu_kv_bytes: int, gpu_memory_utilization: float) -> int:
    """How many blocks fit: a byte budget on CPU, a share of free memory on GPU after a profiling pass."""
    per_block = bytes_per_block(model, block_size, dtype)
    if device == "cpu":
        budget = cpu_kv_bytes
    else:
        # After the profiling pass: what this process may still take = its share of the card,
        # less what other processes use, less our peak (weights + the largest step's activations).
        free, total = torch.cuda.mem_get_info()
        ours_reserved = torch.cuda.memory_reserved()
        used_by_others = total - free - ours_reserved
        budget = int(total * gpu_memory_utilization) - used_by_others - torch.cuda.max_memory_allocated()
    n = max(0, budget // per_block)
    if n == 0:
        raise ValueError(f"no room for a single KV block of {per_block} bytes (budget {budget} bytes)")
    return int(n)


def allocate_kv_cache(model: LlamaForCausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: str) -> list[torch.Tensor]:
    attn = model.model.layers[0].self_attn.attn
    shape = (2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.config.num_layers)]


@torch.inference_mode()
def profile_forward(model: LlamaForCausalLM, num_tokens: int, block_size: int, dtype: torch.dtype,
                    device: str) -> None:
    """Run the largest prefill step once, so the peak activation memory is known before sizing the cache."""
    from gpu_worker_svc.model.attention_metadata import StepBatch, build_step

    # Positions past the rotary table would index out of bounds; a step never goes past it either.
    num_tokens = min(num_tokens, model.model.layers[0].self_attn.rotary.cos.shape[0])
    n_blocks = -(-num_tokens // block_size)
    caches = allocate_kv_cache(model, n_blocks, block_size, dtype, device)
    batch = StepBatch(torch.zeros(num_tokens, dtype=torch.long), torch.tensor([0]), torch.tensor([num_tokens]),
                      torch.arange(n_blocks).view(1, -1))
    positions, meta = build_step(batch, block_size, device)
    hidden = model(batch.token_ids.to(device), positions, meta, caches)
    model.compute_logits(hidden[-1:])
    del caches, hidden
    torch.cuda.synchronize()
