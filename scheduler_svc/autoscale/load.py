"""What the autoscaler reads about one model's load at one interval: the scheduler and the simulator both build it."""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoadSample:
    """What the scheduler knows about one model's load at one interval."""

    ts: float  # seconds: the scheduler's monotonic clock, or trace time in the simulator
    arrivals: int  # requests that arrived since the previous sample
    completions: int  # requests that finished since the previous sample
    mean_service_s: float | None  # mean dispatch-to-finish time of those completions; None: none finished
    queue_depth: int  # requests queued in the scheduler for this model
    in_flight: int  # requests dispatched to its workers (draining ones too) and not finished
    workers_ready: int  # registered and not draining
    slots_per_worker: int  # a worker's max_num_seqs: the requests it runs at once
    kv_usage: float = 0.0  # mean fraction of KV blocks used on its workers, 0..1
    ttft_p90_s: float | None = None  # 90th percentile of the interval's first-token delays; None: no first token
    cold_start_s: float | None = None  # measured start-to-ready of recent workers; None: none measured yet
