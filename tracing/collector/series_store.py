"""The collector's time series in Redis: time buckets at three resolutions, each kept a bounded time.

Keys, under ``shardline:series:``:

- ``{step}s:{start}``  hash, one per time bucket of ``step`` seconds (1, 10 or 60) starting at unix
  second ``start``; a field per series, label values and statistic (``name\\x1flabels\\x1fstat``):
  ``n`` and ``sum`` (added), ``max``, and ``h{i}`` for latency bucket ``i`` (latency_histogram.py);
- ``{step}s``          sorted set of the bucket starts that exist at that resolution, by start.

Each sample is written into all three resolutions at once, so downsampling needs no later pass and
out-of-order spans land where they belong. Each statistic merges by addition (or max), which is what
lets a 60-second bucket equal the sum of its seconds and a read at any step merge buckets the same
way. Every write of a span batch is one pipeline: the batch's samples summed per bucket in Python
first, then one script call per touched bucket, plus one per resolution dropping the buckets past its
retention (each bucket also expires then, so nothing outlives its retention if the collector stops).
"""

import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from tracing.collector import latency_histogram
from tracing.collector.series_samples import COUNTER, GAUGE, HISTOGRAM, SERIES, Sample

logger = logging.getLogger(__name__)

PREFIX = "shardline:series:"
SEP = "\x1f"  # between a field's name, labels and statistic
LABEL_SEP = "\x1e"  # between label values
# A sample this far past the collector's clock is dropped: a service clock that is badly off.
MAX_FUTURE_S = 300.0
# One drop call deletes at most this many buckets; a backlog goes over later writes.
DROP_BATCH = 1000

# KEYS: the bucket, the resolution's index. ARGV: bucket start, seconds it has left, then (op, field, value)
# triples, op "+" to add and "max" to keep the larger.
_WRITE_LUA = """
for i = 3, #ARGV, 3 do
  local field, value = ARGV[i + 1], ARGV[i + 2]
  if ARGV[i] == '+' then
    redis.call('HINCRBYFLOAT', KEYS[1], field, value)
  else
    local current = tonumber(redis.call('HGET', KEYS[1], field))
    if current == nil or current < tonumber(value) then redis.call('HSET', KEYS[1], field, value) end
  end
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[1])
"""

# KEYS: the resolution's index. ARGV: the last start to drop, the key prefix of its buckets, the cap.
_DROP_LUA = """
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
for _, start in ipairs(old) do
  redis.call('DEL', ARGV[2] .. start)
  redis.call('ZREM', KEYS[1], start)
end
return #old
"""


@dataclass(frozen=True, slots=True)
class Resolution:
    """Buckets of ``step_s`` seconds, each kept until ``retention_s`` after its end."""

    step_s: int
    retention_s: int


@dataclass(slots=True)
class SeriesWindow:
    """A read: the step's bucket starts, and per (series, labels, statistic) a value per bucket."""

    start_s: int
    end_s: int
    step_s: int
    # The stored resolution the read merged from.
    resolution_s: int
    times: list[int]
    series: list[dict[str, object]]

    def to_json(self) -> dict[str, object]:
        """The ``/api/series`` answer."""
        return {
            "from": self.start_s,
            "to": self.end_s,
            "step_s": self.step_s,
            "resolution_s": self.resolution_s,
            "times": self.times,
            "series": self.series,
        }


def _field(sample: Sample, stat: str) -> str:
    # A label value holding a separator would split wrong when read back: it loses those characters.
    labels = LABEL_SEP.join(value.replace(SEP, "").replace(LABEL_SEP, "") for value in sample.labels)
    return f"{sample.name}{SEP}{labels}{SEP}{stat}"


def _updates(sample: Sample) -> list[tuple[str, str, float]]:
    """(op, field, value) of one sample, by its series' kind."""
    kind = SERIES[sample.name].kind
    if kind == COUNTER:
        return [("+", _field(sample, "n"), sample.value)]
    updates = [("+", _field(sample, "n"), 1.0), ("+", _field(sample, "sum"), sample.value)]
    if kind == GAUGE:
        updates.append(("max", _field(sample, "max"), sample.value))
    elif kind == HISTOGRAM:
        updates.append(("+", _field(sample, f"h{latency_histogram.bucket_of(sample.value)}"), 1.0))
    return updates


