"""The benchmark's load: random token prompts and their arrival schedule."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from tqdm import tqdm

from shardline.bench.metrics import RequestTiming


@dataclass(slots=True)
class LoadSpec:
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 64
    request_rate: float = float("inf")  # requests/s on average; inf: all at t=0
    max_concurrency: int | None = 16
    seed: int = 0
    vocab_size: int | None = 49152  # None: not known yet (the servers say theirs)
    # The shape of the gamma-distributed gaps between arrivals, as vLLM's --burstiness: 1 is a
    # Poisson process, below 1 burstier, above 1 more even. The mean rate stays request_rate.
    burstiness: float = 1.0

    def prompts(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        # Skip the lowest ids, where special tokens live, so prompts are plain text tokens.
        return [[rng.randrange(100, self.vocab_size) for _ in range(self.input_len)] for _ in range(self.num_prompts)]

    def arrival_offsets(self) -> list[float]:
        if self.request_rate == float("inf"):
            return [0.0] * self.num_prompts
        rng = random.Random(self.seed + 1)
        scale = 1.0 / (self.request_rate * self.burstiness)  # so that the mean gap is 1 / request_rate
        t, out = 0.0, []
        for _ in range(self.num_prompts):
            out.append(t)
            t += rng.gammavariate(self.burstiness, scale)
        return out


SendFn = Callable[[list[int], int, RequestTiming], Awaitable[None]]


class Target(Protocol):
    """Where a benchmark sends its load: the stack over gRPC, an OpenAI-compatible server, the engine."""

    async def send(self, prompt: list[int], output_len: int, timing: RequestTiming) -> None:
        """Streams one request, recording its chunks' arrival in `timing`."""

    async def vocab_size(self) -> int | None:
        """The served model's vocabulary size, or None where the target does not say."""

    async def close(self) -> None:
        """Releases its connections."""


async def run_load(spec: LoadSpec, send: SendFn, label: str = "") -> tuple[list[RequestTiming], float]:
    """Send every prompt at its arrival time, at most max_concurrency at once; returns timings and wall time."""
    prompts = spec.prompts()
    limit = asyncio.Semaphore(spec.max_concurrency or spec.num_prompts)
    bar = tqdm(total=spec.num_prompts, desc=label, unit="req", leave=False)
    t0 = time.perf_counter()

    async def one(prompt: list[int], offset: float) -> RequestTiming:
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        async with limit:
            timing = RequestTiming(input_len=len(prompt))
            try:
                await send(prompt, spec.output_len, timing)
            except Exception as exc:  # a failed request is a result of the benchmark, not a crash of it
                timing.ok, timing.error = False, f"{type(exc).__name__}: {exc}"
            bar.update(1)
            return timing

    timings = await asyncio.gather(*(one(p, o) for p, o in zip(prompts, spec.arrival_offsets())))
    wall = time.perf_counter() - t0
    bar.close()
    return list(timings), wall


def model_vocab_size(model: str | None) -> int | None:
    """The vocabulary size of a model's files (None: the default model), or None in an install without
    the services (no torch to read them with): the servers then say theirs."""
    try:
        from gpu_worker_svc.model.loader import load_config
    except ModuleNotFoundError:
        return None
    return load_config(model).vocab_size
