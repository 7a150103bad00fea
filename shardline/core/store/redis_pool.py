"""The asyncio Redis clients of every service: a bounded pool that waits for a free connection.

redis-py's default pool holds at most 100 connections and, past that, fails the call at once
with MaxConnectionsError ("Too many connections"), a ConnectionError that reads as Redis being
down: in a burst of 2,000 requests, a few got UNAVAILABLE "redis unavailable" from a Redis that
was up. A blocking pool queues the call for a connection instead, for at most POOL_WAIT_S, so a
burst costs a wait, and only a Redis that stays busy that long counts as unavailable.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

POOL_CONNECTIONS = 64  # per client; Redis's own limit (maxclients) is 10,000
POOL_WAIT_S = 5.0  # the longest a call waits for a free connection before it fails


def async_redis(url: str, **connection_kwargs: Any) -> aioredis.Redis:
    """An asyncio client of `url` on its own blocking pool, closed with the client."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=POOL_CONNECTIONS, timeout=POOL_WAIT_S, **connection_kwargs
    )
    return aioredis.Redis.from_pool(pool)
