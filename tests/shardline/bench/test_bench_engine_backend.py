"""`shardline bench --engine`'s in-process backend: requests complete, and an engine failure fails them, never hangs."""

from __future__ import annotations

import asyncio

import pytest

from gpu_worker_svc.engine.llm_engine import EngineConfig
from gpu_worker_svc.engine.model_runner import RunnerConfig
from shardline.bench.engine_backend import EngineBackend
from shardline.bench.load import LoadSpec, run_load

pytestmark = pytest.mark.slow


def _config() -> EngineConfig:
    return EngineConfig(runner=RunnerConfig(model="dummy:smollm2-135m", num_blocks=64))


def test_engine_backend_completes_the_load():
    spec = LoadSpec(num_prompts=3, input_len=12, output_len=4, max_concurrency=3, vocab_size=49152)

    async def run():
        backend = EngineBackend(_config())
        try:
            return await run_load(spec, backend.send)
        finally:
            await backend.close()

    timings, _ = asyncio.run(run())
    assert [(t.ok, t.output_len) for t in timings] == [(True, 4)] * 3


def test_an_engine_failure_fails_every_open_request():
    spec = LoadSpec(num_prompts=3, input_len=12, output_len=4, max_concurrency=3, vocab_size=49152)

    async def run():
        backend = EngineBackend(_config())

        def broken_step():
            raise RuntimeError("rank 1 died")

        backend.engine.step = broken_step
        try:
            return await asyncio.wait_for(run_load(spec, backend.send), timeout=30)
        finally:
            await backend.close()

    timings, _ = asyncio.run(run())
    assert [t.ok for t in timings] == [False] * 3
    assert all("rank 1 died" in t.error for t in timings)


def test_a_burst_shares_the_first_step_as_in_the_worker():
    """With the worker's admission gap (200 ms here), requests arriving a few ms apart (Poisson, 200/s) are
    prefilled in one step, as the worker would, rather than the first alone."""
    spec = LoadSpec(num_prompts=6, input_len=12, output_len=2, request_rate=200.0, max_concurrency=6, vocab_size=49152)
    batch_sizes: list[int] = []

    async def run():
        backend = EngineBackend(_config(), admission_gap_s=0.2)
        step = backend.engine.step

        def recorded_step():
            out = step()
            batch_sizes.append(out.stats.batch_size)
            return out

        backend.engine.step = recorded_step
        try:
            return await run_load(spec, backend.send)
        finally:
            await backend.close()

    timings, _ = asyncio.run(run())
    assert all(t.ok for t in timings)
    assert batch_sizes[0] == 6
