"""The one thread that runs an engine's work: the model's load, every step, the shutdown.

On CPU, torch's parallel kernels run on libgomp's OpenMP threads, and libgomp keeps a team of
them for each thread that starts parallel regions. With two such teams in a process it counts
more OpenMP threads than cores and stops spinning between regions, so each of a decode step's
~400 parallel regions then waits for its threads to be woken: built in one thread and stepped in
another, the default model's decode step took 27 ms instead of 11 (2-core Xeon, gguf weights).
torch's thread count (`torch.set_num_threads`) is also an OpenMP setting of the calling thread.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class TorchThread:
    """A daemon thread that runs what is submitted to it, one call after another, in order."""

    def __init__(self, name: str = "torch") -> None:
        self._calls: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple[Any, ...]]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Runs fn(*args) on the thread, after everything submitted before it."""
        future: Future[T] = Future()
        self._calls.put((future, fn, args))
        return future

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """submit(), waited for; raises what fn raised."""
        if threading.current_thread() is self._thread:  # already here: queueing it would wait forever
            return fn(*args)
        return self.submit(fn, *args).result()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """submit(), awaited."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def _serve(self) -> None:
        while True:
            future, fn, args = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)
