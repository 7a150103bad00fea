"""Per-step spans and metrics of the engine loop.

Work here is per step and per request event (admitted, first token,
finished), never per token: an `engine_step` span per step, and for each
request a `prefill` span (first scheduled step → first token) and a `decode`
span (first token → finish), children of the request's own trace.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context

from gpu_worker_svc.engine.outputs import StepResult, StepStats
from gpu_worker_svc.server.utilization import StepCostModel
from tracing import attributes as attr
from tracing import metrics
from tracing.grpc_context import extract_context


@dataclass(slots=True)
class _RequestSpans:
    context: Context  # the request's trace, from NewRequest.traceparent
    attributes: dict[str, str | int | float]  # set on both spans
    prefill: trace.Span | None = None  # open from admission to the first token
    decode: trace.Span | None = None  # open from the first token to the finish


class StepTelemetry:
    """Records what each engine step did; call it from the engine thread only."""

    def __init__(self, tracer: trace.Tracer, cost: StepCostModel, model_name: str, enabled: bool = True) -> None:
        self._tracer = tracer
        self._cost = cost
        self._model = model_name
        self._enabled = enabled
        self._requests: dict[str, _RequestSpans] = {}

    def request_added(
        self,
        request_id: str,
        traceparent: str,
        prompt_tokens: int,
        max_tokens: int,
        temperature: float,
        adapter: str | None = None,
    ) -> None:
        """A request in the engine; `adapter`: the LoRA adapter it runs with, None for the base model."""
        if self._enabled:
            attributes: dict[str, str | int | float] = {
                attr.REQUEST_ID: request_id,
                attr.GEN_AI_REQUEST_MODEL: self._model,
                attr.GEN_AI_USAGE_INPUT_TOKENS: prompt_tokens,
                attr.GEN_AI_REQUEST_MAX_TOKENS: max_tokens,
                attr.GEN_AI_REQUEST_TEMPERATURE: temperature,
            }
            if adapter is not None:
                attributes[attr.LORA_ADAPTER] = adapter
            self._requests[request_id] = _RequestSpans(extract_context({"traceparent": traceparent}), attributes)

    def request_dropped(self, request_id: str, end_ns: int) -> None:
        """A request aborted without a final output (its session ended)."""
        spans = self._requests.pop(request_id, None)
        if spans is not None:
            _end(spans, "abort", None, end_ns)

    def occupancy(self, running: int, kv_blocks_used: int, kv_blocks_total: int) -> None:
        """After every change: a step, or requests dropped with their session."""
        metrics.RUNNING_REQUESTS.set(running)
        metrics.KV_CACHE_USAGE.set(kv_blocks_used / max(1, kv_blocks_total))
        metrics.KV_BLOCKS_USED.set(kv_blocks_used)

    def step(self, step: int, out: StepResult, start_ns: int, end_ns: int) -> None:
        stats = out.stats
        if stats is not None:  # None: nothing ran (only aborts were reported)
            generated = sum(len(o.new_token_ids) for o in out.outputs)
            tokens_per_s = generated / stats.step_time_s if stats.step_time_s > 0 else 0.0
            mfu, mbu = self._cost.utilization(
                stats.num_tokens, stats.batch_size, stats.attention_pairs, stats.kv_tokens_read, stats.step_time_s
            )
            metrics.TOKENS_PER_SECOND.set(tokens_per_s)
            metrics.STEP_DURATION.observe(stats.step_time_s)
            metrics.MODEL_FLOPS_UTILIZATION.set(mfu)
            metrics.MODEL_BANDWIDTH_UTILIZATION.set(mbu)
            if stats.num_draft_tokens:
                metrics.SPEC_DRAFT_TOKENS.inc(stats.num_draft_tokens)
                metrics.SPEC_ACCEPTED_TOKENS.inc(stats.num_accepted_tokens)
            if self._enabled:
                self._step_span(step, stats, generated, tokens_per_s, (mfu, mbu), start_ns, end_ns)
        if self._enabled:
            self._request_events(out, start_ns, end_ns)

    def _step_span(
        self,
        step: int,
        stats: StepStats,
        generated: int,
        tokens_per_s: float,
        utilization: tuple[float, float],
        start_ns: int,
        end_ns: int,
    ) -> None:
        mfu, mbu = utilization
        span = self._tracer.start_span(
            "engine_step",
            start_time=start_ns,
            attributes={
                attr.STEP: step,
                attr.BATCH_SIZE: stats.batch_size,
                attr.NUM_TOKENS: stats.num_tokens,
                attr.PREFIX_CACHE_HITS: stats.prefix_cache_hit_tokens,
                attr.KV_BLOCKS_USED: stats.kv_blocks_used,
                attr.TOKENS_PER_S: tokens_per_s,
                attr.GEN_AI_USAGE_OUTPUT_TOKENS: generated,  # the tokens the step generated
                attr.MFU: mfu,
                attr.MBU: mbu,
                attr.DRAFT_TOKENS: stats.num_draft_tokens,
                attr.ACCEPTED_TOKENS: stats.num_accepted_tokens,
            },
        )
        span.end(end_time=end_ns)

    def _request_events(self, out: StepResult, start_ns: int, end_ns: int) -> None:
        for request_id in out.admitted_ids:
            spans = self._requests.get(request_id)
            if spans is not None and spans.prefill is None and spans.decode is None:  # not on a readmission
                spans.prefill = self._tracer.start_span(
                    "prefill", context=spans.context, start_time=start_ns, attributes=spans.attributes
                )
        for o in out.outputs:
            spans = self._requests.get(o.request_id)
            if spans is None:
                continue
            if o.finish_reason is not None:  # first: a request may finish on its first token
                del self._requests[o.request_id]
                _end(spans, o.finish_reason, o.offset + len(o.new_token_ids), end_ns)
            elif o.new_token_ids and spans.prefill is not None:
                spans.prefill.end(end_time=end_ns)
                spans.prefill = None
                spans.decode = self._tracer.start_span(
                    "decode", context=spans.context, start_time=end_ns, attributes=spans.attributes
                )


def _end(spans: _RequestSpans, finish_reason: str, output_tokens: int | None, end_ns: int) -> None:
    for span in (spans.prefill, spans.decode):
        if span is None:
            continue
        span.set_attribute(attr.GEN_AI_RESPONSE_FINISH_REASONS, [finish_reason])
        if output_tokens is not None:
            span.set_attribute(attr.GEN_AI_USAGE_OUTPUT_TOKENS, output_tokens)
        span.end(end_time=end_ns)