class SeriesStore:
    """Writes samples into the time buckets and reads them back merged to any step."""

    def __init__(
        self,
        redis: Redis,
        resolutions: Iterable[Resolution],
        *,
        clock: Callable[[], float] = time.time,
        prefix: str = PREFIX,
    ) -> None:
        self._redis = redis
        self.resolutions = tuple(sorted(resolutions, key=lambda r: r.step_s))
        self._clock = clock
        self._prefix = prefix
        self._write = redis.register_script(_WRITE_LUA)
        self._drop = redis.register_script(_DROP_LUA)

    @property
    def max_window_s(self) -> int:
        """The longest history kept: the coarsest resolution's retention."""
        return max(r.retention_s for r in self.resolutions)

    def _index(self, resolution: Resolution) -> str:
        return f"{self._prefix}{resolution.step_s}s"

    async def queue(self, pipe: Pipeline, samples: Iterable[Sample]) -> int:
        """Adds the writes of ``samples`` and the drop of expired buckets to ``pipe``; returns how many
        samples were outside even the longest retention (too old, or too far ahead) and left out."""
        now = self._clock()
        samples = list(samples)
        skipped = 0
        for resolution in self.resolutions:
            first_kept = math.floor((now - resolution.retention_s) / resolution.step_s) * resolution.step_s
            buckets: dict[int, dict[str, list]] = defaultdict(dict)
            for sample in samples:
                start = math.floor(sample.time_s / resolution.step_s) * resolution.step_s
                if start < first_kept or sample.time_s > now + MAX_FUTURE_S:
                    skipped += resolution is self.resolutions[-1]
                    continue
                fields = buckets[start]
                for op, field, value in _updates(sample):
                    held = fields.get(field)
                    if held is None:
                        fields[field] = [op, value]
                    else:
                        held[1] = held[1] + value if op == "+" else max(held[1], value)
            index = self._index(resolution)
            for start, fields in buckets.items():
                # A time to live rather than a time, so that it counts from this store's clock.
                ttl = math.ceil(start + resolution.step_s + resolution.retention_s - now)
                args: list[str | int | float] = [start, max(1, ttl)]
                for field, (op, value) in fields.items():
                    args += [op, field, repr(float(value))]
                await self._write(keys=[f"{index}:{start}", index], args=args, client=pipe)
            await self._drop(keys=[index], args=[first_kept - 1, f"{index}:", DROP_BATCH], client=pipe)
        if skipped:
            logger.debug("left out %d samples outside the series' retention", skipped)
        return skipped

    def resolution_for(self, start_s: float) -> Resolution:
        """The finest resolution that still holds ``start_s`` (else the coarsest).

        The finest, even for a coarse step: a window that does not start on a coarse bucket's edge
        is then still read exactly. What that costs is bounded: a read touches at most a resolution's
        retention over its step in buckets (1440 with the default settings).
        """
        now = self._clock()
        holding = [r for r in self.resolutions if start_s >= now - r.retention_s]
        return holding[0] if holding else self.resolutions[-1]

    async def read(self, names: list[str], start_s: float, end_s: float, step_s: int | None) -> SeriesWindow:
        """``names``' values per ``step_s`` bucket over ``[start_s, end_s]``; the step is rounded up to a
        multiple of the resolution read (resolution_for)."""
        resolution = self.resolution_for(start_s)
        step = max(resolution.step_s, math.ceil((step_s or 1) / resolution.step_s) * resolution.step_s)
        # Steps count from the window's first bucket, not from the epoch: a window read as one step
        # (`shardline top`'s last minute) is then one point holding the whole window.
        first = math.floor(start_s / resolution.step_s) * resolution.step_s
        last_bucket = math.floor(end_s / resolution.step_s) * resolution.step_s
        times = list(range(first, last_bucket + 1, step))
        index = self._index(resolution)
        starts = [int(float(s)) for s in await self._redis.zrangebyscore(index, first, last_bucket)]
        pipe = self._redis.pipeline(transaction=False)
        for start in starts:
            pipe.hgetall(f"{index}:{start}")
        hashes = await pipe.execute() if starts else []
        wanted = set(names)
        merged: dict[tuple[str, str], dict[int, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
        for start, fields in zip(starts, hashes, strict=True):
            slot = first + (start - first) // step * step
            for raw, raw_value in fields.items():
                name, labels, stat = raw.decode().split(SEP)
                if name not in wanted:
                    continue
                stats, value = merged[name, labels][slot], float(raw_value)
                stats[stat] = max(stats.get(stat, value), value) if stat == "max" else stats.get(stat, 0.0) + value
        series = [
            row
            for (name, labels), slots in sorted(merged.items())
            if name in names
            for row in _rows(name, labels, slots, times, step)
        ]
        return SeriesWindow(first, times[-1], step, resolution.step_s, times, series)


def _rows(name: str, labels: str, slots: dict[int, dict[str, float]], times: list[int], step: int) -> list[dict]:
    spec = SERIES[name]
    label_values = labels.split(LABEL_SEP) if spec.labels else []
    base = {"name": name, "labels": dict(zip(spec.labels, label_values, strict=True)), "unit": spec.unit}
    if spec.kind == COUNTER:
        return [{**base, "stat": "rate", "values": [_round(slots[t].get("n", 0.0) / step) for t in times]}]
    if spec.kind == GAUGE:
        return [
            {**base, "stat": "mean", "values": [_mean(slots.get(t)) for t in times]},
            {**base, "stat": "max", "values": [_round(slots[t]["max"]) if t in slots else None for t in times]},
        ]
    histograms = {t: {int(k[1:]): v for k, v in slots[t].items() if k.startswith("h")} for t in times if t in slots}
    rows = [
        {**base, "stat": stat, "values": [_round(latency_histogram.quantile(histograms.get(t, {}), q)) for t in times]}
        for stat, q in (("p50", 0.5), ("p99", 0.99))
    ]
    rows.append({**base, "stat": "mean", "values": [_mean(slots.get(t)) for t in times]})
    return rows


def _mean(stats: dict[str, float] | None) -> float | None:
    if not stats or not stats.get("n"):
        return None
    return _round(stats["sum"] / stats["n"])


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
