"""Where the benchmark sends its load: the full stack over gRPC, or the engine in this process."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.sampling_params import SamplingParams
from shardline.bench.metrics import RequestTiming
from shardline.client import AsyncShardlineClient


class StackBackend:
    """Streams each request through the gateway's gRPC API, as a client would."""

    def __init__(self, target: str) -> None:
        self.client = AsyncShardlineClient(target, retries=0)

    async def send(self, prompt: list[int], output_len: int, timing: RequestTiming) -> None:
        start = time.perf_counter()
        async for chunk in self.client.stream(prompt, max_tokens=output_len, ignore_eos=True, temperature=0.0):
            if chunk.token_ids:
                timing.chunk_times.append(time.perf_counter() - start)
                timing.output_len += len(chunk.token_ids)
            if chunk.finish_reason == "error":
                raise RuntimeError(f"request {chunk.request_id} failed")

    async def close(self) -> None:
        await self.client.close()


class EngineBackend:
    """The same engine the worker runs, stepped in a thread of this process: the no-network baseline."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.engine = LLMEngine(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pending: list[tuple[str, list[int], SamplingParams]] = []
        self.streams: dict[str, asyncio.Queue] = {}
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.ids = itertools.count()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True, name="engine-loop")
        self.error: Exception | None = None  # what ended the engine thread, if anything did

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # every open request fails with it, rather than waiting forever
            self.error = exc
            for queue in list(self.streams.values()):
                self.loop.call_soon_threadsafe(queue.put_nowait, (time.perf_counter(), exc))

    def _loop(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                pending, self.pending = self.pending, []
            for rid, prompt, params in pending:
                self.engine.add_request(rid, prompt, params)
            if not self.engine.has_unfinished:
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            outputs = self.engine.step().outputs
            now = time.perf_counter()
            for o in outputs:
                self.loop.call_soon_threadsafe(self.streams[o.request_id].put_nowait, (now, o))

    async def send(self, prompt: list[int], output_len: int, timing: RequestTiming) -> None:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
            self.thread.start()
        rid = f"bench-{next(self.ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[rid] = queue
        start = time.perf_counter()
        with self.lock:
            self.pending.append((rid, prompt, SamplingParams(max_tokens=output_len, ignore_eos=True,
                                                             temperature=0.0)))
        self.wake.set()
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

    async def close(self) -> None:
        self.stop.set()
        self.wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout=10)
        self.engine.shutdown()
