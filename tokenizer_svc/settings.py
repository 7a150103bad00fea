"""The one place where the tokenizer service reads its environment."""

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class TokenizerSettings(BaseSettings):
    """Tokenizer service knobs, from ``SHARDLINE_<FIELD>`` variables; `main` flags override them."""

    model_config = SettingsConfigDict(env_prefix="SHARDLINE_", env_ignore_empty=True)

    # Interface the gRPC server binds.
    host: str = "0.0.0.0"
    # gRPC port of the Tokenizer service; 0 picks a free one.
    port: int = Field(50052, ge=0, le=65535)
    # A Hugging Face folder or a .gguf file; None serves the default model (SmolLM2-135M-Instruct).
    model: str | None = None
    # The chat template to use instead of the model's own: a Jinja file, or the template itself
    # (vLLM's --chat-template). None keeps the model's.
    chat_template: str | None = None
    # Export spans over OTLP (SHARDLINE_TRACING=0 turns it off).
    tracing: bool = True
    # Names this process in traces; None: tokenizer-<hostname>:<port>.
    instance_id: str | None = None
