"""The autoscaler the scheduler and the simulator both call: measure, forecast, apply a policy, stabilise.

The forecast target is Little's law: the forecast arrival rate times the mean service time is the
number of requests in flight, and a worker runs `slots_per_worker` of them at `target_utilisation`:

    target = ceil(forecast_rps x mean_service_s / (slots_per_worker x target_utilisation))

bounded by min_workers and max_workers. The forecast is the highest rate expected over the horizon
of a cold start plus one interval: a worker asked for now serves only after its cold start, and one
removed now could not come back sooner.
"""

import math
from collections import deque
from dataclasses import dataclass

from scheduler_svc.autoscale.config import AutoscaleConfig
from scheduler_svc.autoscale.forecast import Ewma, make_forecaster
from scheduler_svc.autoscale.load import LoadSample
from scheduler_svc.autoscale.rules import RULES, Reading

__all__ = ["AutoscaleConfig", "Autoscaler", "ScaleDecision"]

# Utilisation above this adds nothing to the smoothed value but slows its recovery once a queue drains.
_UTILISATION_CAP = 2.0


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    """One interval's decision for one model."""

    desired: int  # workers the model should have
    target: int  # the forecast's worker count (what naive would apply)
    forecast_rps: float  # the highest arrival rate forecast over the horizon
    utilisation: float  # what the policy's thresholds compared
    reason: str  # one short line: why this count
    horizon_s: float = 0.0  # the forecast's horizon: the cold start it planned with, plus one interval
    service_s: float | None = None  # the smoothed mean service time the target used; None: none measured


class Autoscaler:
    """Decides one model's worker count every interval; deterministic, and cheap enough for the
    scheduler's event loop (an arima fit is bounded; see ArimaForecaster)."""

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self._rule = RULES[config.policy]
        self._forecaster = make_forecaster(config)
        self._service = Ewma(config.service_half_life_s)
        self._utilisation = Ewma(config.utilisation_half_life_s)
        self._demand = Ewma(config.utilisation_half_life_s)
        self._last_ts: float | None = None
        self._first_ts: float | None = None
        self._proposals: deque[tuple[float, int]] = deque()  # (ts, proposed count) within the window

    def decide(self, sample: LoadSample, actual: int) -> ScaleDecision:
        """actual = workers that exist for the model, ready or still starting."""
        c = self.config
        dt = c.interval_s if self._last_ts is None else max(sample.ts - self._last_ts, 1e-6)
        self._last_ts = sample.ts
        if self._first_ts is None:
            self._first_ts = sample.ts
        rate = sample.arrivals / dt
        self._forecaster.observe(rate, dt)
        if sample.mean_service_s is not None and sample.completions > 0:
            self._service.update(sample.mean_service_s, dt)
        cold_start = sample.cold_start_s if sample.cold_start_s is not None else c.default_cold_start_s
        horizon = cold_start + c.interval_s
        forecast = self._forecaster.forecast(horizon)
        service = self._service.value

        slots = max(1, sample.slots_per_worker)
        demand = sample.queue_depth + sample.in_flight
        ready = sample.workers_ready
        utilisation = (
            min(demand / (ready * slots), _UTILISATION_CAP) if ready else (_UTILISATION_CAP if demand else 0.0)
        )
        smoothed = self._utilisation.update(utilisation, dt)
        # An averaged metric, as HPA reads one through a metrics adapter: one interval's count is noise.
        smoothed_demand = self._demand.update(float(demand), dt)
        reading = Reading(
            actual=actual,
            ready=ready,
            slots=slots,
            demand=demand,
            utilisation=utilisation,
            smoothed_utilisation=smoothed,
            forecast_utilisation=forecast * service / (actual * slots) if service is not None and actual else 0.0,
            target=self._workers_for(forecast, demand, slots, actual),
            rate_target=self._workers_for(rate, demand, slots, actual),
            demand_target=self._bounded(math.ceil(smoothed_demand / (slots * c.target_utilisation) - 1e-9)),
            smoothed_demand=smoothed_demand,
        )
        proposed, compared, reason = self._rule(c, reading)
        desired = self._bounded(proposed)
        if c.policy != "static":
            # A worker shed within a cold start of needing it again would pay that cold start.
            window = max(c.scale_down_window_s, cold_start)
            desired, held = self._stabilised(sample.ts, desired, actual, window)
            if held:
                reason += f"; held at {desired} by the {window:.0f}s scale-down window"
        return ScaleDecision(
            desired=desired,
            target=reading.target,
            forecast_rps=forecast,
            utilisation=compared,
            reason=reason,
            horizon_s=horizon,
            service_s=self._service.value,
        )

    def _workers_for(self, rps: float, demand: float, slots: int, actual: int) -> int:
        """Little's law at the target utilisation; before any request has finished, the requests in
        flight and queued stand in for rate x service time. Within the tolerance of `actual` it is
        `actual`, as HPA's tolerance, so a forecast's noise around a boundary does not flap the count."""
        service = self._service.value
        concurrency = rps * service if service is not None else demand
        workers = concurrency / (slots * self.config.target_utilisation)
        if actual > 0 and abs(workers / actual - 1.0) <= self.config.tolerance:
            return self._bounded(actual)
        return self._bounded(math.ceil(workers - 1e-9))

    def _bounded(self, workers: int) -> int:
        return max(self.config.min_workers, min(self.config.max_workers, workers))

    def _stabilised(self, ts: float, desired: int, actual: int, window_s: float) -> tuple[int, bool]:
        """HPA's scale-down stabilisation: a fall goes only to the highest proposal of the window."""
        self._proposals.append((ts, desired))
        while self._proposals and self._proposals[0][0] <= ts - window_s:
            self._proposals.popleft()
        if desired >= actual:
            return desired, False
        if self._first_ts is None or ts - self._first_ts < window_s:  # no history yet: nothing says it is safe
            return actual, True
        held = min(actual, max(p for _, p in self._proposals))
        return held, held != desired
