"""Replays an arrival trace against modelled workers, calling the same Autoscaler.decide as the scheduler.

Event-driven: arrivals, completions, workers becoming ready and the autoscaler's intervals are events
in time order, so a day of a few requests a second takes seconds. Requests queue in one FIFO (the
scheduler's queue) and go to the ready worker running the fewest. A request's service time follows
from its lengths and the worker's measured speeds; the resize mirrors scheduler_svc/pool_scaler.py:
a rise first cancels drains, then starts workers (ready after the cold start); a fall first cancels
workers still starting, then drains the least busy, which take no new requests and stop costing at
the first interval that finds them empty.
"""

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from scheduler_svc.autoscale.load import LoadSample
from scheduler_svc.autoscale.policy import AutoscaleConfig, Autoscaler
from scheduler_svc.autoscale.sim_report import SimResult, SloTargets, summarise
from scheduler_svc.autoscale.trace import Trace


@dataclass(frozen=True, slots=True)
class WorkerModel:
    """What one worker can do, as measured on the real one."""

    slots: int = 16  # requests it runs at once (max_num_seqs)
    prefill_tps: float = 8000.0  # prompt tokens/s of one request's prefill
    decode_tps: float = 30.0  # tokens/s of one request with the batch full: the slowest it decodes
    cold_start_s: float = 60.0  # start to ready: model load and warm-up

    def __post_init__(self) -> None:
        if self.slots < 1 or self.prefill_tps <= 0 or self.decode_tps <= 0 or self.cold_start_s < 0:
            raise ValueError("a worker needs slots >= 1, positive speeds and a cold start >= 0")


@dataclass(slots=True)
class _Worker:
    index: int  # its place in the simulation's list of every worker
    started: float  # when it was asked for: it costs from then
    ready_at: float
    ready: bool = False
    draining: bool = False
    stopped: float | None = None  # when it stopped costing
    running: int = 0


@dataclass(slots=True)
class _Interval:
    """What happened since the last decision."""

    arrivals: int = 0
    completions: int = 0
    service_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)


def simulate(
    trace: Trace,
    config: AutoscaleConfig,
    worker: WorkerModel | None = None,
    slo: SloTargets | None = None,
    initial_workers: int | None = None,
) -> SimResult:
    """Runs the trace to its last completion; workers present at the start are ready (and reported
    their cold start when they registered), `initial_workers` of them, min_workers by default."""
    return _Simulation(trace, config, worker or WorkerModel(), initial_workers).run(slo or SloTargets())


