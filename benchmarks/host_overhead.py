"""The engine's host time per decode step: everything but the model's own compute.

A tiny random model (`dummy:tiny`: 2 layers, hidden 64, vocabulary 1,024) makes the forward
pass negligible, so a step's time is the engine's work around it: scheduling, the step's inputs
and attention metadata, the LM head's launch, sampling, and building the outputs. Each phase is
timed by wrapping the engine's own methods; `host` is the step's wall time less the model's
forward. Under async scheduling the next step's inputs are built in lookahead.prepare, which
`other` holds (its attention metadata stays in `metadata`). Greedy decoding, every request
decoding (prefills are done before timing starts).

    python -m benchmarks.host_overhead                         # CPU, batch 1, 16 and 64
    python -m benchmarks.host_overhead --device cuda --model dummy:llama-3.2-1b
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gpu_worker_svc.engine import model_runner
from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.model_runner import RunnerConfig
from gpu_worker_svc.engine.sampling_params import SamplingParams

PHASES = ("schedule", "inputs", "metadata", "forward", "logits", "sample", "update")


class PhaseClock:
    """Sums the wall time of wrapped calls per phase, for the step under way."""

    def __init__(self, device: str) -> None:
        cuda = device.startswith("cuda")
        # Never inside a CUDA graph's capture, which forbids a synchronize.
        self._sync = (lambda: torch.cuda.is_current_stream_capturing() or torch.cuda.synchronize()) if cuda else None
        self.synced = True  # off under async scheduling, whose point is that the host does not wait
        self.times: dict[str, float] = defaultdict(float)

    def sync(self) -> None:
        if self._sync is not None and self.synced:
            self._sync()

    def wrap(self, phase: str, fn: Callable[..., Any], synced: bool = False) -> Callable[..., Any]:
        """`synced`: wait for the device before and after, so the phase's own GPU time counts in it."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            if synced:
                self.sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if synced:
                    self.sync()
                self.times[phase] += time.perf_counter() - t0

        return timed


def instrument(engine: LLMEngine, clock: PhaseClock) -> None:
    shard = engine.runner._shard
    engine.scheduler.schedule = clock.wrap("schedule", engine.scheduler.schedule)
    engine.scheduler.update = clock.wrap("update", engine.scheduler.update)
    engine._step_batch = clock.wrap("inputs", engine._step_batch)
    engine.sampler.token_ids = clock.wrap("sample", engine.sampler.token_ids)
    shard.model.compute_logits = clock.wrap("logits", shard.model.compute_logits)
    # The forward is the model's compute: on CUDA it is synced so that none of it hides in a later phase.
    shard.model.forward = clock.wrap("forward", shard.model.forward, synced=True)
    if shard.graphs is not None:
        shard.graphs.run = clock.wrap("forward", shard.graphs.run, synced=True)


def measure(engine: LLMEngine, clock: PhaseClock, batch: int, steps: int, prompt_len: int) -> dict:
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        engine.add_request(
            f"h{batch}-{i}-{time.monotonic_ns()}", torch.randint(3, vocab, (prompt_len,), generator=g).tolist(), params
        )
    while engine.scheduler.num_waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()
    for _ in range(3):  # warm: graph capture and allocator
        engine.step()
    rows: list[dict[str, float]] = []
    for _ in range(steps - 4):
        clock.times.clear()
        clock.sync()
        t0 = time.perf_counter()
        out = engine.step()
        clock.sync()
        wall = time.perf_counter() - t0
        assert out.stats is not None and out.stats.batch_size == batch and out.stats.num_prefill_tokens == 0
        row = {p: clock.times.get(p, 0.0) for p in PHASES}
        row["step"] = wall
        row["host"] = wall - row["forward"]
        row["other"] = wall - sum(row[p] for p in PHASES)
        rows.append(row)
    while engine.has_unfinished:
        engine.step()
    return {k: 1000 * statistics.median(r[k] for r in rows) for k in (*PHASES, "other", "host", "step")}


def profile(engine: LLMEngine, batch: int, prompt_len: int) -> None:
    """The ops that take the host's time over 20 decode steps at `batch`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=activities) as prof:
        measure(engine, PhaseClock("cpu"), batch, 24, prompt_len)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=60, help="decode steps timed per batch and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument(
        "--scheduling",
        nargs="+",
        choices=["sync", "async"],
        default=None,
        help="sync: each step waits for its tokens (phases synced, so `host` is exact); async: lookahead.py "
        "(only the step's wall time means much). Several alternate round by round. Default: sync on CPU, both on CUDA",
    )
    ap.add_argument("--out", default=None, help="write the results as JSON")
    ap.add_argument(
        "--profile", type=int, default=None, metavar="BATCH", help="print torch.profiler's top ops at BATCH (sync)"
    )
    args = ap.parse_args(argv)
    modes = args.scheduling or (["sync", "async"] if args.device.startswith("cuda") else ["sync"])
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    need = max(args.batch) * (-(-(args.prompt_len + args.steps + 8) // 16))
    clock = PhaseClock(args.device)
    model_runner.build_step = clock.wrap("metadata", model_runner.build_step)
    engines = {}
    for mode in modes:
        runner = RunnerConfig(model=args.model, device=args.device, dtype=dtype, num_blocks=need + 16)
        engines[mode] = LLMEngine(EngineConfig(runner=runner, async_scheduling=mode == "async"))
        instrument(engines[mode], clock)
    results: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for _ in range(args.rounds):
        for b in args.batch:
            for mode, engine in engines.items():
                clock.synced = mode == "sync"
                results[mode, b].append(measure(engine, clock, b, args.steps, args.prompt_len))
    if args.profile:
        clock.synced = True
        profile(engines[modes[0]], args.profile, args.prompt_len)
    for engine in engines.values():
        engine.shutdown()
    rows = []
    print(f"{args.model} on {args.device}, ms per decode step (median of {args.rounds} rounds)")
    print(f"{'mode':>5} {'batch':>5} " + " ".join(f"{k:>8}" for k in (*PHASES, "other", "host", "step")))
    for (mode, b), rounds in results.items():
        row = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        rows.append({"scheduling": mode, "batch": b, **row, "rounds": rounds})
        print(f"{mode:>5} {b:>5} " + " ".join(f"{row[k]:>8.3f}" for k in (*PHASES, "other", "host", "step")))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
