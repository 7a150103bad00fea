"""Which models have a live worker, and the requests of those that have had none for too long.

A request of a model no worker serves would otherwise wait out its whole deadline (600 s by
default) with no sign of why. Once a model has had no live worker for `no_worker_timeout_s`, its
queued requests fail with UNAVAILABLE, saying so, and new ones are refused at Submit, until a worker
of it registers. Where the autoscaler runs, its cold start is added: it may be starting one.
"""

import logging
import time
from collections.abc import Callable

from scheduler_svc.request_queue import RequestQueue
from scheduler_svc.request_table import Outcome, RequestTable
from scheduler_svc.worker_registry import WorkerRegistry
from shardline.core.errors import NO_WORKER
from shardline.core.store.request_record import FinishReason, RequestStatus

log = logging.getLogger(__name__)


class ModelCoverage:
    """Tracks since when each model has had a live worker; sweep() fails what waited too long."""

    def __init__(
        self,
        registry: WorkerRegistry,
        queue: RequestQueue,
        requests: RequestTable,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._registry = registry
        self._queue = queue
        self._requests = requests
        self.timeout_s = timeout_s
        self._clock = clock
        self._started = clock()
        self._last_live: dict[str, float] = {}  # model -> when a live worker of it was last seen

    def _observe(self) -> float:
        """Notes the models with a live worker now; returns now."""
        now = self._clock()
        for worker in self._registry:
            if not worker.runs_requests:  # a prefill worker alone serves no request
                continue
            self._last_live[worker.info.model] = now
            for adapter in worker.info.adapters:  # a request may name a LoRA adapter as its model
                self._last_live[adapter] = now
            self._last_live[""] = now  # a request naming no model takes any worker
        return now

    def _uncovered_s(self, model: str) -> float:
        """How long `model` has had no live worker: 0 while one is registered; since start if none ever was."""
        return self._observe() - self._last_live.get(model, self._started)

    def refusal(self, model: str) -> str | None:
        """Why a request of `model` is refused now, or None while a worker of it is live or may still come."""
        waited = self._uncovered_s(model)
        if waited < self.timeout_s:
            return None
        return f"{NO_WORKER}: no worker of {model!r} has been live for {waited:.0f} s; retry once one is up"

    async def sweep(self) -> None:
        """Fails the queued requests of every model without a live worker for timeout_s (one write). Run
        every second or so, it is also what notes when a model's last worker left."""
        self._observe()
        outcomes, refusals = [], {}
        for request in self._queue.waiting():
            if request.model not in refusals:
                refusals[request.model] = self.refusal(request.model)
            why = refusals[request.model]
            if why is not None and self._queue.remove(request):
                outcomes.append(Outcome(request, RequestStatus.FAILED, FinishReason.ERROR, why))
        if outcomes:
            log.warning("%s: failing %d queued requests", outcomes[0].error, len(outcomes))
            await self._requests.finish(outcomes)
