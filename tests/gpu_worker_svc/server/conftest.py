"""One real worker (default model, TP=1, a small KV cache) shared by the module that asks for it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shardline.core.ports import free_port
from tests.gpu_worker_svc.server.harness import SchedulerStandIn, WorkerProcess

# 64 blocks of 16 tokens for SmolLM2-135M in float32 (737,280 bytes per block).
KV_CACHE_BYTES = 64 * 737_280


@pytest.fixture(scope="module")
def scheduler() -> Iterator[SchedulerStandIn]:
    standin = SchedulerStandIn()
    yield standin
    standin.stop()


@pytest.fixture(scope="module")
def worker(scheduler, tmp_path_factory) -> Iterator[tuple[WorkerProcess, object]]:
    """(process, the WorkerInfo it registered)."""
    port = free_port()
    proc = WorkerProcess(
        [
            "--port",
            str(port),
            "--worker-id",
            "worker-test",
            "--scheduler",
            scheduler.address,
            "--kv-cache-bytes",
            str(KV_CACHE_BYTES),
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "256",
        ],
        tmp_path_factory.mktemp("worker") / "worker.log",
    )
    try:
        yield proc, proc.wait_registered(scheduler)
    finally:
        proc.stop()
