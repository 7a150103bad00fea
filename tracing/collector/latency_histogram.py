"""Latencies summed into fixed log-spaced buckets, so that percentiles survive downsampling.

A p99 per second cannot be turned into a p99 per minute: percentiles do not average. Counts per fixed
bucket do add up, so every time bucket of a latency series keeps one count per latency bucket, a
minute's counts are the sum of its seconds', and a p99 read from any sum is as good as one read from
raw samples, up to the width of one bucket: four buckets per doubling, so within 9% of the true value.
"""

import math

# Bucket 0 holds everything at or below MIN_MS; bucket i > 0 holds (MIN_MS * 2^((i-1)/4), MIN_MS * 2^(i/4)].
MIN_MS = 0.1
BUCKETS_PER_DOUBLING = 4
# 0.1 ms * 2^(83/4): the last bucket starts past 100 s and holds everything above.
NUM_BUCKETS = 84


def bucket_of(ms: float) -> int:
    """The bucket a latency of ``ms`` milliseconds counts in."""
    if not ms > MIN_MS:  # NaN lands here too rather than raising
        return 0
    return min(NUM_BUCKETS - 1, math.ceil(math.log2(ms / MIN_MS) * BUCKETS_PER_DOUBLING))


def bucket_value(index: int) -> float:
    """The value a bucket stands for: the geometric middle of its bounds, so the relative error is even."""
    if index <= 0:
        return MIN_MS
    return MIN_MS * 2 ** ((index - 0.5) / BUCKETS_PER_DOUBLING)


def quantile(counts: dict[int, float], q: float) -> float | None:
    """The ``q`` quantile (0 < q <= 1) of the latencies counted in ``counts`` (bucket -> count), by
    nearest rank: the bucket holding the ceil(q * n)-th smallest; None when nothing was counted."""
    total = sum(counts.values())
    if total <= 0:
        return None
    rank = max(1.0, math.ceil(q * total - 1e-9))
    seen = 0.0
    for index in sorted(counts):
        seen += counts[index]
        if seen >= rank:
            return bucket_value(index)
    return bucket_value(max(counts))
