"""The one place where the gateway reads its environment."""

from __future__ import annotations

import secrets
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def _random_gateway_id() -> str:
    return f"gateway-{secrets.token_hex(4)}"


class GatewaySettings(BaseSettings):
    """Gateway knobs, from ``SHARDLINE_<FIELD>`` environment variables; `main` flags override them."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_", env_ignore_empty=True)

    # Interface, OpenAI-compatible HTTP port and Generation gRPC port; port 0 picks a free one.
    host: str = "0.0.0.0"
    http_port: int = Field(8000, ge=0, le=65535)
    grpc_port: int = Field(50051, ge=0, le=65535)
    # Where the tokenizer and scheduler services listen.
    tokenizer_address: str = "localhost:50052"
    scheduler_address: str = "localhost:50053"
    # This gateway's Subscribe identity; unique per process so two gateways never steal each other's output.
    gateway_id: str = Field(default_factory=_random_gateway_id)
    # Accepted API keys (comma-separated in SHARDLINE_API_KEYS); empty turns authentication off.
    api_keys: Annotated[list[str], NoDecode] = []
    # Longest prompt accepted, in tokens; None means the model's context length minus one.
    max_prompt_tokens: int | None = Field(None, ge=1)
    # Largest max_tokens a request may ask for; None means the model's context length.
    max_tokens_limit: int | None = Field(None, ge=1)
    # max_tokens when a chat or gRPC request leaves it unset; None (the default) fills the rest of the
    # model's context, as OpenAI and vLLM do. /v1/completions uses OpenAI's 16.
    default_max_tokens: int | None = Field(None, ge=1)
    # Wall-clock budget of a request from arrival; the scheduler aborts it at the deadline.
    request_timeout_s: float = Field(600.0, gt=0)
    # How long a gRPC stream's request outlives its client's disconnect, for the client to Resume it
    # (over HTTP a disconnect cancels at once: OpenAI clients cannot resume). 0 cancels at once.
    resume_grace_s: float = Field(5.0, ge=0)
    # Requests (each choice counts) being validated, tokenized and submitted at once; past it the
    # gateway answers 429 / RESOURCE_EXHAUSTED at once, before any work. At least 64, a request's most choices.
    max_admitting: int = Field(128, ge=64)
    # Tokenize, chat template and constraint calls in flight to the tokenizer; the rest wait their turn.
    max_tokenizer_calls: int = Field(32, ge=1)
    # Detokenize the streams in-process, with the tokenizer's definition fetched once from the
    # tokenizer service; off: one Detokenize call to the service per engine step.
    local_detokenize: bool = True
    # After the scheduler answers that its queue is full, new requests get 429 at once for this long.
    queue_full_hold_s: float = Field(0.5, ge=0)
    # Largest HTTP request body; beyond it the gateway answers 413.
    max_body_bytes: int = Field(4 << 20, ge=1024)
    # How tool_choice "auto" output is read for calls: "hermes" (<tool_call> tags), "llama3_json" (Llama
    # 3.1+ JSON calls), or "none" to refuse "auto"; empty (the default) follows the chat template, as the
    # tokenizer service reports it.
    tool_call_parser: Literal["", "none", "hermes", "llama3_json"] = ""
    # Redis for the Batch API (/v1/files, /v1/batches: batch records, Celery's broker) and the tenants' limits;
    # empty turns the Batch API off (503) and leaves tenants' limits unenforced (logged at start).
    redis_url: str = ""
    # Folder of uploaded files and batch results; the batch workers mount the same one.
    files_dir: str = "shardline-files"
    # Lines per chunk of a batch, the unit a batch worker takes (and takes again after a crash).
    batch_chunk_lines: int = Field(256, ge=1)
    # Seconds a batch has to finish, in place of its completion_window's 24 h; unset keeps the window.
    batch_window_s: float | None = Field(None, gt=0)
    # Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (and their gRPC rpcs), which make every
    # worker read an adapter folder on its machine (docs/lora.md); off: they answer 404, as vLLM's are
    # absent without VLLM_ALLOW_RUNTIME_LORA_UPDATING.
    allow_runtime_lora_updating: bool = False
    # Export spans over OTLP (SHARDLINE_TRACING=0 turns it off); trace context is propagated either way.
    tracing: bool = True
    # YAML file of tenants (gateway/tenancy/tenants.py): each API key's tenant, weight and priority class, keys stored
    # as sha256 digests, re-read when it changes. Empty: one default tenant, and SHARDLINE_API_KEYS alone.
    tenants_file: str = ""
    # Or a Redis key on SHARDLINE_REDIS_URL holding the same YAML (gateway/tenancy/tenants_redis.py), shared by every
    # gateway and polled for changes; not both.
    tenants_redis_key: str = ""
    # Lease of a tenant's concurrency slot in Redis: the gateway running the request renews it, so the
    # slots of a gateway that died free themselves this long after it.
    rate_limit_lease_s: float = Field(30.0, gt=0)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return [key.strip() for key in value.split(",") if key.strip()]
        return value

    @model_validator(mode="after")
    def _one_tenants_source(self) -> GatewaySettings:
        if self.tenants_file and self.tenants_redis_key:
            raise ValueError("tenants_file and tenants_redis_key: give one source of tenants, not both")
        if self.tenants_redis_key and not self.redis_url:
            raise ValueError("tenants_redis_key needs redis_url, the Redis that holds the key")
        return self
