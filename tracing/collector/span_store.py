"""Spans in Redis, bounded by count and age, queryable by request, trace and time.

Keys, under ``shardline:trace:``:

- ``span:{trace_id}``  hash: span id -> the span as an OTLP ``ResourceSpans``
  holding just that span, so each value is self-describing protobuf;
- ``by_time``          sorted set of span refs, scored by start time (unix s);
- ``by_end``           the same refs scored by end time, which the bounds trim by: a span
  arrives when it ends, so a request's root (it starts first and ends last)
  is among the last of its spans to go, never the first;
- ``req:{request_id}`` sorted set of the refs of spans carrying that
  ``shardline.request_id``, scored like ``by_time``;
- ``requests``         sorted set of request ids, scored by their first span.

A span ref is ``{trace_id}:{span_id}:{request_id}``; carrying the request id in
the ref lets the trim remove a span from every index without decoding it.
"""

import logging
import time
from collections.abc import Iterable

from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, Span
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from tracing import attributes as attr
from tracing.collector.series_samples import SERIES_SPANS, Sample, samples_of
from tracing.collector.series_store import Resolution, SeriesStore
from tracing.collector.stored_span import StoredSpan, any_value

logger = logging.getLogger(__name__)

PREFIX = "shardline:trace:"
# Redis is single-threaded and shared with request state, so one trim may
# delete at most this many spans; a backlog is worked off over later writes.
TRIM_BATCH = 2000

# Removes spans that ended too long ago, then the earliest-ended beyond the count
# bound, with their blobs and request-index entries, atomically.
_TRIM_LUA = """
local by_time, requests, by_end, prefix = KEYS[1], KEYS[2], KEYS[3], ARGV[3]
local cap = tonumber(ARGV[4])
local old = redis.call('ZRANGEBYSCORE', by_end, '-inf', ARGV[1], 'LIMIT', 0, cap)
local excess = math.min(redis.call('ZCARD', by_end) - #old - tonumber(ARGV[2]), cap - #old)
if excess > 0 then
  for _, ref in ipairs(redis.call('ZRANGE', by_end, #old, #old + excess - 1)) do old[#old + 1] = ref end
end
for _, ref in ipairs(old) do
  redis.call('ZREM', by_time, ref)
  redis.call('ZREM', by_end, ref)
  redis.call('HDEL', prefix .. 'span:' .. string.sub(ref, 1, 32), string.sub(ref, 34, 49))
  local rid = string.sub(ref, 51)
  if rid ~= '' then
    local rkey = prefix .. 'req:' .. rid
    redis.call('ZREM', rkey, ref)
    if redis.call('ZCARD', rkey) == 0 then redis.call('ZREM', requests, rid) end
  end
end
return #old
"""


def _request_id(span_attributes: Iterable[KeyValue]) -> str:
    for pair in span_attributes:
        if pair.key == attr.REQUEST_ID:
            value = any_value(pair.value)
            return "" if value is None else str(value)
    return ""


def _in_start_order(spans: Iterable[StoredSpan]) -> list[StoredSpan]:
    # Longer first on equal starts, so an enclosing span precedes the spans it encloses.
    return sorted(spans, key=lambda span: (span.start_ns, -span.end_ns))


def _decode(blob: bytes) -> StoredSpan:
    resource_spans = ResourceSpans.FromString(blob)
    return StoredSpan.from_otlp(resource_spans.scope_spans[0].spans[0], resource_spans.resource)


