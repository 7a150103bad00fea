"""The one place where the scheduler reads its environment."""

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class SchedulerSettings(BaseSettings):
    """Scheduler knobs, from ``SHARDLINE_<FIELD>`` environment variables (flags override them)."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_", env_ignore_empty=True)

    # Interface and port of the Scheduler gRPC service; port 0 picks a free one.
    host: str = "0.0.0.0"
    port: int = Field(50053, ge=0, le=65535)
    # Redis that holds request state (the scheduler is its only writer).
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Queued requests beyond which Submit answers RESOURCE_EXHAUSTED.
    queue_capacity: int = Field(1024, ge=1)
    # How often workers heartbeat, and how long a silent worker stays registered.
    heartbeat_interval_s: float = Field(2.0, gt=0)
    heartbeat_timeout_s: float = Field(10.0, gt=0)
    # How long RegisterWorker waits to connect to the worker's address before answering UNAVAILABLE.
    worker_connect_timeout_s: float = Field(3.0, gt=0)
    # Dispatches per request; a worker failure after the last one fails the request.
    max_attempts: int = Field(3, ge=1)
    # How long a Redis write is retried (the streams pause meanwhile) before the requests it held
    # are failed resumably and wait for Redis to come back; and how many steps of one worker may wait
    # behind it meanwhile.
    redis_outage_s: float = Field(10.0, gt=0)
    redis_outage_max_steps: int = Field(2048, ge=1)
    # How often Redis is pinged: while it does not answer, health is NOT_SERVING and nothing is dispatched.
    redis_check_interval_s: float = Field(0.5, gt=0)
    # How long finished requests stay readable in Redis.
    request_retention_s: float = Field(24 * 3600.0, gt=0)
    # In-flight requests per worker, as a multiple of its max_num_seqs: above 1 so
    # the engine's own queue holds the next requests when a slot frees up.
    dispatch_overcommit: float = Field(1.5, ge=1.0)
    # Prefix affinity yields to balance when the preferred worker's load (in-flight
    # over capacity) exceeds the least-loaded worker's by more than this.
    affinity_load_slack: float = Field(0.25, ge=0.0)
    # TokenBatches buffered per gateway; a gateway that falls this far behind is
    # disconnected and recovers from Redis instead of stalling every worker stream.
    subscriber_queue_size: int = Field(4096, ge=1)
    # Prometheus /metrics port; 0 turns the endpoint off.
    metrics_port: int = Field(0, ge=0, le=65535)
    # Export spans over OTLP (SHARDLINE_OTLP_ENDPOINT); off keeps trace-context propagation only.
    tracing: bool = True
    # service.instance.id on this scheduler's spans.
    instance_id: str = "scheduler-0"
