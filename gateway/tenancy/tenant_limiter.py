"""Tenants' limits at the gateway: requests/min, tokens/min and concurrent requests, through Redis.

A request of a tenant with limits is charged at admission (one script, gateway/tenancy/rate_limits.py):
one request, prompt + max_tokens tokens, and a concurrency slot. It is held until the request
finishes, not until its client leaves: a named request outlives its client (request_attach.py),
so a request whose consumer left is watched from its record until it ends. At the end, the tokens
it reserved and did not use are given back and its slot frees. Meanwhile this gateway renews the
leases of its slots, so those of a gateway that died expire after one lease.

Redis unreachable: the limits fail open. Requests go through unchecked, counted in
shardline_gateway_rate_limits_unchecked_total and logged at most once a second, and Redis is not
tried again for a second, so an outage adds no timeout to every request. A Redis blip then costs
some overshoot of the limits, never a refusal of all traffic.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from prometheus_client import Counter
from redis.exceptions import RedisError

from gateway.output.request_stream import TOKENIZER_DOWN, StreamChunk
from gateway.settings import GatewaySettings
from gateway.tenancy.rate_limits import Ask, Bucket, RateLimitStore, Verdict
from gateway.tenancy.tenants import Tenant, TenantDirectory
from gateway.upstream.backends import RPC_TIMEOUT_S, Backends
from shardline.core.errors import STREAM_INTERRUPTED, InvalidArgument, ResourceExhausted
from shardline.proto import common_pb2, sampling_pb2

logger = logging.getLogger(__name__)

REDIS_TIMEOUT_S = 0.5  # past it an admission goes through unchecked
REDIS_RETRY_S = 1.0  # after a failure, Redis is left alone this long
# Retry-After of a full concurrency cap: when a slot frees is not known, only that it may be soon.
CONCURRENCY_RETRY_S = 1
# How often held slots are renewed and detached requests looked up, at most.
TICK_S = 1.0
# A last chunk with one of these errors leaves its request running (the client may resume it).
_RUNS_ON = (TOKENIZER_DOWN, STREAM_INTERRUPTED)

Lookup = Callable[[str], Awaitable[common_pb2.RequestInfo | None]]

# A tenant's requests refused for its limits, by the limit: requests, tokens (per minute) or
# concurrency; and those let through unchecked because Redis did not answer.
THROTTLED = Counter(
    "shardline_gateway_throttled", "Requests refused for their tenant's limits, by reason.", ["tenant", "reason"]
)
RATE_LIMITS_UNCHECKED = Counter(
    "shardline_gateway_rate_limits_unchecked",
    "Requests of limited tenants let through unchecked: Redis could not be reached (the limits fail open).",
    ["tenant"],
)


@dataclass(slots=True, eq=False)
class Hold:
    """A request admitted against its tenant's limits, until it ends."""

    tenant: Tenant  # as it was at admission: its limits are the ones it was charged against
    request_id: str  # its member in the tenant's running set
    reserved: int  # tokens charged (prompt + max_tokens); 0 without tokens_per_minute
    slot: bool  # it holds a concurrency slot
    headers: dict[str, str]  # OpenAI's x-ratelimit-* of its admission
    detached: bool = False  # its consumer left before it ended: its record is watched


