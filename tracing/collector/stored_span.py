"""A finished span as the collector hands it around: OTLP fields, flattened to Python."""

from collections.abc import Iterable
from dataclasses import dataclass, field

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from tracing import attributes as attr

AttrValue = str | bool | int | float | bytes | list["AttrValue"] | dict[str, "AttrValue"] | None


def any_value(value: AnyValue) -> AttrValue:
    """The Python value an OTLP AnyValue holds."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return attribute_dict(value.kvlist_value.values)
    return getattr(value, kind) if kind else None


def attribute_dict(pairs: Iterable[KeyValue]) -> dict[str, AttrValue]:
    """OTLP key/value pairs as a dict."""
    return {pair.key: any_value(pair.value) for pair in pairs}


@dataclass(slots=True)
class StoredSpan:
    """One finished span with the resource of the process that emitted it."""

    # 32 lowercase hex digits.
    trace_id: str
    # 16 lowercase hex digits.
    span_id: str
    # The parent's span id, or "" for a root span.
    parent_span_id: str
    name: str
    # Wall-clock unix nanoseconds, comparable across processes.
    start_ns: int
    end_ns: int
    # The span's attributes, e.g. shardline.request_id, gen_ai.usage.output_tokens.
    attributes: dict[str, AttrValue] = field(default_factory=dict)
    # The emitter's resource: service.name, service.instance.id, shardline.rank.
    resource: dict[str, AttrValue] = field(default_factory=dict)
    # The status message of a failed span, "" for one that did not fail.
    error: str = ""

    @property
    def service_name(self) -> str:
        """The emitting service, e.g. ``gpu_worker``."""
        return str(self.resource.get(attr.SERVICE_NAME) or "unknown")

    @property
    def instance_id(self) -> str:
        """The emitting service instance, e.g. ``worker-0``; the service name when unset."""
        return str(self.resource.get(attr.SERVICE_INSTANCE_ID) or self.service_name)

    @property
    def request_id(self) -> str | None:
        """The Shardline request the span belongs to, if any."""
        value = self.attributes.get(attr.REQUEST_ID)
        return None if value is None or value == "" else str(value)

    @property
    def rank(self) -> int | None:
        """The tensor-parallel rank, from the span or else from its resource."""
        value = self.attributes.get(attr.RANK, self.resource.get(attr.RANK))
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @classmethod
    def from_otlp(cls, span: Span, resource: Resource) -> "StoredSpan":
        """Flattens an OTLP span and its resource."""
        failed = span.status.code == Status.STATUS_CODE_ERROR
        return cls(
            trace_id=span.trace_id.hex(),
            span_id=span.span_id.hex(),
            parent_span_id=span.parent_span_id.hex(),
            name=span.name,
            start_ns=span.start_time_unix_nano,
            end_ns=max(span.end_time_unix_nano, span.start_time_unix_nano),
            attributes=attribute_dict(span.attributes),
            resource=attribute_dict(resource.attributes),
            error=(span.status.message or "error") if failed else "",
        )
