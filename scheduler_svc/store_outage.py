"""How the scheduler waits out a Redis that does not answer before it gives up on a write."""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from shardline.core.store.request_store import StoreUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class StoreOutage:
    """Bounds on retrying a Redis write: a restarted Redis (seconds) is waited out, so no stream
    notices more than a pause; a longer outage fails the write, and the caller fails its requests
    resumably instead of holding their output in memory without end."""

    max_s: float = 10.0  # how long one write is retried
    max_backlog: int = 2048  # worker steps that may wait behind it meanwhile
    first_backoff_s: float = 0.05
    max_backoff_s: float = 1.0

    async def retry(self, write: Callable[[], Awaitable[T]], what: str, backlog: Callable[[], int] = lambda: 0) -> T:
        """`write()`'s result, calling it again while it raises StoreUnavailable; raises the last
        StoreUnavailable once `max_s` has passed or `backlog()` exceeds `max_backlog`. `write` must be
        safe to repeat: a failed attempt may have landed."""
        started = time.monotonic()
        backoff = self.first_backoff_s
        while True:
            try:
                result = await write()
            except StoreUnavailable as exc:
                waited = time.monotonic() - started
                if waited + backoff > self.max_s or backlog() > self.max_backlog:
                    log.error(
                        "%s: redis still unavailable after %.1f s, %d steps waiting: giving up (%s)",
                        what,
                        waited,
                        backlog(),
                        exc,
                    )
                    raise
                if backoff == self.first_backoff_s:
                    log.warning("%s: %s; retrying for up to %.0f s", what, exc, self.max_s)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
                continue
            if backoff > self.first_backoff_s:
                log.info("%s: done after %.1f s of redis outage", what, time.monotonic() - started)
            return result
