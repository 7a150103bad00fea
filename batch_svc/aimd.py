"""How many of a chunk's requests are in flight: additive increase, multiplicative decrease.

Each answer the gateway gives in time raises the limit by 1/limit (one per round of answers); a 429
or 503 (the queue is full, a dependency is down) halves it. So a batch fills what the stack has to
spare and backs off at once when interactive traffic needs the queue.
"""

from __future__ import annotations

import asyncio


class AimdLimit:
    """An adaptive concurrency limit, used as `async with limit:` around each request."""

    def __init__(self, most: int, start: int | None = None) -> None:
        self.most = most
        self.limit = float(start or max(1, most // 4))
        self.in_flight = 0
        self._changed = asyncio.Condition()

    async def __aenter__(self) -> AimdLimit:
        async with self._changed:
            await self._changed.wait_for(lambda: self.in_flight < int(self.limit))
            self.in_flight += 1
        return self

    async def __aexit__(self, *exc: object) -> None:
        async with self._changed:
            self.in_flight -= 1
            self._changed.notify_all()

    def succeeded(self) -> None:
        self.limit = min(float(self.most), self.limit + 1.0 / self.limit)

    def pushed_back(self) -> None:
        self.limit = max(1.0, self.limit / 2)
