"""The batch workers' Prometheus metrics, on their /metrics."""

from prometheus_client import Counter, Gauge

LINES = Counter("shardline_batch_lines", "Batch lines finished, by result.", ["result"])
BATCHES = Counter("shardline_batches_finished", "Batches that reached a terminal status, by status.", ["status"])
CHUNKS = Counter("shardline_batch_chunks", "Chunks run to their end (lines done, or the batch stopped).")
IN_FLIGHT = Gauge("shardline_batch_requests_in_flight", "Batch requests sent to the gateway and not yet answered.")
