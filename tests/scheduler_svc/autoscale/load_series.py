"""A fluid model of one model's pool for policy tests: a rate series in, the autoscaler's decisions out."""

from dataclasses import dataclass

import numpy as np

from scheduler_svc.autoscale.load import LoadSample
from scheduler_svc.autoscale.policy import AutoscaleConfig, Autoscaler, ScaleDecision

SERVICE_S = 10.0  # every request's dispatch to finish
SLOTS = 16


@dataclass(slots=True)
class Run:
    decisions: list[ScaleDecision]
    actual: list[int]  # workers that existed at each decision (ready or starting)

    @property
    def desired(self) -> list[int]:
        return [d.desired for d in self.decisions]

    def changes(self, after: int = 0) -> int:
        d = self.desired[after:]
        return sum(1 for a, b in zip(d, d[1:]) if a != b)


def step(n: int, low: float, high: float, at: int) -> np.ndarray:
    return np.where(np.arange(n) < at, low, high)


def ramp(n: int, low: float, high: float) -> np.ndarray:
    return np.linspace(low, high, n)


def diurnal(n: int, mean: float, period: int) -> np.ndarray:
    return mean * (1.0 - 0.7 * np.cos(2 * np.pi * np.arange(n) / period))


def burst(n: int, base: float, start: int, end: int, factor: float = 5.0) -> np.ndarray:
    rates = np.full(n, base)
    rates[start:end] *= factor
    return rates


def drive(
    rates: np.ndarray, config: AutoscaleConfig, cold_start_s: float = 60.0, initial: int = 1, seed: int = 0
) -> Run:
    """Poisson arrivals at each interval's rate; requests in flight are rate x service time, up to the
    ready workers' slots, and the rest queue; a worker asked for is ready a cold start later."""
    rng = np.random.default_rng(seed)
    scaler = Autoscaler(config)
    ready_at: list[float] = [0.0] * initial
    decisions, actual = [], []
    for i, rate in enumerate(rates):
        ts = (i + 1) * config.interval_s
        arrivals = int(rng.poisson(rate * config.interval_s))
        ready = sum(1 for t in ready_at if t <= ts)
        demand = int(rng.poisson(rate * SERVICE_S)) if rate > 0 else 0
        in_flight = min(demand, ready * SLOTS)
        sample = LoadSample(
            ts=ts,
            arrivals=arrivals,
            completions=arrivals,
            mean_service_s=SERVICE_S if arrivals else None,
            queue_depth=demand - in_flight,
            in_flight=in_flight,
            workers_ready=ready,
            slots_per_worker=SLOTS,
            cold_start_s=cold_start_s,
        )
        decision = scaler.decide(sample, len(ready_at))
        decisions.append(decision)
        actual.append(len(ready_at))
        if decision.desired > len(ready_at):
            ready_at += [ts + cold_start_s] * (decision.desired - len(ready_at))
        elif decision.desired < len(ready_at):
            ready_at = sorted(ready_at)[: decision.desired]  # the newest (still starting) go first
    return Run(decisions, actual)