class SpanStore:
    """Stores finished spans in Redis and answers the dashboard's queries.

    Every write trims the store back to ``max_spans`` spans and ``max_age_s``
    seconds of history. With ``series``, each write also adds the spans'
    samples to the time series (series_store.py), in the same pipeline.
    """

    def __init__(
        self,
        redis: Redis,
        *,
        max_spans: int,
        max_age_s: float,
        prefix: str = PREFIX,
        series: SeriesStore | None = None,
    ) -> None:
        self._redis = redis
        self._max_spans = max_spans
        self._max_age_s = max_age_s
        self._prefix = prefix
        self._trim = redis.register_script(_TRIM_LUA)
        self.series = series

    @classmethod
    def from_url(
        cls, redis_url: str, *, max_spans: int, max_age_s: float, series: tuple[Resolution, ...] = ()
    ) -> "SpanStore":
        """A store on its own connection pool to ``redis_url``, keeping time series at ``series``'
        resolutions (none: no series)."""
        redis = Redis.from_url(redis_url)
        return cls(
            redis, max_spans=max_spans, max_age_s=max_age_s, series=SeriesStore(redis, series) if series else None
        )

    async def ping(self) -> None:
        """Raises a RedisError unless Redis answers (and takes the URL's password and database)."""
        await self._redis.ping()

    async def close(self) -> None:
        """Closes the Redis connections."""
        await self._redis.aclose()

    async def add(self, resource_spans: Iterable[ResourceSpans]) -> int:
        """Stores the spans of an OTLP export, then trims; returns how many were stored."""
        pipe = self._redis.pipeline(transaction=False)
        stored = 0
        samples: list[Sample] = []
        for batch in resource_spans:
            single = ResourceSpans(resource=batch.resource, schema_url=batch.schema_url)
            holder = single.scope_spans.add()
            for scope_spans in batch.scope_spans:
                holder.scope.CopyFrom(scope_spans.scope)
                holder.schema_url = scope_spans.schema_url
                for span in scope_spans.spans:
                    if len(span.trace_id) != 16 or len(span.span_id) != 8:
                        # Invalid per OTLP, and the fixed-width span refs depend on these lengths.
                        logger.warning("dropping span %r with a malformed trace or span id", span.name)
                        continue
                    del holder.spans[:]
                    holder.spans.append(span)
                    self._queue_span(pipe, span, single.SerializeToString())
                    stored += 1
                    if self.series is not None and span.name in SERIES_SPANS:
                        samples += samples_of(StoredSpan.from_otlp(span, batch.resource))
        if samples and self.series is not None:
            await self.series.queue(pipe, samples)
        if stored:
            await pipe.execute()
            await self.trim()
        return stored

    def _queue_span(self, pipe: Pipeline, span: Span, blob: bytes) -> None:
        trace_id, span_id = span.trace_id.hex(), span.span_id.hex()
        request_id = _request_id(span.attributes)
        ref = f"{trace_id}:{span_id}:{request_id}"
        score = span.start_time_unix_nano / 1e9
        pipe.hset(f"{self._prefix}span:{trace_id}", span_id, blob)
        pipe.zadd(f"{self._prefix}by_time", {ref: score})
        pipe.zadd(f"{self._prefix}by_end", {ref: span.end_time_unix_nano / 1e9})
        if request_id:
            pipe.zadd(f"{self._prefix}req:{request_id}", {ref: score})
            # LT keeps the earliest span's time however the exports interleave.
            pipe.zadd(f"{self._prefix}requests", {request_id: score}, lt=True)

    async def trim(self) -> int:
        """Deletes spans beyond the retention bounds (a bounded batch per call); returns how many."""
        cutoff = time.time() - self._max_age_s
        removed = await self._trim(
            keys=[f"{self._prefix}by_time", f"{self._prefix}requests", f"{self._prefix}by_end"],
            args=[cutoff, self._max_spans, self._prefix, TRIM_BATCH],
        )
        if removed:
            logger.debug("trimmed %d spans", removed)
        return removed

    async def by_trace(self, trace_id: str) -> list[StoredSpan]:
        """Every stored span of one trace, by start time."""
        blobs = await self._redis.hvals(f"{self._prefix}span:{trace_id}")
        return _in_start_order(_decode(blob) for blob in blobs)

    async def by_request(self, request_id: str) -> list[StoredSpan]:
        """Every span of every trace in which the request has a span, by start time.

        That includes the request's spans without the request-id attribute,
        such as the gRPC server spans between its services.
        """
        return (await self.by_requests([request_id]))[0]

    async def by_requests(self, request_ids: list[str]) -> list[list[StoredSpan]]:
        """by_request for many requests in two round trips, each trace read and decoded once."""
        pipe = self._redis.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.zrange(f"{self._prefix}req:{request_id}", 0, -1)
        traces_of = [
            sorted({ref.decode().split(":", 1)[0] for ref in refs})
            for refs in (await pipe.execute() if request_ids else [])
        ]
        trace_ids = sorted({trace_id for traces in traces_of for trace_id in traces})
        pipe = self._redis.pipeline(transaction=False)
        for trace_id in trace_ids:
            pipe.hvals(f"{self._prefix}span:{trace_id}")
        blobs = await pipe.execute() if trace_ids else []
        spans = {trace_id: [_decode(blob) for blob in found] for trace_id, found in zip(trace_ids, blobs)}
        return [_in_start_order(span for trace_id in traces for span in spans[trace_id]) for traces in traces_of]

    async def recent_requests(self, n: int) -> list[str]:
        """The ids of the ``n`` requests that started last, newest first."""
        ids = await self._redis.zrevrange(f"{self._prefix}requests", 0, n - 1)
        return [request_id.decode() for request_id in ids]

    async def in_window(self, start_ns: int, end_ns: int, limit: int = 100_000) -> list[StoredSpan]:
        """Spans that started in ``[start_ns, end_ns]``, at most ``limit``, by start time."""
        refs = await self._redis.zrangebyscore(
            f"{self._prefix}by_time", start_ns / 1e9, end_ns / 1e9, start=0, num=limit
        )
        by_trace: dict[str, list[str]] = {}
        for ref in refs:
            trace_id, span_id, _ = ref.decode().split(":", 2)
            by_trace.setdefault(trace_id, []).append(span_id)
        pipe = self._redis.pipeline(transaction=False)
        for trace_id, span_ids in by_trace.items():
            pipe.hmget(f"{self._prefix}span:{trace_id}", span_ids)
        blobs = [blob for found in await pipe.execute() for blob in found]
        # A blob is None when a concurrent trim removed the span after we read its ref.
        return _in_start_order(_decode(blob) for blob in blobs if blob is not None)

    async def requests_in_window(
        self, start_ns: int, end_ns: int, limit: int, longest_ns: int = 0
    ) -> tuple[list[str], bool]:
        """The requests with a span in ``[start_ns, end_ns]``, by their first span's start; and whether
        more than ``limit`` spans matched a bound, so that some may be missing.

        A span is in the window when it starts or ends in it, or, no longer than ``longest_ns``, runs
        across all of it."""
        low, high = start_ns / 1e9, end_ns / 1e9
        pipe = self._redis.pipeline(transaction=False)
        for index in ("by_time", "by_end"):
            pipe.zrangebyscore(f"{self._prefix}{index}", low, high, start=0, num=limit)
        # A span across the whole window started before it, within ``longest_ns``, and ends after it. Sorted
        # sets cannot ask both at once, so this reads the spans that started in that lead, the latest first
        # and at most ``limit`` of them, and keeps those whose end (ZMSCORE on by_end) is past the window:
        # one bounded range read and one lookup, however long ago the store began.
        pipe.zrevrangebyscore(f"{self._prefix}by_time", f"({low}", low - longest_ns / 1e9, start=0, num=limit)
        started, ended, before = await pipe.execute()
        across: list[bytes] = []
        if before:
            ends = await self._redis.zmscore(f"{self._prefix}by_end", before)
            across = [ref for ref, end in zip(before, ends, strict=True) if end is not None and end > high]
        ids = sorted({rid for ref in (*started, *ended, *across) if (rid := ref.decode().split(":", 2)[2])})
        scores = await self._redis.zmscore(f"{self._prefix}requests", ids) if ids else []
        # A score is None when a trim removed the request between the two reads.
        found = sorted((score, rid) for rid, score in zip(ids, scores, strict=True) if score is not None)
        return [rid for _score, rid in found], limit in (len(started), len(ended), len(before))
