"""Admission before work: a request is refused with 429 / RESOURCE_EXHAUSTED at once, before it is
tokenized, when the gateway is already admitting its bound of requests, or when the scheduler has
just answered that its queue is full.

Without it, a burst of 2,000 requests was tokenized in full (5 to 8 s) before the first Submit
found the queue full, and the tokenizer's grpc backlog shed calls as CANCELLED meanwhile. Every
refusal is counted in /metrics and logged, at most once a second with the count since.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import Counter

from shardline.core.errors import ResourceExhausted

logger = logging.getLogger(__name__)

REFUSED = Counter(
    "shardline_gateway_refused",
    "Requests the gateway refused before any work, by reason "
    "(admitting: its own bound; queue_full: the scheduler's queue).",
    ["reason"],
)
# How often refusals are logged: once per interval, with how many there were.
LOG_INTERVAL_S = 1.0


class Admission:
    """Counts the requests between arrival and a finished Submit, and remembers a full queue."""

    def __init__(self, max_admitting: int, queue_full_hold_s: float) -> None:
        self.max_admitting = max_admitting
        self.queue_full_hold_s = queue_full_hold_s
        self.admitting = 0  # requests (choices) being validated, tokenized or submitted now
        self._queue_full_until = 0.0
        self._refused: dict[str, int] = {}
        self._logged_at = 0.0

    @contextmanager
    def admit(self, count: int = 1) -> Iterator[None]:
        """Hold `count` admission slots (one per choice) for the block, or raise ResourceExhausted at once."""
        self.check(count)
        self.admitting += count
        try:
            yield
        finally:
            self.admitting -= count

    def check(self, count: int = 1) -> None:
        """ResourceExhausted if `count` more requests would be refused now: a front end asks before it
        even reads the body, so that a refusal in a burst costs next to nothing."""
        self.check_queue()
        if self.admitting + count > self.max_admitting:
            self._refuse("admitting")
            raise ResourceExhausted(
                f"the gateway is admitting {self.admitting} requests already (at most "
                f"{self.max_admitting}): retry later"
            )

    def check_queue(self) -> None:
        """ResourceExhausted while the scheduler's queue was lately found full: no work for a refused Submit."""
        if time.monotonic() < self._queue_full_until:
            self._refuse("queue_full")
            raise ResourceExhausted("the scheduler queue is full: retry later")

    def queue_full(self) -> None:
        """The scheduler refused a Submit for a full queue: refuse new arrivals for a while, untokenized."""
        if time.monotonic() >= self._queue_full_until:
            logger.warning("the scheduler queue is full: refusing new requests for %.2f s", self.queue_full_hold_s)
        self._queue_full_until = time.monotonic() + self.queue_full_hold_s

    def _refuse(self, reason: str) -> None:
        REFUSED.labels(reason=reason).inc()
        self._refused[reason] = self._refused.get(reason, 0) + 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_INTERVAL_S:
            counts = ", ".join(f"{n} for {why}" for why, n in sorted(self._refused.items()))
            logger.warning(
                "refused requests with 429 before any work: %s (admitting %d of %d)",
                counts,
                self.admitting,
                self.max_admitting,
            )
            self._refused.clear()
            self._logged_at = now
