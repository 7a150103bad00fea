"""Tenants' rate limits and concurrency caps in Redis, shared by every gateway: the Lua scripts and their client.

Each limit per minute is a token bucket: its capacity is the limit and it refills at the limit per
minute. A bucket is stored as the debt charged to it (`level`) at a time (`at`, Redis's clock), and
drains continuously, so admission is one comparison: debt now + cost <= limit. Why a bucket and not
a sliding window: two numbers per tenant and limit instead of one entry per request, an exact
Retry-After (the debt over the limit divided by the refill rate), and a refund at a request's end
is a subtraction. Its price: a tenant idle for a minute may spend its whole minute at once, so a
60 s window can see up to twice the limit, while the long-run rate is the limit exactly.

The concurrency cap is a sorted set of the tenant's running request ids, each scored by the end of
its lease; the gateway that runs a request renews its lease, and every admission first drops the
expired ones, so the slots of a gateway that died free themselves after one lease, where a bare
counter would leak them for good.

All of one tenant's keys share a Redis Cluster hash slot (`{tenant}`), as a script's keys must.
Times are Redis's (TIME), in microseconds, so the gateways' clocks never matter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from shardline.core.store.redis_pool import async_redis

PREFIX = "shardline:ratelimit:"
WINDOW_S = 60.0  # every limit is per minute

# The functions both scripts use: the time, and a bucket's debt now and how to record it.
_BUCKETS_LUA = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local WINDOW = 60000000
local function owed(key, limit)
  local state = redis.call('HMGET', key, 'level', 'at')
  if not state[1] then return 0 end
  return math.max(0, tonumber(state[1]) - (now - tonumber(state[2])) * limit / WINDOW)
end
local function record(key, limit, level)
  redis.call('HSET', key, 'level', string.format('%.17g', level), 'at', string.format('%d', now))
  -- gone once it has drained in full, so an idle tenant leaves nothing behind
  redis.call('PEXPIRE', key, math.floor(level * WINDOW / limit / 1000) + 1000)
end
"""

# KEYS[1] the requests bucket, KEYS[2] the tokens bucket, KEYS[3] the running set.
# ARGV: requests/min, tokens/min, tokens asked, max concurrent (0 for a limit not set), the
# request's id, its lease in ms. All or nothing: a refused request is charged nothing.
# Returns admitted (1/0), requests' debt, requests' wait (us), tokens' debt, tokens' wait (us),
# whether the running set is full; debts and waits as strings (Lua numbers would be cut to integers).
_ADMIT_LUA = (
    _BUCKETS_LUA
    + """
local rpm, tpm, cost, cap = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local r_owed, r_wait, t_owed, t_wait, full = 0, 0, 0, 0, 0
if rpm > 0 then
  r_owed = owed(KEYS[1], rpm)
  r_wait = math.max(0, r_owed + 1 - rpm) * WINDOW / rpm
end
if tpm > 0 then
  t_owed = owed(KEYS[2], tpm)
  t_wait = math.max(0, t_owed + cost - tpm) * WINDOW / tpm
end
if cap > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  -- an id already in the set is the same request sent again (request_attach.py): it holds its slot
  if not redis.call('ZSCORE', KEYS[3], ARGV[5]) and redis.call('ZCARD', KEYS[3]) >= cap then full = 1 end
end
local admitted = 0
if r_wait == 0 and t_wait == 0 and full == 0 then
  admitted = 1
  if rpm > 0 then r_owed = r_owed + 1; record(KEYS[1], rpm, r_owed) end
  if tpm > 0 then t_owed = t_owed + cost; record(KEYS[2], tpm, t_owed) end
  if cap > 0 then
    redis.call('ZADD', KEYS[3], now + tonumber(ARGV[6]) * 1000, ARGV[5])
    redis.call('PEXPIRE', KEYS[3], ARGV[6])
  end
end
local function s(x) return string.format('%.17g', x) end
return {admitted, s(r_owed), s(r_wait), s(t_owed), s(t_wait), full}
"""
)

