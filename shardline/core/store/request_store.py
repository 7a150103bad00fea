"""Durable request state in Redis: what a restarted service rebuilds itself from.

Keys, all under `shardline:`:

- `shardline:req:<id>`: hash with model, params (JSON), status, worker_id,
  attempt, gateway_id, priority, prompt_len, finish_reason, error, the
  timings arrival_ts, dispatch_ts, first_token_ts, finish_ts (unix seconds),
  cached_tokens (prompt tokens a worker's prefix cache served),
  and what a re-dispatch needs: eos_token_ids (JSON), deadline_ts, traceparent; owner (the
  digest of the API key that submitted it, when the gateway takes keys); tenant and
  tenant_weight (whose fair share it counts against, once the gateway names one);
  ttft_deadline_ts and refuse_late (its TTFT target's deadline, and whether to refuse it once late);
- `shardline:req:<id>:prompt`: prompt token ids, packed little-endian uint32;
- `shardline:req:<id>:tokens`: generated token ids, packed the same way and
  grown with APPEND, so reading from an offset is one GETRANGE;
- `shardline:req:<id>:logprobs`: when the request asked for logprobs, a list with
  one serialized shardline.v1.TokenLogprob per generated token, index for index;
- `shardline:req:<id>:prompt_logprobs`: when it asked for prompt logprobs, a list
  of them, one per prompt token after the first;
- `shardline:active`: set of unfinished request ids (recovery after a restart);
- `shardline:recent`: sorted set of request ids scored by arrival (listings).

The scheduler is the only writer. Finishing a request sets a TTL on its keys.
"""

import functools
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ParamSpec, Self, TypeVar

from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shardline.core.errors import Unavailable
from shardline.core.store.redis_pool import async_redis
from shardline.core.store.request_record import FinishReason, RequestRecord, RequestStatus, decode_record, encode_record
from shardline.core.store.request_scripts import APPEND_STEP_LUA, CREATE_LUA, SET_LIST_ONCE_LUA, UPDATE_LIVE_LUA

PREFIX = "shardline:"
ACTIVE_KEY = PREFIX + "active"
RECENT_KEY = PREFIX + "recent"
TOKEN_BYTES = 4
DEFAULT_RETENTION_S = 24 * 3600.0
# A Redis that stops answering (a host gone without a reset) fails a call after this long instead of
# hanging it; a Redis that only pauses writes (CLIENT PAUSE, a failover) stays within it.
SOCKET_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 2.0

P = ParamSpec("P")
T = TypeVar("T")


class StoreUnavailable(Unavailable):
    """Redis could not be reached, or stopped answering: UNAVAILABLE / 503, worth retrying. A write
    that failed so may or may not have landed."""


