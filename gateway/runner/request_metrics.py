"""What a request's end records: its metrics per model and per tenant, its SLO outcome, and its spans.

Everything here is a few label lookups and increments in this process, O(1) per request end: no
Redis, nothing per token.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace

from gateway.metrics import (
    GENERATION_TOKENS,
    PROMPT_TOKENS,
    REQUESTS,
    TENANT_GENERATION_TOKENS,
    TENANT_PROMPT_TOKENS,
    TENANT_REQUESTS,
    TENANT_SLO_REQUESTS,
    TENANT_TIME_TO_FIRST_TOKEN,
)
from gateway.output.request_stream import StreamTiming
from shardline.core.errors import SLO_UNMET
from shardline.proto import sampling_pb2
from tracing import attributes as attr
from tracing.metrics import MODEL_LABEL, REQUEST_DURATION, TIME_PER_OUTPUT_TOKEN, TIME_TO_FIRST_TOKEN

MET, MISSED, REFUSED = "met", "missed", "refused"


@dataclass(frozen=True, slots=True)
class RequestEnd:
    """One request (one choice) as it ended, or as its consumer left it."""

    request_id: str
    model: str  # the served model, the metrics' gen_ai_request_model
    tenant: str  # the tenant it counted against
    ttft_target_s: float | None  # its effective TTFT target (its own, else its tenant's)
    arrival_s: float  # perf_counter at arrival
    timing: StreamTiming  # when its tokens reached the gateway, and its detokenize calls
    end_s: float  # perf_counter now
    usage: sampling_pb2.Usage
    finish_reason: str  # stop, length, abort or error
    timed_out: bool  # an abort at its deadline: "timeout" in the metrics
    error: str  # the scheduler's error, with finish_reason "error"

    @property
    def metric_reason(self) -> str:
        return "timeout" if self.timed_out else self.finish_reason


def slo_outcome(end: RequestEnd) -> str | None:
    """How a request with a TTFT target fared: refused (failed with SLO_UNMET), met (first token
    within the target) or missed; None without a target, or for one the client left before either
    a first token or the target came, which the service had no chance to meet or miss."""
    target = end.ttft_target_s
    if target is None:
        return None
    if end.finish_reason == "error" and end.error.startswith(SLO_UNMET):
        return REFUSED
    first_token_s = end.timing.first_token_s
    if first_token_s is not None:
        return MET if first_token_s - end.arrival_s <= target else MISSED
    if end.finish_reason == "abort" and not end.timed_out and end.end_s - end.arrival_s <= target:
        return None
    return MISSED  # failed or timed out without a token: the target was not met


def record_end(end: RequestEnd, span: trace.Span, tracer: trace.Tracer) -> None:
    """Count the request in the metrics; put its usage, finish reason and SLO outcome on its span, and
    its detokenize span under it."""
    model, timing = {MODEL_LABEL: end.model}, end.timing
    if timing.first_token_s is not None:
        ttft = timing.first_token_s - end.arrival_s
        TIME_TO_FIRST_TOKEN.labels(**model).observe(ttft)
        TENANT_TIME_TO_FIRST_TOKEN.labels(tenant=end.tenant).observe(ttft)
        span.set_attribute(attr.TTFT_MS, ttft * 1000)
        tokens = end.usage.completion_tokens
        if tokens > 1 and timing.last_token_s is not None:
            tpot = (timing.last_token_s - timing.first_token_s) / (tokens - 1)
            TIME_PER_OUTPUT_TOKEN.labels(**model).observe(tpot)
            span.set_attribute(attr.TPOT_MS, tpot * 1000)
    REQUEST_DURATION.labels(**model).observe(end.end_s - end.arrival_s)
    PROMPT_TOKENS.labels(**model).inc(end.usage.prompt_tokens)
    GENERATION_TOKENS.labels(**model).inc(end.usage.completion_tokens)
    REQUESTS.labels(**model, finish_reason=end.metric_reason).inc()
    TENANT_REQUESTS.labels(tenant=end.tenant, finish_reason=end.metric_reason).inc()
    TENANT_PROMPT_TOKENS.labels(tenant=end.tenant).inc(end.usage.prompt_tokens)
    TENANT_GENERATION_TOKENS.labels(tenant=end.tenant).inc(end.usage.completion_tokens)
    span.set_attribute(attr.GEN_AI_USAGE_INPUT_TOKENS, end.usage.prompt_tokens)
    span.set_attribute(attr.GEN_AI_USAGE_OUTPUT_TOKENS, end.usage.completion_tokens)
    outcome = slo_outcome(end)
    if outcome is not None:
        TENANT_SLO_REQUESTS.labels(tenant=end.tenant, outcome=outcome).inc()
        span.set_attribute(attr.SLO_OUTCOME, outcome)
    span.set_attribute(attr.GEN_AI_RESPONSE_FINISH_REASONS, [end.finish_reason])
    if timing.detokenize_calls:
        # One span per request for all its per-step detokenize calls, which are batched across requests.
        detokenize = tracer.start_span(
            "detokenize",
            context=trace.set_span_in_context(span),
            start_time=timing.detokenize_start_ns,
            attributes={attr.REQUEST_ID: end.request_id, "shardline.detokenize_calls": timing.detokenize_calls},
        )
        detokenize.end(end_time=timing.detokenize_end_ns)
