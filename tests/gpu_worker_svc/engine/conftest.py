"""Factories for the engine's pure-Python tests: no model, no device."""

import time
from collections.abc import Callable

import pytest

from gpu_worker_svc.engine.batch_scheduler import BatchScheduler, SchedulerConfig
from gpu_worker_svc.engine.block_pool import BlockPool
from gpu_worker_svc.engine.sampling_params import SamplingParams
from gpu_worker_svc.engine.sequence import Sequence

EOS = 2
BLOCK_SIZE = 4


@pytest.fixture
def create_scheduler() -> Callable[..., BatchScheduler]:
    def create(
        num_blocks: int = 64,
        block_size: int = BLOCK_SIZE,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 64,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        background_priority: int | None = None,
        background_max_seqs: int = 4,
        background_grace_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        max_loras_per_batch: int = 4,
    ) -> BatchScheduler:
        config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            background_priority=background_priority,
            background_max_seqs=background_max_seqs,
            background_grace_s=background_grace_s,
            max_loras_per_batch=max_loras_per_batch,
        )
        pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        return BatchScheduler(config, pool, clock)

    return create


@pytest.fixture
def create_requests() -> Callable[..., list[Sequence]]:
    """Sequences with distinct prompts (token ids >= 100, so never EOS).

    `same_prompt=True` gives every request the same prompt, `prompts` sets each
    one; `priorities` and `arrival_times` set those fields per request.
    """

    def create(
        num_requests: int,
        num_tokens: int = 10,
        max_tokens: int = 8,
        same_prompt: bool = False,
        priorities: list[int] | None = None,
        arrival_times: list[float] | None = None,
        prompts: list[list[int]] | None = None,
        prefix: str = "req",
        **params: object,
    ) -> list[Sequence]:
        seqs = []
        for i in range(num_requests):
            base = 100 if same_prompt else 100 + 1000 * i
            prompt = prompts[i] if prompts else list(range(base, base + num_tokens))
            seqs.append(
                Sequence(
                    request_id=f"{prefix}{i}",
                    prompt_token_ids=prompt,
                    params=SamplingParams(max_tokens=max_tokens, seed=i, **params),
                    eos_token_id=EOS,
                    priority=priorities[i] if priorities else 0,
                    arrival_time=arrival_times[i] if arrival_times else float(i),
                )
            )
        return seqs

    return create
