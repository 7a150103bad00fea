"""engine/torch_thread.py: one thread runs every call, in order, and hands back results and errors."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gpu_worker_svc.engine.torch_thread import TorchThread


def test_every_call_runs_on_the_one_thread_in_order():
    thread = TorchThread("test-torch")
    seen: list[tuple[int, str]] = []
    futures = [thread.submit(lambda i=i: seen.append((i, threading.current_thread().name))) for i in range(20)]
    for f in futures:
        f.result(timeout=10)
    assert seen == [(i, "test-torch") for i in range(20)]
    assert thread.call(lambda: thread.call(lambda: 7)) == 7  # a call from the thread itself runs at once


def test_errors_reach_the_caller_and_the_thread_goes_on():
    thread = TorchThread("test-torch")
    with pytest.raises(ZeroDivisionError):
        thread.call(lambda: 1 / 0)

    async def awaited() -> str:
        return await thread.run(lambda: threading.current_thread().name)

    assert asyncio.run(awaited()) == "test-torch"
