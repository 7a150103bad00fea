"""The autoscaler's loop: every interval, for each model, read the load, decide a worker count, drain
the workers that go, and tell the driver.

Scale-down always drains. A worker chosen for removal takes no new requests and leaves the pool once
its own have finished; past the drain timeout, those move to other workers with their tokens so far
(Dispatcher.release_worker), as after a worker failure but without counting as one. Only then is it
retired: its heartbeats are answered retired=true, so it stops serving and registers nowhere, and the
driver removes it. Load that comes back while a worker drains cancels the drain before any new
worker is asked for, since a drained worker serves at once and a new one pays the cold start.
"""

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry import trace

from scheduler_svc.autoscale.config import AutoscaleConfig
from scheduler_svc.autoscale.driver import ScaleDriver
from scheduler_svc.autoscale.load import LoadSample
from scheduler_svc.autoscale.policy import Autoscaler, ScaleDecision
from scheduler_svc.dispatcher import Dispatcher
from scheduler_svc.settings import SchedulerSettings
from scheduler_svc.worker_registry import RegisteredWorker
from shardline.proto import scheduler_pb2, worker_pb2
from tracing import attributes as attr
from tracing.metrics import AUTOSCALER_DECISIONS, AUTOSCALER_DESIRED, AUTOSCALER_FORECAST, AUTOSCALER_READY

log = logging.getLogger(__name__)

# A worker asked for that has not registered after this many cold starts is taken as never coming.
_ASK_EXPIRY_COLD_STARTS = 3.0
_DRAIN_POLL_S = 0.2  # how often, between rounds, draining workers are checked for their last request


@dataclass(slots=True)
class _ModelPool:
    """One model's scaling state."""

    autoscaler: Autoscaler
    decision: ScaleDecision | None = None
    asked: list[float] = field(default_factory=list)  # when each worker asked for and not registered was asked
    draining: dict[str, float] = field(default_factory=dict)  # worker id -> when its drain began
    retired: dict[str, float] = field(default_factory=dict)  # worker id -> when it was last heard of
    cold_start_s: float | None = None  # the latest measured: asked to registered, or the worker's own
    known: set[str] = field(default_factory=set)  # workers registered before: registering again answers no ask


