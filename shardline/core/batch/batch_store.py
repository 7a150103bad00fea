"""Batches in Redis: their records, their per-line results, and the set of chunks done.

Keys, all under `shardline:batch:`:

- `shardline:batch:<id>`: hash, a BatchRecord (status, counts, chunks, timestamps);
- `shardline:batch:<id>:out` and `:err`: hash, line index -> that line's output or error line (JSON).
  Together they are the done-set: a line in either is never run again, whoever runs its chunk again;
- `shardline:batch:<id>:chunks`: set of the chunk indices finished;
- `shardline:batches:<owner>`: sorted set of the owner's batch ids by creation time, for listing;
- `shardline:batches:by_status`: hash, status -> how many batches are in it, kept by the same
  scripts that change a status, so /metrics reads it in one call.

A state change is one script that checks the state it leaves, so a cancel and a worker finishing
the batch cannot both win.
"""

from __future__ import annotations

import time

from shardline.core.batch.batch_record import BatchRecord
from shardline.core.store.redis_pool import async_redis
from shardline.core.store.request_store import CONNECT_TIMEOUT_S, SOCKET_TIMEOUT_S, unavailable_when_down

PREFIX = "shardline:batch:"

# KEYS[1] the batch, KEYS[2] the counts by status; ARGV to, timestamp field, now, then the states it
# may leave. Returns the status after.
_TRANSITION_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
for i = 4, #ARGV do
  if status == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[2], ARGV[3])
    redis.call('HINCRBY', KEYS[2], status, -1)
    redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
    return ARGV[1]
  end
end
return status
"""

# KEYS[1] the batch, KEYS[2] its :out, KEYS[3] its :err; ARGV line index, 'out' or 'err', the line.
# Records a line's result once: 1 if it was new, 0 if that line was done already.
_RECORD_LINE_LUA = """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 or redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then
  return 0
end
if ARGV[2] == 'out' then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
  redis.call('HINCRBY', KEYS[1], 'completed', 1)
else
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
  redis.call('HINCRBY', KEYS[1], 'failed', 1)
end
return 1
"""


STATUS_COUNTS_KEY = "shardline:batches:by_status"


def _key(batch_id: str) -> str:
    return PREFIX + batch_id


def _owner_key(owner: str) -> str:
    return f"shardline:batches:{owner or '-'}"


class BatchStore:
    """Batch records and results in Redis; every method answers StoreUnavailable while Redis is down."""

    def __init__(self, redis_url: str) -> None:
        self._redis = async_redis(
            redis_url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=CONNECT_TIMEOUT_S, decode_responses=True
        )
        self._transition = self._redis.register_script(_TRANSITION_LUA)
        self._record_line = self._redis.register_script(_RECORD_LINE_LUA)

    async def close(self) -> None:
        await self._redis.aclose()

    @unavailable_when_down
    async def create(self, record: BatchRecord) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(_key(record.id), mapping=record.to_hash())
            pipe.zadd(_owner_key(record.owner), {record.id: record.timestamps["created_at"]})
            pipe.hincrby(STATUS_COUNTS_KEY, record.status, 1)
            await pipe.execute()

    @unavailable_when_down
    async def get(self, batch_id: str) -> BatchRecord | None:
        fields = await self._redis.hgetall(_key(batch_id))
        return BatchRecord.from_hash(fields) if fields else None

    @unavailable_when_down
    async def page(self, owner: str, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """The owner's batches, newest first, from the one after `after`; and whether more follow."""
        ids = await self._redis.zrevrange(_owner_key(owner), 0, -1)
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        page = ids[: limit + 1]
        records = [r for r in [await self.get(i) for i in page[:limit]] if r is not None]
        return records, len(page) > limit

    @unavailable_when_down
    async def transition(self, batch_id: str, to: str, leaving: tuple[str, ...]) -> str | None:
        """Moves the batch to `to` if it is in one of `leaving`, stamping `<to>_at`; returns its status
        after (unchanged if it was elsewhere), None if there is no such batch."""
        now = str(int(time.time()))
        return await self._transition(keys=[_key(batch_id), STATUS_COUNTS_KEY], args=[to, f"{to}_at", now, *leaving])

    @unavailable_when_down
    async def status_counts(self) -> dict[str, int]:
        """How many batches are in each status."""
        return {status: int(n) for status, n in (await self._redis.hgetall(STATUS_COUNTS_KEY)).items()}

    @unavailable_when_down
    async def set_fields(self, batch_id: str, **fields: str) -> None:
        await self._redis.hset(_key(batch_id), mapping=fields)

    @unavailable_when_down
    async def record_line(self, batch_id: str, index: int, ok: bool, line: str) -> bool:
        """Keeps a line's output (ok) or error line, once; False if the line had one already."""
        keys = [_key(batch_id), _key(batch_id) + ":out", _key(batch_id) + ":err"]
        return bool(await self._record_line(keys=keys, args=[index, "out" if ok else "err", line]))

    @unavailable_when_down
    async def done_lines(self, batch_id: str, first: int, count: int) -> set[int]:
        """Which of lines [first, first + count) have a result."""
        indices = [str(i) for i in range(first, first + count)]
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hmget(_key(batch_id) + ":out", indices)
            pipe.hmget(_key(batch_id) + ":err", indices)
            out, err = await pipe.execute()
        return {first + i for i, (o, e) in enumerate(zip(out, err)) if o is not None or e is not None}

    @unavailable_when_down
    async def results(self, batch_id: str, ok: bool) -> list[str]:
        """Every output (ok) or error line, in input order."""
        lines = await self._redis.hgetall(_key(batch_id) + (":out" if ok else ":err"))
        return [lines[k] for k in sorted(lines, key=int)]

    @unavailable_when_down
    async def chunk_done(self, batch_id: str, chunk: int) -> int:
        """Marks a chunk finished; returns how many of the batch's chunks are."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.sadd(_key(batch_id) + ":chunks", chunk)
            pipe.scard(_key(batch_id) + ":chunks")
            _, done = await pipe.execute()
        return int(done)

    @unavailable_when_down
    async def ping(self) -> None:
        await self._redis.ping()