# KEYS[1] the tokens bucket, KEYS[2] the running set. ARGV: tokens/min (0: none), tokens to give
# back, the request's id ('' keeps its slot). A request's end: what it reserved and did not use
# drains at once, and its slot frees.
_RELEASE_LUA = (
    _BUCKETS_LUA
    + """
local tpm, refund = tonumber(ARGV[1]), tonumber(ARGV[2])
if tpm > 0 and refund > 0 and redis.call('EXISTS', KEYS[1]) == 1 then
  record(KEYS[1], tpm, math.max(0, owed(KEYS[1], tpm) - refund))
end
if ARGV[3] ~= '' then redis.call('ZREM', KEYS[2], ARGV[3]) end
return 1
"""
)

# KEYS[1] a running set; ARGV: the lease in ms, then the ids this gateway still runs. XX: a slot
# released meanwhile (or expired, its gateway stalled past a lease) is never brought back.
_RENEW_LUA = """
local clock = redis.call('TIME')
local until_us = tonumber(clock[1]) * 1000000 + tonumber(clock[2]) + tonumber(ARGV[1]) * 1000
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', until_us, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""


def _keys(tenant: str) -> tuple[str, str, str]:
    base = f"{PREFIX}{{{tenant}}}"
    return f"{base}:requests", f"{base}:tokens", f"{base}:running"


@dataclass(frozen=True, slots=True)
class Bucket:
    """One per-minute limit's state after an admission: what OpenAI's x-ratelimit-* headers say."""

    limit: int  # the limit per minute
    owed: float  # its debt now; the limit minus it is what remains
    wait_s: float  # how long until the request asked for would fit; 0 when it did

    @property
    def remaining(self) -> int:
        return max(0, math.floor(self.limit - self.owed + 1e-9))

    @property
    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return self.owed * WINDOW_S / self.limit


@dataclass(frozen=True, slots=True)
class Verdict:
    """The answer to one admission."""

    admitted: bool
    requests: Bucket | None  # None when the tenant has no requests_per_minute
    tokens: Bucket | None  # None when it has no tokens_per_minute
    full: bool  # its running set held max_concurrent requests already


@dataclass(frozen=True, slots=True)
class Ask:
    """What one request asks of its tenant's limits (0 for a limit not set)."""

    tenant: str
    request_id: str
    requests_per_minute: int
    tokens_per_minute: int
    tokens: int  # prompt + max_tokens
    max_concurrent: int


class RateLimitStore:
    """The scripts, on one Redis client that fails fast: a refused or stalled Redis is the caller's
    to tolerate (it fails open), not something to retry while the request waits."""

    def __init__(self, redis_url: str, timeout_s: float) -> None:
        self._redis = async_redis(
            redis_url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )
        self._admit = self._redis.register_script(_ADMIT_LUA)
        self._release = self._redis.register_script(_RELEASE_LUA)
        self._renew = self._redis.register_script(_RENEW_LUA)

    async def admit(self, ask: Ask, lease_s: float) -> Verdict:
        """Charge `ask` to its tenant's limits if all of them have room; else charge nothing."""
        args = [
            ask.requests_per_minute,
            ask.tokens_per_minute,
            ask.tokens,
            ask.max_concurrent,
            ask.request_id,
            math.ceil(lease_s * 1000),
        ]
        reply = await self._admit(keys=_keys(ask.tenant), args=args)
        admitted, r_owed, r_wait, t_owed, t_wait, full = reply
        requests = Bucket(ask.requests_per_minute, float(r_owed), float(r_wait) / 1e6)
        tokens = Bucket(ask.tokens_per_minute, float(t_owed), float(t_wait) / 1e6)
        return Verdict(
            bool(admitted),
            requests if ask.requests_per_minute else None,
            tokens if ask.tokens_per_minute else None,
            bool(full),
        )

    async def release(self, tenant: str, tokens_per_minute: int, refund: int, request_id: str | None) -> None:
        """A request's end: give back `refund` tokens, and free its slot unless `request_id` is None."""
        _, tokens, running = _keys(tenant)
        await self._release(keys=[tokens, running], args=[tokens_per_minute, max(0, refund), request_id or ""])

    async def renew(self, running: dict[str, list[str]], lease_s: float) -> None:
        """Extend the leases of the request ids this gateway runs, by tenant: one script per tenant
        (their sets are in different hash slots), in one round trip."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for tenant, ids in running.items():
                await self._renew(keys=[_keys(tenant)[2]], args=[math.ceil(lease_s * 1000), *ids], client=pipe)
            await pipe.execute()

    async def close(self) -> None:
        await self._redis.aclose()
