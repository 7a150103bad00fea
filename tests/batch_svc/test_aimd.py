"""The batch requests in flight: up by one per round of answers, halved by a 429 or 503."""

from __future__ import annotations

import asyncio

from batch_svc.aimd import AimdLimit


def test_additive_increase_multiplicative_decrease():
    assert AimdLimit(most=16).limit == 16  # no slow start: batch requests queue behind interactive ones
    limit = AimdLimit(most=16, start=4)
    for _ in range(4):
        limit.succeeded()
    assert 4.9 < limit.limit < 5.1  # one round of four answers: one more
    limit.pushed_back()
    assert 2.4 < limit.limit < 2.6
    for _ in range(1000):
        limit.succeeded()
    assert limit.limit == 16
    for _ in range(10):
        limit.pushed_back()
    assert limit.limit == 1


def test_no_more_than_the_limit_run_at_once():
    async def run() -> int:
        limit, running, most = AimdLimit(most=8, start=3), 0, 0

        async def request() -> None:
            nonlocal running, most
            async with limit:
                running += 1
                most = max(most, running)
                await asyncio.sleep(0.01)
                running -= 1

        await asyncio.gather(*(request() for _ in range(20)))
        return most

    assert asyncio.run(run()) == 3