class PoolScaler:
    """Runs the autoscaling policy for every model the scheduler has seen a worker of."""

    def __init__(
        self,
        settings: SchedulerSettings,
        dispatcher: Dispatcher,
        driver: ScaleDriver | None,
        tracer: trace.Tracer,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._dispatcher = dispatcher
        self._driver = driver
        self._tracer = tracer
        self._clock = clock
        self._config = autoscale_config(settings)
        self._pools: dict[str, _ModelPool] = {}

    async def run(self) -> None:
        interval = self._settings.autoscale_interval_s
        next_tick = self._clock() + interval
        while True:
            # Between rounds, a draining worker is retired as soon as its last request ends rather
            # than at the next round: the driver stops its process sooner (live: 2.0 s after the
            # drain began with a 2 s interval, for a request that had under a second left).
            await asyncio.sleep(max(0.0, min(_DRAIN_POLL_S, next_tick - self._clock())))
            try:
                if self._clock() >= next_tick:
                    next_tick = self._clock() + interval
                    await self.tick()
                else:
                    for pool in self._pools.values():
                        if pool.draining:
                            await self._advance_drains(pool, self._clock())
            except Exception:
                log.exception("autoscaling round failed")

    async def tick(self) -> None:
        """One round: decide, drain and drive for every model."""
        for worker in self._dispatcher.registry:
            self._pool(worker.info.model)
        for model, pool in self._pools.items():
            await self._scale(model, pool)

    def registered(self, info: worker_pb2.WorkerInfo) -> None:
        """A worker registered: the ask it answers is met, and its cold start is measured."""
        pool = self._pool(info.model)
        pool.retired.pop(info.worker_id, None)  # a retired id starting again is a new worker
        if info.worker_id in pool.known:
            return
        pool.known.add(info.worker_id)
        if pool.asked:
            pool.cold_start_s = self._clock() - pool.asked.pop(0)
        elif info.startup_s > 0:
            pool.cold_start_s = info.startup_s

    def retired(self, worker_id: str) -> bool:
        """True for a worker the autoscaler took out of the pool (its heartbeat says so)."""
        for pool in self._pools.values():
            if worker_id in pool.retired:
                pool.retired[worker_id] = self._clock()
                return True
        return False

    def stats(self) -> list[scheduler_pb2.ModelScale]:
        """Each model's scale, for GetStats."""
        out = []
        for model, pool in self._pools.items():
            decision = pool.decision
            if decision is None:  # nothing to follow before the first round
                continue
            out.append(
                scheduler_pb2.ModelScale(
                    model=model,
                    policy=self._config.policy,
                    desired=decision.desired,
                    ready=len(self._ready(model)),
                    starting=len(pool.asked),
                    draining=len(pool.draining),
                    retired=sorted(pool.retired),
                    forecast_rps=decision.forecast_rps,
                    reason=decision.reason,
                    cold_start_s=self._cold_start(pool),
                )
            )
        return out

    def _pool(self, model: str) -> _ModelPool:
        pool = self._pools.get(model)
        if pool is None:
            pool = self._pools[model] = _ModelPool(Autoscaler(self._config))
        return pool

    def _ready(self, model: str) -> list[RegisteredWorker]:
        # Prefill workers are a pool of their own, which the policies (sized on requests' slots) leave be.
        return [w for w in self._dispatcher.registry if w.info.model == model and w.runs_requests and not w.draining]

    def _cold_start(self, pool: _ModelPool) -> float:
        return pool.cold_start_s if pool.cold_start_s is not None else self._settings.autoscale_cold_start_s

    async def _scale(self, model: str, pool: _ModelPool) -> None:
        now = self._clock()
        expiry = _ASK_EXPIRY_COLD_STARTS * self._cold_start(pool)
        pool.asked = [asked for asked in pool.asked if now - asked < expiry]
        ready = self._ready(model)
        sample = self._sample(model, pool, ready, now)
        # In a thread: an arima refit takes 0.1 s, over a second on a loaded machine, and the loop
        # relays every worker's tokens meanwhile. Rounds run one at a time, so the state is safe.
        decision = await asyncio.to_thread(pool.autoscaler.decide, sample, len(ready) + len(pool.asked))
        previous, pool.decision = pool.decision, decision
        self._resize(pool, ready, decision.desired, now)
        await self._advance_drains(pool, now)
        self._forget_gone(pool, now)
        if self._driver is not None:
            try:
                await asyncio.to_thread(self._driver.scale, model, decision.desired, sorted(pool.retired))
            except Exception as exc:  # the next round tries again
                log.warning("autoscaler: the driver could not scale %s to %d: %s", model, decision.desired, exc)
        self._publish(model, pool, previous)

    def _sample(self, model: str, pool: _ModelPool, ready: list[RegisteredWorker], now: float) -> LoadSample:
        window = self._dispatcher.meter.take(model)
        workers = [w for w in self._dispatcher.registry if w.info.model == model and w.runs_requests]
        kv = [w.kv_blocks_used / w.info.kv_blocks_total for w in workers if w.info.kv_blocks_total]
        return LoadSample(
            ts=now,
            arrivals=window.arrivals,
            completions=window.completions,
            mean_service_s=window.mean_service_s,
            queue_depth=self._dispatcher.queue.depth_for(model),
            in_flight=sum(len(w.in_flight) for w in workers),
            workers_ready=len(ready),
            slots_per_worker=max((w.info.max_num_seqs for w in workers), default=1),
            kv_usage=sum(kv) / len(kv) if kv else 0.0,
            ttft_p90_s=window.ttft_p90_s,
            cold_start_s=pool.cold_start_s,
        )

    def _resize(self, pool: _ModelPool, ready: list[RegisteredWorker], desired: int, now: float) -> None:
        """Moves the pool toward `desired`: cancels drains, then asks; or cancels asks, then drains."""
        short = desired - len(ready) - len(pool.asked)
        for worker_id in list(pool.draining)[: max(0, short)]:  # back to serving: no cold start
            worker = self._dispatcher.registry.get(worker_id)
            if worker is not None:
                worker.draining = False
                short -= 1
                log.info("autoscaler: %s serves again (drain cancelled)", worker_id)
            del pool.draining[worker_id]
        if short > 0:
            pool.asked += [now] * short
            return
        surplus = -short
        cancelled = min(surplus, len(pool.asked))
        del pool.asked[len(pool.asked) - cancelled :]  # the newest asks: the driver stops or never starts them
        # The least busy finish soonest; ties go to the newest, whose prefix cache is the coldest.
        for worker in sorted(reversed(ready), key=lambda w: len(w.in_flight))[: surplus - cancelled]:
            worker.draining = True
            pool.draining[worker.worker_id] = now
            log.info("autoscaler: draining %s (%d requests in flight)", worker.worker_id, len(worker.in_flight))

    async def _advance_drains(self, pool: _ModelPool, now: float) -> None:
        timeout = self._settings.autoscale_drain_timeout_s
        for worker_id, since in list(pool.draining.items()):
            worker = self._dispatcher.registry.get(worker_id)
            if worker is None:  # it died while draining: the dispatcher re-queued what it held
                del pool.draining[worker_id]
                continue
            if worker.in_flight and now - since < timeout:
                continue
            reason = "drained" if not worker.in_flight else f"drain past {timeout:.0f}s: its requests move"
            del pool.draining[worker_id]
            pool.retired[worker_id] = now
            await self._dispatcher.release_worker(worker_id, f"retired by the autoscaler, {reason}")
            log.info("autoscaler: retired %s after %.1fs (%s)", worker_id, now - since, reason)

    def _forget_gone(self, pool: _ModelPool, now: float) -> None:
        """Drops retired workers not heard of for a heartbeat timeout: the driver has removed them."""
        timeout = self._settings.heartbeat_timeout_s
        for worker_id, heard in list(pool.retired.items()):
            if now - heard > timeout:
                del pool.retired[worker_id]
        pool.known &= {w.worker_id for w in self._dispatcher.registry} | set(pool.retired)

    def _publish(self, model: str, pool: _ModelPool, previous: ScaleDecision | None) -> None:
        decision = pool.decision
        assert decision is not None
        ready = len(self._ready(model))
        AUTOSCALER_DESIRED.labels(model).set(decision.desired)
        AUTOSCALER_READY.labels(model).set(ready)
        AUTOSCALER_FORECAST.labels(model).set(decision.forecast_rps if math.isfinite(decision.forecast_rps) else 0)
        before = previous.desired if previous is not None else ready
        direction = "up" if decision.desired > before else "down" if decision.desired < before else "hold"
        AUTOSCALER_DECISIONS.labels(model, direction).inc()
        if previous is None or previous.desired != decision.desired:
            log.info("autoscaler: %s wants %d workers (%s)", model, decision.desired, decision.reason)
        # One span a round: its gauges become the dashboard's counter tracks (desired against ready).
        self._tracer.start_span(
            "autoscale",
            attributes={
                attr.GEN_AI_REQUEST_MODEL: model,
                attr.DESIRED_WORKERS: decision.desired,
                attr.READY_WORKERS: ready,
                attr.FORECAST_RPS: decision.forecast_rps,
                "shardline.autoscale_reason": decision.reason,
            },
        ).end()


def autoscale_config(settings: SchedulerSettings) -> AutoscaleConfig:
    """The policy's configuration, from the scheduler's settings."""
    return AutoscaleConfig(
        policy=settings.autoscale_policy,
        forecaster=settings.autoscale_forecaster,
        min_workers=settings.autoscale_min_workers,
        max_workers=settings.autoscale_max_workers,
        interval_s=settings.autoscale_interval_s,
        default_cold_start_s=settings.autoscale_cold_start_s,
        target_utilisation=settings.autoscale_target_utilisation,
        scale_down_window_s=settings.autoscale_scale_down_window_s,
    )