class RateLimited(ResourceExhausted):
    """Over a tenant's limit: 429 with Retry-After, or RESOURCE_EXHAUSTED with `retry-after` metadata."""

    openai_code = "rate_limit_exceeded"

    def __init__(self, message: str, openai_type: str, retry_after_s: int, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.openai_type = openai_type  # OpenAI's error type: "requests" or "tokens"
        self.retry_after_s = retry_after_s
        self.headers = {"Retry-After": str(retry_after_s), **headers}

    def grpc_metadata(self) -> tuple[tuple[str, str], ...]:
        return tuple((name.lower(), value) for name, value in self.headers.items())


class TenantLimiter:
    """Admits requests against their tenants' limits and holds them until they end."""

    def __init__(self, store: RateLimitStore, lease_s: float, lookup: Lookup) -> None:
        self._store = store
        self._lease_s = lease_s
        self._lookup = lookup
        self._tick_s = min(TICK_S, lease_s / 3)  # a lease is renewed at least twice before it ends
        self._holds: set[Hold] = set()  # those with tokens to give back or a slot to free
        self._down_until = 0.0
        self._unchecked = 0  # since the last warning
        self._warned_at = 0.0
        self._task: asyncio.Task[None] | None = None

    async def admit(self, tenant: Tenant, request_id: str, prompt_tokens: int, max_tokens: int, field: str) -> Hold:
        """Charge a request to `tenant`'s limits; RateLimited when one has no room now, and
        InvalidArgument naming `field` (max_tokens) when the request could never fit."""
        limits = tenant.limits
        tokens_per_minute, cost = limits.tokens_per_minute or 0, prompt_tokens + max_tokens
        if tokens_per_minute and cost > tokens_per_minute:
            # 400, not 429: waiting never helps, and clients (the batch workers too) retry a 429.
            THROTTLED.labels(tenant=tenant.name, reason="too_large").inc()
            raise InvalidArgument(
                field,
                f"the prompt ({prompt_tokens} tokens) and {field} ({max_tokens}) come to {cost} tokens, over "
                f"the {tokens_per_minute} tokens per minute of tenant {tenant.name!r}: lower {field}",
            )
        ask = Ask(
            tenant.name,
            request_id,
            limits.requests_per_minute or 0,
            tokens_per_minute,
            cost,
            limits.max_concurrent or 0,
        )
        verdict = await self._verdict(ask)
        if verdict is None:
            return Hold(tenant, request_id, 0, False, {})
        headers = rate_headers(verdict)
        if not verdict.admitted:
            raise _refusal(tenant, ask, verdict, headers)
        hold = Hold(tenant, request_id, cost if tokens_per_minute else 0, bool(ask.max_concurrent), headers)
        if hold.reserved or hold.slot:
            self._holds.add(hold)
            if self._task is None or self._task.done():
                self._task = asyncio.create_task(self._renew_forever(), name="tenant-limits")
        return hold

    async def settle(self, hold: Hold, last: StreamChunk) -> None:
        """The consumer got the request's last chunk: end the hold with its usage, unless the request runs on."""
        if last.error.startswith(_RUNS_ON):
            self.detach(hold)
        else:
            usage = last.usage
            await self.finish(hold, usage.prompt_tokens + usage.completion_tokens if usage is not None else None)

    def detach(self, hold: Hold) -> None:
        """The consumer left before the end: the request's record says when it ends."""
        hold.detached = True

    async def finish(self, hold: Hold, used_tokens: int | None, free_slot: bool = True) -> None:
        """The request ended having used `used_tokens` (None: not known, none given back). Without
        `free_slot` its slot stays: the request it named runs on, admitted before (a resend)."""
        if hold not in self._holds:
            return
        self._holds.discard(hold)
        refund = hold.reserved - used_tokens if used_tokens is not None and hold.reserved else 0
        member = hold.request_id if hold.slot and free_slot else None
        if refund <= 0 and member is None:
            return
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                await self._store.release(hold.tenant.name, hold.tenant.limits.tokens_per_minute or 0, refund, member)
        except (RedisError, OSError, TimeoutError) as exc:
            logger.warning(
                "%s: its tenant's tokens and slot not given back (%r); its lease ends it", hold.request_id, exc
            )

    def release_unsubmitted(self, hold: Hold | None, free_slot: bool = True) -> None:
        """A request that was admitted and then never ran (Submit failed, or it was a resend): all its
        tokens back, in the background since its caller is raising."""
        if hold is not None and hold in self._holds:
            task = asyncio.create_task(self.finish(hold, 0, free_slot))
            task.add_done_callback(lambda t: t.exception())  # finish() logs its own failures

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._store.close()

    async def _verdict(self, ask: Ask) -> Verdict | None:
        """The store's answer, or None when Redis is unreachable (fail open)."""
        if time.monotonic() < self._down_until:
            self._pass_unchecked(ask.tenant)
            return None
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                return await self._store.admit(ask, self._lease_s)
        except (RedisError, OSError, TimeoutError) as exc:
            self._down_until = time.monotonic() + REDIS_RETRY_S
            logger.warning("rate limits: Redis unreachable (%r); letting requests through unchecked", exc)
            self._pass_unchecked(ask.tenant)
            return None

    def _pass_unchecked(self, tenant: str) -> None:
        RATE_LIMITS_UNCHECKED.labels(tenant=tenant).inc()
        self._unchecked += 1
        now = time.monotonic()
        if now - self._warned_at >= REDIS_RETRY_S:
            logger.warning("rate limits: %d requests let through unchecked, Redis being down", self._unchecked)
            self._unchecked, self._warned_at = 0, now
        return None

    async def _renew_forever(self) -> None:
        while self._holds:
            await asyncio.sleep(self._tick_s)
            try:
                await self._end_detached()
                running: dict[str, list[str]] = {}
                for hold in self._holds:
                    if hold.slot:
                        running.setdefault(hold.tenant.name, []).append(hold.request_id)
                if running and time.monotonic() >= self._down_until:
                    async with asyncio.timeout(REDIS_TIMEOUT_S):
                        await self._store.renew(running, self._lease_s)
            except (RedisError, OSError, TimeoutError) as exc:
                logger.warning("rate limits: leases not renewed (%r)", exc)
            except Exception:
                logger.exception("rate limits: renewing leases failed")  # the next tick tries again

    async def _end_detached(self) -> None:
        detached = [hold for hold in self._holds if hold.detached]
        records = await asyncio.gather(*(self._lookup(h.request_id) for h in detached), return_exceptions=True)
        for hold, info in zip(detached, records):
            if isinstance(info, BaseException):
                continue  # the scheduler is away: look again next tick, the lease renewed meanwhile
            if info is None:
                await self.finish(hold, None)  # no record any more: its usage is not known
            elif info.status >= sampling_pb2.REQUEST_STATUS_FINISHED:
                await self.finish(hold, info.usage.prompt_tokens + info.usage.completion_tokens)


def rate_headers(verdict: Verdict) -> dict[str, str]:
    """OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens}, for the limits the tenant has."""
    headers = {}
    for name, bucket in (("requests", verdict.requests), ("tokens", verdict.tokens)):
        if bucket is not None:
            headers[f"x-ratelimit-limit-{name}"] = str(bucket.limit)
            headers[f"x-ratelimit-remaining-{name}"] = str(bucket.remaining)
            headers[f"x-ratelimit-reset-{name}"] = duration_text(bucket.reset_s)
    return headers


def duration_text(seconds: float) -> str:
    """A duration as OpenAI's reset headers write it: "20ms", "1.5s", "6m0s"."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    rest_text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{rest_text}" if minutes else rest_text


def _refusal(tenant: Tenant, ask: Ask, verdict: Verdict, headers: dict[str, str]) -> RateLimited:
    """The refusal of the limit that keeps the request out longest; Retry-After covers all of them."""
    refusals: list[tuple[float, str, str, str]] = []
    for reason, bucket, asked, unit in (
        ("requests", verdict.requests, 1, "requests per min (RPM)"),
        ("tokens", verdict.tokens, ask.tokens, "tokens per min (TPM)"),
    ):
        if bucket is not None and bucket.wait_s > 0:
            refusals.append((bucket.wait_s, reason, reason, _over(tenant, unit, bucket, asked)))
    if verdict.full:
        message = f"Concurrency limit reached for tenant {tenant.name!r}: {ask.max_concurrent} requests running"
        refusals.append((CONCURRENCY_RETRY_S, "concurrency", "requests", message))
    wait_s, reason, openai_type, message = max(refusals)
    retry_after_s = max(1, math.ceil(wait_s))
    THROTTLED.labels(tenant=tenant.name, reason=reason).inc()
    return RateLimited(f"{message}. Please try again in {retry_after_s}s.", openai_type, retry_after_s, headers)


def _over(tenant: Tenant, unit: str, bucket: Bucket, asked: int) -> str:
    used = bucket.limit - bucket.remaining
    return (
        f"Rate limit reached for tenant {tenant.name!r} on {unit}: Limit {bucket.limit}, Used {used}, Requested {asked}"
    )


def limiter_for(settings: GatewaySettings, tenants: TenantDirectory | None, backends: Backends) -> TenantLimiter | None:
    """The gateway's limiter: none without a tenants file, or without Redis, which limits need (they
    are then not enforced, as with Redis down, and the start says so)."""
    if tenants is None:
        return None
    if not settings.redis_url:
        limited = sorted(name for name, t in tenants.table().tenants.items() if t.limits.enforced)
        if limited:
            logger.error("tenants %s have limits, which need Redis: set SHARDLINE_REDIS_URL; not enforced", limited)
        return None
    return TenantLimiter(
        RateLimitStore(settings.redis_url, REDIS_TIMEOUT_S), settings.rate_limit_lease_s, _record_lookup(backends)
    )


def _record_lookup(backends: Backends) -> Lookup:
    async def lookup(request_id: str) -> common_pb2.RequestInfo | None:
        try:
            return await backends.scheduler.GetRequest(
                common_pb2.GetRequestRequest(request_id=request_id), timeout=RPC_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    return lookup
