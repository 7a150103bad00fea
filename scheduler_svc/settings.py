"""The one place where the scheduler reads its environment."""

from typing import Literal

from pydantic import Field, model_validator
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
    # Order within a priority class: fair (tenants by VTC, earliest deadline first within a tenant) or
    # fifo (arrival order, whatever the tenants and deadlines: the baseline of the fairness benchmarks).
    queue_order: Literal["fair", "fifo"] = "fair"
    # How often workers heartbeat, and how long a silent worker stays registered.
    heartbeat_interval_s: float = Field(2.0, gt=0)
    heartbeat_timeout_s: float = Field(10.0, gt=0)
    # How long RegisterWorker waits to connect to the worker's address before answering UNAVAILABLE.
    worker_connect_timeout_s: float = Field(3.0, gt=0)
    # Dispatches per request; a worker failure after the last one fails the request.
    max_attempts: int = Field(3, ge=1)
    # How long a model's requests wait while no live worker serves it: past it, its queued requests
    # fail with UNAVAILABLE (HTTP 503) and new ones are refused, until a worker of it registers.
    # With an autoscaling policy, autoscale_cold_start_s is added (it may be starting one).
    no_worker_timeout_s: float = Field(30.0, gt=0)
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
    # Disaggregated prefill (docs/kv_transfer.md#the-decision): a request dispatched to a decode worker
    # has its prompt prefilled on a prefill worker when one is up and the part of the prompt that worker
    # likely lacks has at least this many tokens; below it, moving the KV costs more than it saves.
    remote_prefill_min_tokens: int = Field(512, ge=1)
    # How long one prefill worker may take over a remote prefill (its blocks' transfer included) before
    # the next one is tried, and after the last, the decode worker prefills the request itself.
    remote_prefill_timeout_s: float = Field(120.0, gt=0)
    # TokenBatches buffered per gateway; a gateway that falls this far behind is
    # disconnected and recovers from Redis instead of stalling every worker stream.
    subscriber_queue_size: int = Field(4096, ge=1)
    # Prometheus /metrics port; 0 turns the endpoint off.
    metrics_port: int = Field(0, ge=0, le=65535)
    # Export spans over OTLP (SHARDLINE_OTLP_ENDPOINT); off keeps trace-context propagation only.
    tracing: bool = True
    # service.instance.id on this scheduler's spans.
    instance_id: str = "scheduler-0"
    # The autoscaler (scheduler_svc/pool_scaler.py, docs/autoscaling.md): the policy that decides each
    # model's worker count, one of static (off: the pool is what was started), reactive, naive, lt-u and
    # lt-ua; its forecaster (ewma or arima); the bounds; how often it decides.
    autoscale_policy: Literal["static", "reactive", "naive", "lt-u", "lt-ua"] = "static"
    autoscale_forecaster: Literal["ewma", "arima"] = "ewma"
    autoscale_min_workers: int = Field(1, ge=0)
    autoscale_max_workers: int = Field(1, ge=1)
    autoscale_interval_s: float = Field(10.0, gt=0)
    # The share of a worker's slots the policies plan to keep busy, and how long a fall in the count
    # waits for every recommendation of the window to agree (a Kubernetes HPA's stabilisation).
    autoscale_target_utilisation: float = Field(0.75, gt=0, lt=1)
    autoscale_scale_down_window_s: float = Field(300.0, ge=0)
    # The cold start planned with until a worker reports its own (start to ready), in seconds.
    autoscale_cold_start_s: float = Field(60.0, gt=0)
    # How long a worker chosen for removal may take to finish its requests; past it they move to other
    # workers with their tokens so far, as on a worker failure, without counting as one.
    autoscale_drain_timeout_s: float = Field(300.0, gt=0)
    # What carries the count out: none publishes it (GetStats, /metrics: `shardline up --autoscale`,
    # KEDA and compose follow it), kubernetes patches the worker Deployment's replicas.
    autoscale_driver: Literal["none", "kubernetes"] = "none"
    autoscale_k8s_namespace: str = "shardline"
    autoscale_k8s_deployment: str = "gpu-worker"

    @model_validator(mode="after")
    def _bounds(self) -> "SchedulerSettings":
        if self.autoscale_min_workers > self.autoscale_max_workers:
            raise ValueError(
                f"autoscale_min_workers ({self.autoscale_min_workers}) exceeds "
                f"autoscale_max_workers ({self.autoscale_max_workers})"
            )
        return self
