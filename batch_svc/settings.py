"""The one place where the batch service reads its environment."""

from __future__ import annotations

import socket

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shardline.core.batch.celery_wiring import DEFAULT_VISIBILITY_TIMEOUT_S


class BatchSettings(BaseSettings):
    """Batch worker knobs, from ``SHARDLINE_<FIELD>`` environment variables; `main` flags override them."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_", env_ignore_empty=True)

    # Celery's broker and result backend, and where batches and their results are kept.
    redis_url: str = "redis://127.0.0.1:6379/0"
    # The gateway's OpenAI HTTP API, which every line goes through as an online request would...
    gateway_url: str = "http://localhost:8000"
    # ...and its gRPC API, to cancel a cancelled batch's requests in flight.
    gateway_grpc_address: str = "localhost:50051"
    # The API key the batch workers call the gateway with, when it takes keys.
    batch_api_key: str = ""
    # The file store's folder, the gateway's own (a shared volume in a deployment).
    files_dir: str = "shardline-files"
    # Chunks one worker process runs at once.
    batch_concurrency: int = Field(2, ge=1)
    # Requests in flight per chunk at most; the limit adapts below it (AIMD on 429s and 503s).
    batch_max_in_flight: int = Field(16, ge=1)
    # Priority class of batch requests: above (served after) interactive traffic's 0.
    batch_priority: int = Field(100, ge=1)
    # Seconds a delivered chunk may stay unacknowledged before Redis hands it to another worker: it
    # must exceed a chunk's run, or chunks run twice (harmlessly: done lines are skipped).
    batch_visibility_timeout_s: float = Field(DEFAULT_VISIBILITY_TIMEOUT_S, gt=0)
    # /health and /metrics; 0 picks a free port.
    batch_health_port: int = Field(8090, ge=0, le=65535)
    # Export spans over OTLP (SHARDLINE_TRACING=0 turns it off), naming this process so in traces.
    tracing: bool = True
    instance_id: str = Field(default_factory=lambda: f"batch-{socket.gethostname()}")
