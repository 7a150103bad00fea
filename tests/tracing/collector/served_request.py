"""Spans named as the running services emit them (gateway.request, queue, prefill, ...), and OTLP exports of them."""

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, Status

from tests.tracing.collector.fake_request import SpanFactory
from tracing import attributes as attr
from tracing.collector.stored_span import AttrValue, StoredSpan

MODEL = "SmolLM2-135M-Instruct"


def served_request(
    f: SpanFactory,
    request_id: str,
    trace_id: str,
    at_ms: float = 0,
    output_tokens: int = 8,
    finish: str = "stop",
    **gateway_attributes: AttrValue,
) -> list[StoredSpan]:
    """One finished request, offsets in ms from ``at_ms``; ``gateway_attributes`` go on its
    gateway.request span (its tenant, its SLO).

    Stage ends: tokenize 3, queue 10, first token (prefill end) 20, last token
    (decode end) 90, response end 100. The gateway sees the first tokens at 22
    and the last at 92.
    """
    rid = {attr.REQUEST_ID: request_id}

    def span(name: str, service: str, instance: str, start: float, end: float, **attributes: object) -> StoredSpan:
        rank = 0 if service == "gpu_worker" else None
        return f.span(name, service, instance, at_ms + start, at_ms + end, rank=rank, trace_id=trace_id, **attributes)

    return [
        span(
            "gateway.request",
            "gateway",
            "gateway-0",
            0,
            100,
            **rid,
            **{
                attr.GEN_AI_REQUEST_MODEL: MODEL,
                attr.GEN_AI_USAGE_INPUT_TOKENS: 12,
                attr.GEN_AI_USAGE_OUTPUT_TOKENS: output_tokens,
                attr.GEN_AI_RESPONSE_FINISH_REASONS: [finish],
                **gateway_attributes,
            },
        ),
        span("tokenize", "gateway", "gateway-0", 1, 3, **rid, **{attr.NUM_TOKENS: 12}),
        span("shardline.v1.Tokenizer/Tokenize", "tokenizer", "tokenizer-0", 1.5, 2.5),
        span("shardline.v1.Scheduler/Submit", "scheduler", "scheduler", 3.5, 4.5),
        span("queue", "scheduler", "scheduler", 4, 10, **rid, **{attr.QUEUE_DEPTH: 2, attr.RUNNING_REQUESTS: 3}),
        span("dispatch", "scheduler", "scheduler", 10, 11, **rid, **{attr.RUNNING_REQUESTS: 4}),
        span(
            "prefill",
            "gpu_worker",
            "worker-0",
            12,
            20,
            **rid,
            **{attr.GEN_AI_REQUEST_MODEL: MODEL, attr.GEN_AI_USAGE_INPUT_TOKENS: 12},
        ),
        span("decode", "gpu_worker", "worker-0", 20, 90, **rid),
        span("detokenize", "gateway", "gateway-0", 22, 92, **rid),
    ]


def engine_steps(f: SpanFactory, start_ms: float, end_ms: float, step_ms: float = 10) -> list[StoredSpan]:
    """Back-to-back ``engine_step`` root spans (each its own trace, no request id) with counters."""
    spans = []
    step = 0
    while start_ms + (step + 1) * step_ms <= end_ms:
        begin = start_ms + step * step_ms
        spans.append(
            f.span(
                "engine_step",
                "gpu_worker",
                "worker-0",
                begin,
                begin + step_ms,
                rank=0,
                trace_id=f"{0xE000 + step:032x}",
                **{
                    attr.STEP: step,
                    attr.BATCH_SIZE: 2,
                    attr.KV_BLOCKS_USED: 10 + step,
                    attr.TOKENS_PER_S: 200.0,
                    attr.MFU: 0.01,
                    attr.MBU: 0.2,
                },
            )
        )
        step += 1
    return spans


def _any(value: AttrValue) -> AnyValue:
    match value:
        case bool():
            return AnyValue(bool_value=value)
        case int():
            return AnyValue(int_value=value)
        case float():
            return AnyValue(double_value=value)
        case list():
            out = AnyValue()
            out.array_value.values.extend(_any(item) for item in value)
            return out
        case _:
            return AnyValue(string_value=str(value))


def to_otlp(spans: list[StoredSpan]) -> list[ResourceSpans]:
    """The spans as OTLP exports, one ResourceSpans per emitting resource."""
    batches: dict[tuple, ResourceSpans] = {}
    for stored in spans:
        key = tuple(sorted(stored.resource.items()))
        batch = batches.get(key)
        if batch is None:
            batch = batches[key] = ResourceSpans()
            batch.resource.attributes.extend(KeyValue(key=k, value=_any(v)) for k, v in stored.resource.items())
            batch.scope_spans.add().scope.name = "shardline.test"
        span = batch.scope_spans[0].spans.add(
            trace_id=bytes.fromhex(stored.trace_id),
            span_id=bytes.fromhex(stored.span_id),
            parent_span_id=bytes.fromhex(stored.parent_span_id),
            name=stored.name,
            start_time_unix_nano=stored.start_ns,
            end_time_unix_nano=stored.end_ns,
        )
        span.attributes.extend(KeyValue(key=k, value=_any(v)) for k, v in stored.attributes.items())
        if stored.error:
            span.status.code = Status.STATUS_CODE_ERROR
            span.status.message = stored.error
    return list(batches.values())
