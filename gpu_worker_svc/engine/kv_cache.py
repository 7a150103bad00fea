"""Sizing and allocating the paged KV cache of one tensor-parallel rank."""

from __future__ import annotations

import logging

import torch

from gpu_worker_svc.model.families.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    """K and V of `block_size` tokens across every layer, for this rank's KV heads."""
    attn = model.attention()
    per_token = 2 * model.config.num_layers * attn.num_kv_heads * attn.head_dim * dtype.itemsize
    return per_token * block_size


def num_blocks_for(
    model: LlamaForCausalLM,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    cpu_kv_bytes: int,
    gpu_memory_utilization: float,
) -> int:
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


def allocate_kv_cache(
    model: LlamaForCausalLM, num_blocks: int, block_size: int, dtype: torch.dtype, device: str
) -> list[torch.Tensor]:
    attn = model.attention()
    shape = (2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.config.num_layers)]


def profile_forward(model: LlamaForCausalLM, num_tokens: int, block_size: int, dtype: torch.dtype, device: str) -> None:
    """Run the largest prefill step once, so the peak activation memory is known before sizing the cache."""
    run_prefill(model, torch.zeros(num_tokens, dtype=torch.long), block_size, dtype, device, all_logits=False)
    torch.cuda.synchronize()


def calibration_prefill(
    model: LlamaForCausalLM, block_size: int, dtype: torch.dtype, device: str, num_tokens: int = 256
) -> None:
    """One prefill of fixed random token ids (the same on every rank), for int8 calibration."""
    ids = torch.randint(0, model.config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))
    run_prefill(model, ids, block_size, dtype, device, all_logits=True)


@torch.inference_mode()
def run_prefill(
    model: LlamaForCausalLM, token_ids: torch.Tensor, block_size: int, dtype: torch.dtype, device: str, all_logits: bool
) -> None:
    """Prefill `token_ids` as one sequence in a private, throwaway KV cache."""
    from gpu_worker_svc.model.attention_metadata import StepBatch, build_step

    # Positions past the rotary table would index out of bounds; a step never goes past it either.
    token_ids = token_ids[: model.model.rotary.cos.shape[0]]
    n_tokens = token_ids.numel()
    n_blocks = -(-n_tokens // block_size)
    caches = allocate_kv_cache(model, n_blocks, block_size, dtype, device)
    batch = StepBatch(token_ids, torch.tensor([0]), torch.tensor([n_tokens]), torch.arange(n_blocks).view(1, -1))
    positions, meta = build_step(batch, block_size, device)
    hidden = model(batch.token_ids.to(device), positions, meta, caches)
    model.compute_logits(hidden if all_logits else hidden[-1:])
    del caches, hidden
