"""How many of a chunk's requests are in flight: additive increase, multiplicative decrease.

It starts at the most: batch requests queue behind every interactive one (priority classes), so
filling the queue costs interactive traffic nothing, and a slow start would only leave the stack
idle at the start of each chunk. A 429 or 503 (the queue is full, a dependency is down) halves the
limit; each answer then raises it by 1/limit (one per round of answers), back to the most.
"""

from __future__ import annotations

import asyncio


class AimdLimit:
    """An adaptive concurrency limit, used as `async with limit:` around each request."""

    def __init__(self, most: int, start: int | None = None) -> None:
        self.most = most
        self.limit = float(start or most)
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