def unavailable_when_down(method: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """Turns redis-py's connection errors into StoreUnavailable, so every caller (and every rpc
    that reads or writes requests) answers UNAVAILABLE rather than INTERNAL while Redis is down."""

    @functools.wraps(method)
    async def call(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await method(*args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise StoreUnavailable(f"redis unavailable: {exc}") from exc

    return call


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (4 bytes each, vs ~7 as decimal text)."""
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def unpack_token_ids(data: bytes) -> list[int]:
    """The inverse of pack_token_ids; ignores a trailing partial id."""
    count = len(data) // TOKEN_BYTES
    return list(struct.unpack_from(f"<{count}I", data))


def _hash_key(request_id: str) -> str:
    return f"{PREFIX}req:{request_id}"


def _prompt_key(request_id: str) -> str:
    return f"{PREFIX}req:{request_id}:prompt"


def _tokens_key(request_id: str) -> str:
    return f"{PREFIX}req:{request_id}:tokens"


def _logprobs_key(request_id: str) -> str:
    return f"{PREFIX}req:{request_id}:logprobs"


def _prompt_logprobs_key(request_id: str) -> str:
    return f"{PREFIX}req:{request_id}:prompt_logprobs"


def _update_args(
    request_id: str, retention_ms: int, fields: dict[str, Any], once: dict[str, Any] | None = None
) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of UPDATE_LIVE_LUA: `fields` are set, `once` only where absent."""
    once = once or {}
    keys = [
        _hash_key(request_id),
        _prompt_key(request_id),
        _tokens_key(request_id),
        _logprobs_key(request_id),
        _prompt_logprobs_key(request_id),
        ACTIVE_KEY,
    ]
    pairs = [item for pair in [*fields.items(), *once.items()] for item in pair]
    return keys, [request_id, retention_ms, len(once), *pairs]


def _queue_update(
    pipe: Any, request_id: str, retention_ms: int, fields: dict[str, Any], once: dict[str, Any] | None = None
) -> None:
    """Queues UPDATE_LIVE_LUA on a pipeline. EVAL with the script's text, not a registered Script:
    on a pipeline, redis-py checks registered scripts with an extra SCRIPT EXISTS round trip."""
    keys, args = _update_args(request_id, retention_ms, fields, once)
    pipe.eval(UPDATE_LIVE_LUA, len(keys), *keys, *args)


class RequestStore:
    """Async access to request state in Redis (see the module docstring for the keys).

    Updates apply only to a live request: created, not finished, not expired.
    """

    def __init__(self, redis_url: str, retention_s: float = DEFAULT_RETENTION_S) -> None:
        if retention_s <= 0:
            raise ValueError(f"retention_s must be positive, got {retention_s}")
        self.retention_s = retention_s
        # Two quick retries for a dropped connection; an outage is the caller's to wait out (the
        # scheduler keeps its steps and retries them), not a call's to hang in.
        self._redis = async_redis(
            redis_url,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), 2),
        )
        self._create_script = self._redis.register_script(CREATE_LUA)
        self._update_script = self._redis.register_script(UPDATE_LIVE_LUA)

    @unavailable_when_down
    async def ping(self) -> None:
        """Returns once Redis answers; StoreUnavailable when it does not."""
        await self._redis.ping()

    async def close(self) -> None:
        """Closes the connection pool."""
        await self._redis.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @unavailable_when_down
    async def create(self, record: RequestRecord, prompt_ids: Sequence[int]) -> bool:
        """Persists a new request and marks it active; False if the id already exists.

        Requests that arrived more than retention_s ago drop out of list_recent().
        """
        if record.status.is_finished:
            raise ValueError(f"a new request cannot be {record.status.name}")
        request_id = record.request_id
        keys = [_hash_key(request_id), _prompt_key(request_id), ACTIVE_KEY, RECENT_KEY]
        trim_before = time.time() - self.retention_s
        prompt = pack_token_ids(prompt_ids)
        args = [request_id, record.arrival_ts, trim_before, prompt, *encode_record(record, len(prompt_ids))]
        return bool(await self._create_script(keys=keys, args=args))

    @unavailable_when_down
    async def append_step(
        self,
        deltas: dict[str, tuple[int, list[int]]],
        first_token_ts: dict[str, float] | None = None,
        finishes: Sequence[tuple[str, RequestStatus, FinishReason, str | None]] = (),
        cached_tokens: dict[str, int] | None = None,
        logprobs: dict[str, list[bytes]] | None = None,
        prompt_logprobs: dict[str, list[bytes]] | None = None,
    ) -> list[bool]:
        """Appends one engine step's new tokens for every request, and records the requests the step
        finished (as `finish_many`), in ONE round trip; returns finish_many's answers.

        `deltas` maps each request to the offset of its first new token and the new tokens. Appends
        go by offset, so writing a step again (after a reply lost to a broken connection) is safe:
        tokens already there are skipped, never doubled. `first_token_ts` maps requests whose first
        token is in this step to its time, and `cached_tokens` those whose worker said how many prompt
        tokens it had cached. `logprobs` holds the serialized TokenLogprob of each new token of the
        requests that asked for them, and `prompt_logprobs` a request's prompt logprobs, which come
        with its first token. Only for live requests: on the hot path, it does not check. The tokens
        and logprobs of every request land together (one script). It is one MULTI/EXEC when the step
        finishes a request: a crash between a request's last tokens and its finish would leave it
        RUNNING with a complete output, and recovery would run it on past its end. So is a step with
        prompt logprobs: a re-dispatch takes them as written once the first token is.
        """
        keys: list[str] = []
        args: list[int | bytes] = []
        for request_id, (offset, token_ids) in deltas.items():
            items = (logprobs or {}).get(request_id) or []
            if token_ids:
                keys += [_tokens_key(request_id), _logprobs_key(request_id)]
                args += [offset, pack_token_ids(token_ids), len(items), *items]
        with_prompt_logprobs = any((prompt_logprobs or {}).values())
        pipe = self._redis.pipeline(transaction=bool(finishes) or with_prompt_logprobs)
        if keys:
            pipe.eval(APPEND_STEP_LUA, len(keys), *keys, *args)
        for request_id, ts in (first_token_ts or {}).items():
            pipe.hset(_hash_key(request_id), "first_token_ts", ts)
        for request_id, count in (cached_tokens or {}).items():
            pipe.hset(_hash_key(request_id), "cached_tokens", count)
        for request_id, items in (prompt_logprobs or {}).items():
            if items:  # written whole, and only once: a retry finds them there
                pipe.eval(SET_LIST_ONCE_LUA, 1, _prompt_logprobs_key(request_id), *items)
        appends = len(pipe)
        self._queue_finishes(pipe, finishes)
        if not len(pipe):
            return []
        return [bool(done) for done in (await pipe.execute())[appends:]]

    async def _update_live(self, request_id: str, retention_ms: int, fields: dict[str, Any]) -> bool:
        keys, args = _update_args(request_id, retention_ms, fields)
        return bool(await self._update_script(keys=keys, args=args))

    @unavailable_when_down
    async def set_status(self, request_id: str, status: RequestStatus) -> bool:
        """Sets a non-terminal status (QUEUED again after a worker failure, say); False if not live."""
        if status.is_finished:
            raise ValueError(f"{status.name} is terminal: use finish()")
        return await self._update_live(request_id, 0, {"status": status.name})

    @unavailable_when_down
    async def mark_dispatched(self, request_id: str, worker_id: str, attempt: int) -> bool:
        """Records a dispatch (RUNNING on `worker_id`, attempt; the time of the first); False if not live."""
        return (await self.mark_dispatched_many([(request_id, worker_id, attempt)]))[0]

    @unavailable_when_down
    async def mark_dispatched_many(self, dispatches: Sequence[tuple[str, str, int]]) -> list[bool]:
        """mark_dispatched for many (request_id, worker_id, attempt) in ONE round trip,
        for a dispatch round that hands several requests out at once."""
        now = time.time()
        pipe = self._redis.pipeline(transaction=False)
        for request_id, worker_id, attempt in dispatches:
            fields = {"status": RequestStatus.RUNNING.name, "worker_id": worker_id, "attempt": attempt}
            _queue_update(pipe, request_id, 0, fields, once={"dispatch_ts": now})
        return [bool(done) for done in await pipe.execute()] if dispatches else []

    @unavailable_when_down
    async def set_gateway(self, request_id: str, gateway_id: str) -> bool:
        """Re-points a live request's output to another gateway (after a gateway loss); False if not live."""
        return await self._update_live(request_id, 0, {"gateway_id": gateway_id})

    @unavailable_when_down
    async def finish(
        self, request_id: str, status: RequestStatus, finish_reason: FinishReason, error: str | None = None
    ) -> bool:
        """Records the terminal status, drops the request from the active set and starts
        the retention TTL on all its keys; False, changing nothing, if not live."""
        return (await self.finish_many([(request_id, status, finish_reason, error)]))[0]

    @unavailable_when_down
    async def finish_many(self, outcomes: Sequence[tuple[str, RequestStatus, FinishReason, str | None]]) -> list[bool]:
        """finish() for many (request_id, status, reason, error) in ONE round trip: a step's finishes."""
        pipe = self._redis.pipeline(transaction=False)
        self._queue_finishes(pipe, outcomes)
        return [bool(done) for done in await pipe.execute()] if outcomes else []

    def _queue_finishes(
        self, pipe: Any, outcomes: Sequence[tuple[str, RequestStatus, FinishReason, str | None]]
    ) -> None:
        now, retention_ms = time.time(), max(1, round(self.retention_s * 1000))
        for request_id, status, finish_reason, error in outcomes:
            if not status.is_finished:
                raise ValueError(f"{status.name} is not terminal")
            fields: dict[str, Any] = {"status": status.name, "finish_reason": finish_reason.name, "finish_ts": now}
            if error is not None:
                fields["error"] = error
            _queue_update(pipe, request_id, retention_ms, fields)

    @unavailable_when_down
    async def get(self, request_id: str) -> RequestRecord | None:
        """A request's record, or None if unknown or expired."""
        records = await self.get_many([request_id])
        return records[0] if records else None

    @unavailable_when_down
    async def get_many(self, request_ids: Sequence[str]) -> list[RequestRecord]:
        """Records of the requests that still exist, in the given order, in one round trip."""
        pipe = self._redis.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.hgetall(_hash_key(request_id))
            pipe.strlen(_tokens_key(request_id))
        results = await pipe.execute() if request_ids else []
        return [
            decode_record(request_id, raw, num_bytes // TOKEN_BYTES)
            for request_id, raw, num_bytes in zip(request_ids, results[::2], results[1::2])
            if raw  # expired, or never existed
        ]

    @unavailable_when_down
    async def get_tokens(self, request_id: str, offset: int = 0) -> list[int]:
        """Generated token ids from index `offset` on (empty if none or unknown)."""
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        data = await self._redis.getrange(_tokens_key(request_id), offset * TOKEN_BYTES, -1)
        return unpack_token_ids(data)

    @unavailable_when_down
    async def get_logprobs(self, request_id: str, offset: int = 0) -> tuple[list[bytes], list[bytes]]:
        """The serialized TokenLogprobs of the generated tokens from index `offset` on, and of the
        prompt, in one round trip (empty where the request asked for none, or is unknown)."""
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        pipe = self._redis.pipeline(transaction=False)
        pipe.lrange(_logprobs_key(request_id), offset, -1)
        pipe.lrange(_prompt_logprobs_key(request_id), 0, -1)
        output, prompt = await pipe.execute()
        return output, prompt

    @unavailable_when_down
    async def get_prompt(self, request_id: str) -> list[int] | None:
        """Prompt token ids, or None if unknown or expired."""
        data = await self._redis.get(_prompt_key(request_id))
        return None if data is None else unpack_token_ids(data)

    @unavailable_when_down
    async def list_active(self) -> list[str]:
        """Ids of every unfinished request, sorted."""
        return sorted(member.decode() for member in await self._redis.smembers(ACTIVE_KEY))

    @unavailable_when_down
    async def list_recent(self, n: int) -> list[RequestRecord]:
        """Records of the `n` most recently arrived requests still retained, newest first."""
        if n <= 0:
            return []
        ids = [member.decode() for member in await self._redis.zrevrange(RECENT_KEY, 0, n - 1)]
        return await self.get_many(ids)
