"""The stack's CPU worker runs under the malloc settings that keep a step's freed buffers."""

from __future__ import annotations

import sys

import pytest

from gpu_worker_svc.server.settings import WorkerSettings
from shardline.core.host_memory import MALLOC_ENV, REEXEC_MARKER, users_own_malloc_settings


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, and /proc")
def test_the_cpu_worker_restarted_itself_under_the_malloc_settings(stack):
    if WorkerSettings(tracing=False).resolved_device != "cpu" or users_own_malloc_settings():
        pytest.skip("a GPU worker, or malloc settings of the environment's own, keep malloc as it is")
    worker = next(child for child in stack.children if child.name.startswith("worker"))
    assert worker.proc.poll() is None  # the process the stack started (same pid), still serving
    environ = dict(
        item.split("=", 1) for item in open(f"/proc/{worker.proc.pid}/environ").read().split("\0") if "=" in item
    )
    assert {key: environ.get(key) for key in MALLOC_ENV} == MALLOC_ENV and environ[REEXEC_MARKER] == "1"
    assert "MALLOC_ARENA_MAX" not in worker.env  # set by the worker itself, not by the launcher
