"""What a front end hands the runner: one generation's prompt and spec, and the same once validated and tokenized."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from google.protobuf.timestamp_pb2 import Timestamp
from opentelemetry import trace

from gateway.tenancy.slo_params import Slo
from gateway.tenancy.tenants import Tenant
from shardline.proto import sampling_pb2, tokenizer_pb2


@dataclass(slots=True)
class Prompt:
    """What to continue: exactly one of text, chat and token_ids is set."""

    text: str | None = None  # raw prompt text, tokenized with the tokenizer's special tokens
    # A conversation and how to render it (tools, template variables), for the chat template.
    chat: tokenizer_pb2.ApplyChatTemplateRequest | None = None
    token_ids: list[int] | None = None  # an already tokenized prompt
    field: str = "prompt"  # the request field it came from, named in errors


def prompt_texts(prompt: Prompt) -> list[str]:
    """The texts a prompt surely puts in the model's input, for its refusal by size: a chat's turns but
    the assistant's, which some templates shorten (Qwen 3 drops the reasoning of past turns)."""
    if prompt.text is not None:
        return [prompt.text]
    if prompt.chat is not None:
        return [turn.content for turn in prompt.chat.messages if turn.role != "assistant"]
    return []


@dataclass(slots=True)
class GenerationSpec:
    """A parsed request, ready to validate, tokenize and submit."""

    request_id: str  # cmpl-..., chatcmpl-... or the client's own
    model: str  # requested model; empty picks the served one
    prompt: Prompt
    params: sampling_pb2.SamplingParameters  # as the client sent them, not yet validated
    default_max_tokens: int | None  # max_tokens when the client gave none; None: the rest of the context
    priority: int = 0  # lower is served first
    timeout_s: float | None = None  # the client's own budget, within the gateway's
    field_prefix: str = ""  # put before parameter names in errors ("params." over gRPC)
    max_tokens_field: str = "max_tokens"  # the name the client gave max_tokens, for errors
    # Where the client gave its constraint, for errors, prefix included ("tools" when its tool_choice set it).
    structured_output_field: str = "structured_output"
    arrival_s: float = field(default_factory=time.perf_counter)  # for TTFT and duration
    arrival_time: Timestamp = field(default_factory=lambda: timestamp_in(0.0))  # sent to the scheduler
    owner: str = ""  # digest of the caller's API key: only that key may read, resume or cancel it
    # Named by the client over HTTP: a resend attaches to it (request_attach.py), and its client
    # leaving does not cancel it, so that the resend finds it running or finished.
    idempotent: bool = False
    slo: Slo = Slo()  # its TTFT target and refuse_late, as the client gave them (its tenant's fill in)


@dataclass(slots=True)
class PreparedRequest:
    """A request validated and tokenized, not yet submitted."""

    spec: GenerationSpec
    span: trace.Span  # the request's span: its attributes, and the Submit rpc's trace context
    info: tokenizer_pb2.TokenizerInfo  # the served model's tokenizer facts
    params: sampling_pb2.SamplingParameters  # resolved, max_tokens included
    prompt_ids: list[int]
    tenant: Tenant  # the tenant it counts against
    slo: Slo  # its effective SLO: its own, else its tenant's
    # The model it runs on as it was named: the served model's name, or a LoRA adapter's on it.
    model: str = ""

    @property
    def served_model(self) -> str:
        """What the scheduler routes it by and the response names: its adapter, else the served model."""
        return self.model or self.info.model


def timestamp_in(after_s: float) -> Timestamp:
    """The wall-clock time `after_s` from now, as the scheduler's messages carry it."""
    stamp = Timestamp()
    stamp.FromNanoseconds(time.time_ns() + int(after_s * 1e9))
    return stamp
