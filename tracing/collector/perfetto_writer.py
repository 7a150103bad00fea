"""Native Perfetto traces (.pftrace) from stored spans.

The trace is one trusted packet sequence: a first packet that clears the
incremental state, sets REALTIME as the default clock (span times are unix
nanoseconds) and snapshots the clocks so Perfetto can use them; then every
track descriptor; then slice, flow and counter events in timestamp order,
with event names, categories and annotation names interned on first use.
"""

import heapq
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from tracing.collector.perfetto_layout import CounterSample, SlicePlacement, TraceLayout, build_layout
from tracing.collector.stored_span import AttrValue, StoredSpan

# One writer, one sequence; the id only needs to be non-zero and unique in the file.
SEQUENCE_ID = 1
_INT64_MAX = (1 << 63) - 1
_BEGIN, _END, _COUNTER = 0, 1, 2


@dataclass(slots=True)
class TraceStats:
    """What a written trace contains."""

    processes: int
    threads: int
    request_tracks: int
    counter_tracks: int
    slices: int
    flows: int
    counter_samples: int
    bytes: int


class _Sequence:
    """Appends packets to one trusted sequence and interns strings on it."""

    def __init__(self, trace: pb.Trace) -> None:
        self._trace = trace
        # Interned-data field name -> string -> iid; iids start at 1 per field.
        self._interned: dict[str, dict[str, int]] = {}

    def packet(self, ts_ns: int | None = None, needs_state: bool = False) -> pb.TracePacket:
        packet = self._trace.packet.add()
        packet.trusted_packet_sequence_id = SEQUENCE_ID
        if ts_ns is not None:
            packet.timestamp = ts_ns
        if needs_state:
            packet.sequence_flags = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
        return packet

    def intern(self, packet: pb.TracePacket, kind: str, value: str) -> int:
        """The iid of ``value``; the first use also defines it in ``packet``."""
        table = self._interned.setdefault(kind, {})
        iid = table.get(value)
        if iid is None:
            iid = table[value] = len(table) + 1
            getattr(packet.interned_data, kind).add(iid=iid, name=value)
        return iid


def _set_value(annotation: pb.DebugAnnotation, value: AttrValue) -> None:
    match value:
        case bool():
            annotation.bool_value = value
        case int() if -_INT64_MAX - 1 <= value <= _INT64_MAX:
            annotation.int_value = value
        case float():
            annotation.double_value = value
        case bytes():
            annotation.string_value = value.hex()
        case list():
            for item in value:
                _set_value(annotation.array_values.add(), item)
        case dict():
            for key, item in value.items():
                entry = annotation.dict_entries.add()
                entry.name = key
                _set_value(entry, item)
        case _:
            annotation.string_value = "" if value is None else str(value)


def _begin(seq: _Sequence, placement: SlicePlacement) -> None:
    span = placement.span
    packet = seq.packet(span.start_ns, needs_state=True)
    event = packet.track_event
    event.type = pb.TrackEvent.TYPE_SLICE_BEGIN
    event.track_uuid = placement.track_uuid
    event.name_iid = seq.intern(packet, "event_names", span.name)
    event.category_iids.append(seq.intern(packet, "event_categories", span.service_name))
    if placement.flow_id is not None:
        flows = event.terminating_flow_ids if placement.terminates_flow else event.flow_ids
        flows.append(placement.flow_id)
    values: dict[str, AttrValue] = {
        "service.name": span.service_name,
        "service.instance.id": span.instance_id,
        "trace_id": span.trace_id,
        "span_id": span.span_id,
    }
    if span.error:
        values["error"] = span.error
    values.update(span.attributes)
    for name, value in values.items():
        annotation = event.debug_annotations.add()
        annotation.name_iid = seq.intern(packet, "debug_annotation_names", name)
        _set_value(annotation, value)


def _end(seq: _Sequence, placement: SlicePlacement) -> None:
    packet = seq.packet(placement.span.end_ns, needs_state=True)
    packet.track_event.type = pb.TrackEvent.TYPE_SLICE_END
    packet.track_event.track_uuid = placement.track_uuid


