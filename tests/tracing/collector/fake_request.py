"""Spans as the services will emit them: a request's walk as StoredSpans, and OTLP exports."""

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, Span

from tracing import attributes as attr
from tracing.collector.stored_span import StoredSpan

T0 = 1_764_000_000_000_000_000  # a wall-clock unix-ns origin
MS = 1_000_000
NS_PER_S = 1_000_000_000
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
STEPS = 4
STEP_MS = 10
WORKER_RANKS = (0, 1, 2)


class SpanFactory:
    """Builds StoredSpans with sequential span ids and service resources."""

    def __init__(self) -> None:
        self._next_id = 1

    def span(
        self,
        name: str,
        service: str,
        instance: str,
        start_ms: float,
        end_ms: float,
        rank: int | None = None,
        parent: StoredSpan | None = None,
        trace_id: str = TRACE_ID,
        **attributes: object,
    ) -> StoredSpan:
        span_id = f"{self._next_id:016x}"
        self._next_id += 1
        resource: dict = {attr.SERVICE_NAME: service, attr.SERVICE_INSTANCE_ID: instance}
        if rank is not None:
            resource[attr.RANK] = rank
        return StoredSpan(
            trace_id=trace_id,
            span_id=span_id,
            parent_span_id=parent.span_id if parent else "",
            name=name,
            start_ns=T0 + int(start_ms * MS),
            end_ns=T0 + int(end_ms * MS),
            attributes=dict(attributes),
            resource=resource,
        )


def request_walk(request_id: str = "req-1") -> list[StoredSpan]:
    """One request across gateway, tokenizer, scheduler and a 3-rank worker, plus engine steps.

    Request spans: generate (gateway) > tokenize (tokenizer) > queue (scheduler)
    > prefill, decode (worker-0 rank 0) > detokenize (tokenizer). Engine step
    spans carry no request id, one per rank per step, with counter attributes
    on rank 0 and per-rank MFU/MBU.
    """
    f = SpanFactory()
    rid = {attr.REQUEST_ID: request_id}
    root = f.span(
        "generate",
        "gateway",
        "gateway-0",
        0,
        100,
        **rid,
        **{
            attr.GEN_AI_REQUEST_MODEL: "smollm2-135m",
            attr.GEN_AI_REQUEST_MAX_TOKENS: 4,
            attr.GEN_AI_REQUEST_TEMPERATURE: 0.7,
            attr.GEN_AI_REQUEST_TOP_P: 0.9,
            attr.GEN_AI_USAGE_INPUT_TOKENS: 12,
            attr.GEN_AI_USAGE_OUTPUT_TOKENS: 4,
            attr.GEN_AI_RESPONSE_FINISH_REASONS: ["length"],
        },
    )
    spans = [
        root,
        f.span("tokenize", "tokenizer", "tokenizer-0", 1, 3, parent=root, **rid, **{attr.NUM_TOKENS: 12}),
        f.span("queue", "scheduler", "scheduler-0", 4, 10, parent=root, **rid, **{attr.QUEUE_DEPTH: 3}),
        f.span(
            "prefill",
            "gpu_worker",
            "worker-0",
            10,
            20,
            rank=0,
            parent=root,
            **rid,
            **{attr.NUM_TOKENS: 12, attr.PREFIX_CACHE_HITS: 0},
        ),
        f.span(
            "decode",
            "gpu_worker",
            "worker-0",
            20,
            20 + STEPS * STEP_MS,
            rank=0,
            parent=root,
            **rid,
            **{attr.GEN_AI_USAGE_OUTPUT_TOKENS: 4},
        ),
        f.span("detokenize", "tokenizer", "tokenizer-0", 91, 93, parent=root, **rid),
        # Two asyncio tasks on the scheduler loop whose spans partly overlap.
        f.span("dispatch", "scheduler", "scheduler-0", 9, 12, **{attr.THREAD_NAME: "loop"}),
        f.span("heartbeat", "scheduler", "scheduler-0", 11, 14, **{attr.THREAD_NAME: "loop"}),
    ]
    for step in range(STEPS):
        # Back to back: one step ends exactly when the next begins.
        start, end = 20 + step * STEP_MS, 20 + (step + 1) * STEP_MS
        for rank in WORKER_RANKS:
            counters: dict = {attr.MFU: 0.3 + 0.01 * rank, attr.MBU: 0.6}
            if rank == 0:
                counters |= {
                    attr.BATCH_SIZE: 1 + step,
                    attr.KV_BLOCKS_USED: 10 + step,
                    attr.TOKENS_PER_S: 100.0 * (step + 1),
                }
            spans.append(
                f.span(
                    "decode_step",
                    "gpu_worker",
                    "worker-0",
                    start,
                    end,
                    rank=rank,
                    trace_id=f"{step + 1:032x}",
                    **{attr.STEP: step},
                    **counters,
                )
            )
            # The forward pass nests in its step and ends with it.
            spans.append(
                f.span("forward", "gpu_worker", "worker-0", start + 1, end, rank=rank, trace_id=f"{step + 1:032x}")
            )
    return spans


def otlp_export(instance: str, spans: list[tuple[int, int, str, float, str | None]]) -> ResourceSpans:
    """One service's export: (trace number, span number, name, start s, request id) per span."""
    batch = ResourceSpans()
    batch.resource.attributes.extend(
        [
            KeyValue(key=attr.SERVICE_NAME, value=AnyValue(string_value=instance.split("-")[0])),
            KeyValue(key=attr.SERVICE_INSTANCE_ID, value=AnyValue(string_value=instance)),
        ]
    )
    scope = batch.scope_spans.add()
    scope.scope.name = "shardline.test"
    for trace_no, span_no, name, start_s, request_id in spans:
        span = Span(
            trace_id=trace_no.to_bytes(16, "big"),
            span_id=span_no.to_bytes(8, "big"),
            name=name,
            start_time_unix_nano=int(start_s * NS_PER_S),
            end_time_unix_nano=int(start_s * NS_PER_S) + NS_PER_S // 2,
        )
        if request_id is not None:
            span.attributes.add(key=attr.REQUEST_ID, value=AnyValue(string_value=request_id))
        span.attributes.add(key=attr.NUM_TOKENS, value=AnyValue(int_value=span_no))
        scope.spans.append(span)
    return batch
