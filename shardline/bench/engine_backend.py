"""The engine as a benchmark target: the worker's own engine, stepped in a thread of this process.

The no-network baseline of `shardline bench --engine`: it needs the services (the serve extra).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from concurrent.futures import Future, wait
from typing import cast

import torch

from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.sampling_params import SamplingParams
from gpu_worker_svc.engine.torch_thread import TorchThread
from gpu_worker_svc.server.engine_loop import Inbox, collect_burst
from shardline.bench.metrics import RequestTiming

log = logging.getLogger(__name__)
# What the inbox carries to add a request: its id, its prompt and its sampling.
_Add = tuple[str, list[int], SamplingParams]


def _build(config: EngineConfig | None, torch_threads: int) -> LLMEngine:
    engine = LLMEngine(config)
    if torch_threads > 0:  # after the engine, which sets its own default on CPU (as the worker does)
        torch.set_num_threads(torch_threads)
    return engine


class EngineBackend:
    """The same engine the worker runs, stepped in a thread of this process: the no-network baseline.

    It admits requests as the worker's engine loop does: a burst reaching an idle engine is
    collected (`admission_gap_s` between arrivals) until it stops or fills a step, so its
    requests share the first step here exactly when they would in the worker.
    """

    def __init__(
        self, config: EngineConfig | None = None, admission_gap_s: float = 0.0, torch_threads: int = 0
    ) -> None:
        # Built, stepped and shut down on one thread, as the worker's engine is (engine/torch_thread.py).
        self.torch = TorchThread("engine-loop")
        self.engine = self.torch.call(_build, config, torch_threads)
        self.admission_gap_s = admission_gap_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.inbox = Inbox()  # (request id, prompt, params) to add, or None to wake the thread
        self.streams: dict[str, asyncio.Queue] = {}
        self.stop = threading.Event()
        self.ids = itertools.count()
        self.done: Future[None] | None = None  # the loop on self.torch, from the first request on
        self.error: Exception | None = None  # what ended the engine thread, if anything did

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            self._loop(loop)
        except Exception as exc:  # every open request fails with it, rather than waiting forever
            self.error = exc
            for queue in list(self.streams.values()):
                loop.call_soon_threadsafe(queue.put_nowait, (time.perf_counter(), exc))

    def _loop(self, loop: asyncio.AbstractEventLoop) -> None:
        config = self.engine.scheduler.config
        while not self.stop.is_set():
            idle = not self.engine.has_unfinished
            items = self.inbox.drain(0.05 if idle else 0.0)
            if idle and items and self.admission_gap_s > 0:
                items = collect_burst(
                    self.inbox,
                    items,
                    self.admission_gap_s,
                    lambda xs: config.fills_a_step([len(cast(_Add, x)[1]) for x in xs if x is not None]),
                )
            for item in items:
                if item is not None:
                    self.engine.add_request(*cast(_Add, item))
            if not self.engine.has_unfinished:
                continue
            outputs = self.engine.step().outputs
            now = time.perf_counter()
            for o in outputs:
                loop.call_soon_threadsafe(self.streams[o.request_id].put_nowait, (now, o))

    async def send(self, prompt: list[int], output_len: int, timing: RequestTiming) -> None:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
            self.done = self.torch.submit(self._run, self.loop)
        rid = f"bench-{next(self.ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[rid] = queue
        start = time.perf_counter()
        self.inbox.put((rid, prompt, SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)))
        while True:
            if self.error is not None and queue.empty():
                raise RuntimeError(f"the engine failed: {self.error}")
            at, out = await queue.get()
            if isinstance(out, Exception):
                raise RuntimeError(f"the engine failed: {out}") from out
            if out.new_token_ids:
                timing.chunk_times.append(at - start)
                timing.output_len += len(out.new_token_ids)
            if out.finish_reason:
                del self.streams[rid]
                return

    async def vocab_size(self) -> int | None:
        """None: the engine runs the model the flags name, whose vocabulary the load already has."""
        return None

    async def close(self) -> None:
        self.stop.set()
        self.inbox.put(None)
        if self.done is not None:
            await asyncio.to_thread(
                wait, [self.done], 60
            )  # the step in flight ends first; on a CPU it can take seconds
            if not self.done.done():
                log.warning("engine thread still stepping after 60 s; leaving the engine to the process's exit")
                return
        await self.torch.run(self.engine.shutdown)
