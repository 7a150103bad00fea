"""The one place where tracing reads its environment."""

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class TracingSettings(BaseSettings):
    """Tracing knobs, from ``SHARDLINE_*`` environment variables.

    Every field can be overridden with the variable named
    ``SHARDLINE_<FIELD>``, for example ``SHARDLINE_OTLP_ENDPOINT``.
    """

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_", env_ignore_empty=True)

    # The tracing service: interface it listens on, OTLP/gRPC port, dashboard HTTP port...
    host: str = "0.0.0.0"
    otlp_port: int = Field(4317, ge=0, le=65535)
    http_port: int = Field(8080, ge=0, le=65535)
    # ...and the Redis it stores spans in (the request-state Redis will do; keys are apart).
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Where services send spans: host:port (or http(s)://host:port) of an OTLP/gRPC collector.
    otlp_endpoint: str = "localhost:4317"
    # Spans that may wait for export; beyond this they are dropped and counted.
    otlp_max_queue_size: int = 4096
    # Spans per OTLP Export call.
    otlp_max_export_batch_size: int = 512
    # How long a partial batch may wait before it is exported anyway.
    otlp_schedule_delay_ms: int = 500
    # Retention of the span store: at most this many spans...
    trace_max_spans: int = 200_000
    # ...and none older than this many seconds.
    trace_max_age_s: float = 3600.0
    # Retention of the collector's time series (tracing/collector/series_store.py): 1-second buckets...
    series_1s_retention_s: int = Field(600, ge=60)
    # ...10-second buckets...
    series_10s_retention_s: int = Field(7200, ge=600)
    # ...and 60-second buckets, the longest window the series API answers.
    series_60s_retention_s: int = Field(86400, ge=3600)