def _counter(seq: _Sequence, sample: CounterSample) -> None:
    packet = seq.packet(sample.ts_ns, needs_state=True)
    event = packet.track_event
    event.type = pb.TrackEvent.TYPE_COUNTER
    event.track_uuid = sample.track_uuid
    if isinstance(sample.value, int):
        event.counter_value = sample.value
    else:
        event.double_counter_value = sample.value


def _lane_events(lane: list[SlicePlacement]) -> Iterator[tuple[int, int, SlicePlacement]]:
    """Begin/end events of one lane in an order that nests, timestamps non-decreasing."""
    open_slices: list[SlicePlacement] = []
    for placement in lane:
        while open_slices and open_slices[-1].span.end_ns <= placement.span.start_ns:
            done = open_slices.pop()
            yield done.span.end_ns, _END, done
        yield placement.span.start_ns, _BEGIN, placement
        open_slices.append(placement)
    while open_slices:
        done = open_slices.pop()
        yield done.span.end_ns, _END, done


def _describe_tracks(seq: _Sequence, layout: TraceLayout) -> None:
    for track in layout.tracks:
        descriptor = seq.packet().track_descriptor
        descriptor.uuid = track.uuid
        if track.parent_uuid is not None:
            descriptor.parent_uuid = track.parent_uuid
        if track.tid is not None:
            descriptor.thread.pid = track.pid
            descriptor.thread.tid = track.tid
            descriptor.thread.thread_name = track.name
        elif track.pid is not None:
            descriptor.process.pid = track.pid
            descriptor.process.process_name = track.name
        else:
            descriptor.name = track.name
        if track.counter_unit is not None:
            descriptor.counter.unit_name = track.counter_unit


def encode_pftrace(spans: list[StoredSpan]) -> tuple[bytes, TraceStats]:
    """The spans as a serialized Perfetto ``Trace``, and what it holds."""
    layout = build_layout(spans)
    trace = pb.Trace()
    seq = _Sequence(trace)
    first = seq.packet()
    first.sequence_flags = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
    first.trace_packet_defaults.timestamp_clock_id = pb.BUILTIN_CLOCK_REALTIME
    # Without a snapshot relating REALTIME to the trace clock, Perfetto drops
    # every event as a clock-sync failure; equal readings make them the same clock.
    t0 = min((span.start_ns for span in spans), default=0)
    first.clock_snapshot.clocks.add(clock_id=pb.BUILTIN_CLOCK_BOOTTIME, timestamp=t0)
    first.clock_snapshot.clocks.add(clock_id=pb.BUILTIN_CLOCK_REALTIME, timestamp=t0)
    first.clock_snapshot.primary_trace_clock = pb.BUILTIN_CLOCK_REALTIME
    _describe_tracks(seq, layout)

    counters = ((sample.ts_ns, _COUNTER, sample) for sample in layout.counters)
    streams = [_lane_events(lane) for lane in layout.lanes] + [counters]
    for _ts, kind, item in heapq.merge(*streams, key=lambda event: event[0]):
        if kind == _BEGIN:
            _begin(seq, item)
        elif kind == _END:
            _end(seq, item)
        else:
            _counter(seq, item)

    data = trace.SerializeToString()
    stats = TraceStats(
        processes=layout.processes,
        threads=layout.threads,
        request_tracks=layout.request_tracks,
        counter_tracks=layout.counter_tracks,
        slices=sum(len(lane) for lane in layout.lanes),
        flows=layout.flows,
        counter_samples=len(layout.counters),
        bytes=len(data),
    )
    return data, stats


def write_pftrace(spans: list[StoredSpan], path: str | Path) -> TraceStats:
    """Writes the spans to ``path`` as a native Perfetto trace; open it in ui.perfetto.dev."""
    data, stats = encode_pftrace(spans)
    Path(path).write_bytes(data)
    return stats
