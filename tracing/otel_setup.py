"""One call that gives a Shardline service its OpenTelemetry tracer."""

import collections
import logging
import threading
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from tracing import attributes as attr
from tracing.metrics import SPANS_DROPPED
from tracing.settings import TracingSettings

logger = logging.getLogger(__name__)


class CountingBatchSpanProcessor(BatchSpanProcessor):
    """A BatchSpanProcessor whose bounded queue counts the spans it drops.

    When its queue is full the SDK evicts the oldest span, counts it nowhere
    and logs one warning per span, which floods the log exactly when the
    process is overloaded. This processor refuses the new span instead, and
    counts it in ``dropped_spans`` and in the ``shardline_tracing_spans_dropped``
    metric.
    """

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        max_queue_size: int,
        max_export_batch_size: int,
        schedule_delay_millis: float,
    ) -> None:
        super().__init__(
            exporter,
            max_queue_size=max_queue_size,
            max_export_batch_size=min(max_export_batch_size, max_queue_size),
            schedule_delay_millis=schedule_delay_millis,
        )
        self._span_queue = _sdk_queue(self)
        # Producers are serialised so the "is there room" check and the append
        # are one step; the export thread only pops, so it cannot break that.
        self._emit_lock = threading.Lock()
        self._dropped = 0

    @property
    def dropped_spans(self) -> int:
        """Spans refused because the export queue was full, since startup."""
        return self._dropped

    def on_end(self, span: ReadableSpan) -> None:
        if not (span.context and span.context.trace_flags.sampled):
            return
        with self._emit_lock:
            if len(self._span_queue) >= self._span_queue.maxlen:
                self._dropped += 1
                SPANS_DROPPED.inc()
                return
            super().on_end(span)


def _sdk_queue(processor: BatchSpanProcessor) -> collections.deque:
    """The SDK's span queue; its internals are not API, so check them loudly."""
    queue = getattr(getattr(processor, "_batch_processor", None), "_queue", None)
    if not isinstance(queue, collections.deque) or queue.maxlen is None:
        raise RuntimeError(
            "this opentelemetry-sdk keeps BatchSpanProcessor's queue elsewhere; "
            "CountingBatchSpanProcessor needs updating for it"
        )
    return queue


@dataclass(slots=True)
class TracingHandle:
    """What ``setup_tracing`` returns: the tracer to use, and its lifecycle."""

    # Tracer for this service; a no-op tracer when tracing is disabled.
    tracer: trace.Tracer
    # The SDK provider, or None when tracing is disabled.
    provider: TracerProvider | None = None
    # The exporting processor, or None when tracing is disabled.
    processor: CountingBatchSpanProcessor | None = None

    @property
    def enabled(self) -> bool:
        """Whether spans are recorded and exported."""
        return self.provider is not None

    @property
    def dropped_spans(self) -> int:
        """Spans dropped because the export queue was full."""
        return self.processor.dropped_spans if self.processor else 0

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Exports every queued span; blocks, so call it off the event loop."""
        return self.provider.force_flush(int(timeout_s * 1000)) if self.provider else True

    def shutdown(self) -> None:
        """Exports every queued span, then stops; blocks like ``force_flush``."""
        if self.provider:
            self.provider.shutdown()


def setup_tracing(
    service_name: str,
    instance_id: str,
    rank: int | None = None,
    endpoint: str | None = None,
    enabled: bool = True,
    *,
    settings: TracingSettings | None = None,
    install_global: bool = True,
) -> TracingHandle:
    """Sets up tracing for one service process.

    Spans carry the resource attributes ``service.name``, ``service.instance.id``
    (for example ``worker-0``) and, for a tensor-parallel rank, ``shardline.rank``.
    They are exported over OTLP/gRPC to ``endpoint`` (default:
    ``SHARDLINE_OTLP_ENDPOINT``) through a bounded queue whose drops are counted.

    With ``install_global`` the provider also becomes OpenTelemetry's global
    one, so ``trace.get_tracer()`` anywhere in the process uses it; the SDK
    allows that once per process, so tests that build several services in
    one process pass False and use ``handle.tracer``.
    """
    if not enabled:
        return TracingHandle(tracer=trace.NoOpTracer())
    settings = settings or TracingSettings()
    endpoint = endpoint or settings.otlp_endpoint
    resource_attrs: dict[str, str | int] = {attr.SERVICE_NAME: service_name, attr.SERVICE_INSTANCE_ID: instance_id}
    if rank is not None:
        resource_attrs[attr.RANK] = rank
    provider = TracerProvider(resource=Resource.create(resource_attrs))
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
    processor = CountingBatchSpanProcessor(
        exporter,
        max_queue_size=settings.otlp_max_queue_size,
        max_export_batch_size=settings.otlp_max_export_batch_size,
        schedule_delay_millis=settings.otlp_schedule_delay_ms,
    )
    provider.add_span_processor(processor)
    if install_global:
        trace.set_tracer_provider(provider)
    logger.info("tracing %s/%s (rank %s) to %s", service_name, instance_id, rank, endpoint)
    return TracingHandle(
        tracer=provider.get_tracer("shardline." + service_name), provider=provider, processor=processor
    )
