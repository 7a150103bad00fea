"""Relay: per-gateway streams, replacement, and slow subscribers."""

import asyncio

import pytest

from scheduler_svc.relay import Relay
from shardline.core.errors import Unavailable
from shardline.proto import scheduler_pb2
from tests.tracing.run_async import run_async


async def _collect(subscription) -> list[int]:
    return [batch.step async for batch in subscription]


@run_async
async def test_batches_go_to_their_gateway_only() -> None:
    relay = Relay(queue_size=8)
    one, two = relay.subscribe("gw-1"), relay.subscribe("gw-2")
    for step, gateway_id in [(1, "gw-1"), (2, "gw-2"), (3, "gw-1"), (4, "gw-3")]:
        relay.publish(gateway_id, scheduler_pb2.TokenBatch(step=step))
    relay.close_all()
    assert await _collect(one) == [1, 3]
    assert await _collect(two) == [2]
    assert relay.dropped_batches == 1  # gw-3 has no stream


@run_async
async def test_new_subscribe_replaces_the_old_stream() -> None:
    relay = Relay(queue_size=8)
    old = relay.subscribe("gw-1")
    relay.publish("gw-1", scheduler_pb2.TokenBatch(step=1))
    new = relay.subscribe("gw-1")
    relay.publish("gw-1", scheduler_pb2.TokenBatch(step=2))
    with pytest.raises(Unavailable, match="replaced"):
        await _collect(old)
    relay.unsubscribe(old)  # the old stream's cleanup must not drop its successor
    relay.publish("gw-1", scheduler_pb2.TokenBatch(step=3))
    relay.unsubscribe(new)
    assert await _collect(new) == [2, 3]


@run_async
async def test_slow_gateway_is_cut_off_instead_of_blocking() -> None:
    relay = Relay(queue_size=2)
    slow = relay.subscribe("gw-1")
    for step in range(5):
        relay.publish("gw-1", scheduler_pb2.TokenBatch(step=step))  # never waits
    with pytest.raises(Unavailable, match="behind"):
        await asyncio.wait_for(_collect(slow), timeout=1)


@run_async
async def test_closing_a_full_stream_keeps_every_batch() -> None:
    # At shutdown a stream ends cleanly after what it holds: its oldest batch used to make room for
    # the end marker, and the gateway saw a gap with no error telling it to catch up.
    relay = Relay(queue_size=3)
    full = relay.subscribe("gw-1")
    for step in (1, 2, 3):
        relay.publish("gw-1", scheduler_pb2.TokenBatch(step=step))
    relay.close_all()
    assert await _collect(full) == [1, 2, 3]