class _Simulation:
    def __init__(self, trace: Trace, config: AutoscaleConfig, model: WorkerModel, initial: int | None) -> None:
        self.trace = trace
        self.config = config
        self.model = model
        self.autoscaler = Autoscaler(config)
        self.prefill_s = trace.input_tokens / model.prefill_tps
        self.service_s = self.prefill_s + trace.output_tokens / model.decode_tps
        # The first token comes out of the prefill's step; each later one takes a decode step.
        self.first_token_s = self.prefill_s + 1.0 / model.decode_tps
        self.dispatched = np.full(len(trace), np.nan)
        self.workers: list[_Worker] = []
        self.serving: list[_Worker] = []
        self.starting: list[_Worker] = []
        self.draining: list[_Worker] = []
        self.queue: deque[int] = deque()
        self.finishes: list[tuple[float, int, int]] = []  # (time, worker index, request)
        self.readies: list[tuple[float, int]] = []  # (time, worker index)
        self.in_flight = 0
        self.interval = _Interval()
        self.timeline: list[tuple[float, int, int, int]] = []  # (ts, desired, ready, starting)
        self.scale_events = 0
        self.cold_starts = 0
        count = config.min_workers if initial is None else initial
        for _ in range(max(0, count)):
            w = _Worker(index=len(self.workers), started=0.0, ready_at=0.0, ready=True)
            self.workers.append(w)
            self.serving.append(w)

    def run(self, slo: SloTargets) -> SimResult:
        arrivals = self.trace.timestamps
        n, nxt, tick, now = len(arrivals), 0, self.config.interval_s, 0.0
        while nxt < n or self.finishes or self.queue:
            t_arr = arrivals[nxt] if nxt < n else math.inf
            t_fin = self.finishes[0][0] if self.finishes else math.inf
            t_rdy = self.readies[0][0] if self.readies else math.inf
            now = min(t_arr, t_fin, t_rdy, tick)
            if t_fin == now:
                self._finish()
            elif t_rdy == now:
                self._ready()
            elif t_arr == now:
                self.queue.append(nxt)
                self.interval.arrivals += 1
                nxt += 1
                self._dispatch(now)
            else:
                self._tick(now)
                tick += self.config.interval_s
        end = max(now, self.trace.duration_s)
        worker_s = sum((end if w.stopped is None else w.stopped) - w.started for w in self.workers)
        ttft = self.dispatched - self.trace.timestamps + self.first_token_s
        return summarise(
            config=self.config,
            slo=slo,
            ttft_s=ttft,
            # Every request decodes at the measured full-batch speed: slots cap the batch.
            tpot_s=np.full(len(ttft), 1.0 / self.model.decode_tps),
            worker_s=worker_s,
            duration_s=end,
            scale_events=self.scale_events,
            cold_starts=self.cold_starts,
            timeline=self.timeline,
        )

    def _finish(self) -> None:
        now, index, request = heapq.heappop(self.finishes)
        w = self.workers[index]
        w.running -= 1
        self.in_flight -= 1
        self.interval.completions += 1
        self.interval.service_s += self.service_s[request]
        if not w.draining:
            self._dispatch(now)

    def _ready(self) -> None:
        now, index = heapq.heappop(self.readies)
        w = self.workers[index]
        if w.stopped is not None:  # cancelled while it started
            return
        w.ready = True
        self.starting.remove(w)
        self.serving.append(w)
        self._dispatch(now)

    def _dispatch(self, now: float) -> None:
        while self.queue and self.serving:
            w = min(self.serving, key=_running)
            if w.running >= self.model.slots:
                return
            request = self.queue.popleft()
            w.running += 1
            self.in_flight += 1
            self.dispatched[request] = now
            self.interval.ttft_s.append(now - self.trace.timestamps[request] + self.first_token_s[request])
            heapq.heappush(self.finishes, (now + self.service_s[request], w.index, request))

    def _tick(self, now: float) -> None:
        iv = self.interval
        slots = self.model.slots
        busy_workers = len(self.serving) + len(self.draining)
        sample = LoadSample(
            ts=now,
            arrivals=iv.arrivals,
            completions=iv.completions,
            mean_service_s=iv.service_s / iv.completions if iv.completions else None,
            queue_depth=len(self.queue),
            in_flight=self.in_flight,
            workers_ready=len(self.serving),
            slots_per_worker=slots,
            # A slot's share of the KV cache, as a worker that admits max_num_seqs requests sizes it.
            kv_usage=self.in_flight / (busy_workers * slots) if busy_workers else 0.0,
            ttft_p90_s=float(np.quantile(iv.ttft_s, 0.9)) if iv.ttft_s else None,
            cold_start_s=self.model.cold_start_s,
        )
        decision = self.autoscaler.decide(sample, len(self.serving) + len(self.starting))
        if self._resize(decision.desired, now):
            self.scale_events += 1
        self._retire_drained(now)
        self.timeline.append((now, decision.desired, len(self.serving), len(self.starting)))
        self.interval = _Interval()
        self._dispatch(now)

    def _resize(self, desired: int, now: float) -> bool:
        short = desired - len(self.serving) - len(self.starting)
        if short == 0:
            return False
        while short > 0 and self.draining:  # back to serving: no cold start to pay
            w = self.draining.pop(0)
            w.draining = False
            self.serving.append(w)
            short -= 1
        for _ in range(max(0, short)):
            w = _Worker(index=len(self.workers), started=now, ready_at=now + self.model.cold_start_s)
            self.workers.append(w)
            self.starting.append(w)
            heapq.heappush(self.readies, (w.ready_at, w.index))
            self.cold_starts += 1
        surplus = -short
        while surplus > 0 and self.starting:  # the newest asks go first: they have cost the least
            self.starting.pop().stopped = now
            surplus -= 1
        if surplus > 0:
            # The least busy finish soonest; ties go to the newest, whose prefix cache is the coldest.
            for w in sorted(reversed(self.serving), key=_running)[:surplus]:
                w.draining = True
                self.serving.remove(w)
                self.draining.append(w)
        return True

    def _retire_drained(self, now: float) -> None:
        for w in [w for w in self.draining if w.running == 0]:
            w.stopped = now
            self.draining.remove(w)


def _running(w: _Worker) -> int:
    return w.running
