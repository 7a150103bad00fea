"""The stack's CPU worker runs under the malloc settings that keep a step's freed buffers."""

from __future__ import annotations

import sys

import pytest

from gpu_worker_svc.engine.host_memory import MALLOC_ENV


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, and /proc")
def test_the_cpu_worker_restarted_itself_under_the_malloc_settings(stack):
    worker = next(child for child in stack.children if child.name.startswith("worker"))
    assert worker.proc.poll() is None  # the process the stack started (same pid), still serving
    environ = dict(item.split("=", 1) for item in
                   open(f"/proc/{worker.proc.pid}/environ").read().split("\0") if "=" in item)
    assert {key: environ.get(key) for key in MALLOC_ENV} == MALLOC_ENV
    assert "MALLOC_ARENA_MAX" not in worker.env  # set by the worker itself, not by the launcher
