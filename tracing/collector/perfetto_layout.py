"""Where each span goes in a Perfetto trace: tracks, lanes, flows and counters.

Pure Python with no protobuf, so the layout rules can be read (and tested) on
their own; ``perfetto_writer`` turns the result into packets.

- Each service instance is a process (pid derived from its instance id).
- A span without ``shardline.request_id`` goes on a thread track of its
  process, one per (rank, ``thread.name``).
- A span with a request id goes on that request's track, ``request <id>``,
  which therefore spans queue, tokenize, prefill, decode and detokenize.
- A request's spans are linked by one flow, in time order, hopping each time
  the request moves to another service instance.
- Counter attributes on any span become samples on per-process counter tracks.
"""

import zlib
from dataclasses import dataclass, field
from itertools import count

from tracing import attributes as attr
from tracing.collector.stored_span import StoredSpan

# Counter attribute -> (track name, unit name). Unit names are free text in Perfetto.
COUNTERS: dict[str, tuple[str, str]] = {
    attr.QUEUE_DEPTH: ("queue depth", "requests"),
    attr.RUNNING_REQUESTS: ("requests in flight", "requests"),
    attr.BATCH_SIZE: ("batch size", "requests"),
    attr.KV_BLOCKS_USED: ("KV blocks used", "blocks"),
    attr.TOKENS_PER_S: ("tokens/s", "tokens/s"),
    attr.MFU: ("MFU", "fraction"),
    attr.MBU: ("MBU", "fraction"),
    attr.DESIRED_WORKERS: ("desired workers", "workers"),
    attr.READY_WORKERS: ("ready workers", "workers"),
    attr.FORECAST_RPS: ("forecast arrivals", "requests/s"),
}
# Linux pids stay below 2**22, and tools assume it.
_PID_SPACE = 1 << 22


@dataclass(slots=True)
class TrackSpec:
    """One track to describe. Exactly one of process/thread/counter/plain applies."""

    uuid: int
    name: str
    # The enclosing track: a request track's overflow lanes, a counter's process.
    parent_uuid: int | None = None
    # For a process track: its pid. For a thread track: its process's pid.
    pid: int | None = None
    # For a thread track only.
    tid: int | None = None
    # For a counter track only: the unit shown next to values.
    counter_unit: str | None = None


@dataclass(slots=True)
class SlicePlacement:
    """A span and the track its slice goes on."""

    span: StoredSpan
    track_uuid: int
    # Flow continued (or, if ``terminates_flow``, ended) by this slice.
    flow_id: int | None = None
    terminates_flow: bool = False


@dataclass(slots=True)
class CounterSample:
    track_uuid: int
    ts_ns: int
    value: int | float


@dataclass(slots=True)
class TraceLayout:
    """Everything the writer emits, in the order it must be described."""

    tracks: list[TrackSpec] = field(default_factory=list)
    # Per track lane: its placements in begin order, each properly nested.
    lanes: list[list[SlicePlacement]] = field(default_factory=list)
    counters: list[CounterSample] = field(default_factory=list)
    processes: int = 0
    threads: int = 0
    request_tracks: int = 0
    counter_tracks: int = 0
    flows: int = 0


def _derive_id(key: str, used: set[int]) -> int:
    """A stable pid/tid for ``key``: the same key gets the same id in every trace."""
    # Ids 0 and 1 are the kernel's idle task and init, which tools treat specially.
    slots = _PID_SPACE - 2
    slot = zlib.crc32(key.encode()) % slots
    while slot + 2 in used:
        slot = (slot + 1) % slots
    used.add(slot + 2)
    return slot + 2


def _thread_name(span: StoredSpan) -> str:
    thread = span.attributes.get(attr.THREAD_NAME)
    rank = span.rank
    if rank is not None:
        return f"rank {rank} {thread}" if thread else f"rank {rank}"
    return str(thread) if thread else "main"


def pack_lanes(spans: list[StoredSpan]) -> list[list[StoredSpan]]:
    """Splits spans into lanes where any two slices nest or are disjoint.

    A Perfetto slice track is a stack, so spans that partly overlap (two
    asyncio tasks on one loop, or spans from two services) need separate lanes.
    """
    lanes: list[list[StoredSpan]] = []
    open_ends: list[list[int]] = []
    for span in sorted(spans, key=lambda s: (s.start_ns, -s.end_ns)):
        for lane, ends in zip(lanes, open_ends):  # noqa: B007 (the lane the loop breaks on is used below)
            while ends and ends[-1] <= span.start_ns:
                ends.pop()
            if not ends or span.end_ns <= ends[-1]:
                break
        else:
            lane, ends = [], []
            lanes.append(lane)
            open_ends.append(ends)
        lane.append(span)
        ends.append(span.end_ns)
    return lanes


def build_layout(spans: list[StoredSpan]) -> TraceLayout:
    """Assigns every span to a track lane and collects flows and counters."""
    layout = TraceLayout()
    uuids = count(1)
    used_ids: set[int] = set()
    processes: dict[str, TrackSpec] = {}
    for instance in sorted({span.instance_id for span in spans}):
        process = TrackSpec(uuid=next(uuids), name=instance, pid=_derive_id(instance, used_ids))
        processes[instance] = process
        layout.tracks.append(process)
    layout.processes = len(processes)

    by_thread: dict[tuple[str, str], list[StoredSpan]] = {}
    by_request: dict[str, list[StoredSpan]] = {}
    for span in spans:
        request_id = span.request_id
        if request_id is None:
            by_thread.setdefault((span.instance_id, _thread_name(span)), []).append(span)
        else:
            by_request.setdefault(request_id, []).append(span)

    for (instance, thread), thread_spans in sorted(by_thread.items()):
        pid = processes[instance].pid
        track = TrackSpec(uuid=next(uuids), name=thread, pid=pid, tid=_derive_id(f"{instance}/{thread}", used_ids))
        layout.tracks.append(track)
        _add_lanes(layout, track, thread_spans, uuids, {})
    layout.threads = len(by_thread)

    for flow_id, (request_id, request_spans) in enumerate(sorted(by_request.items()), start=1):
        track = TrackSpec(uuid=next(uuids), name=f"request {request_id}")
        layout.tracks.append(track)
        hops = flow_hops(request_spans)
        layout.flows += len(hops) - 1
        flows = {span.span_id: (flow_id, span is hops[-1]) for span in hops} if len(hops) > 1 else {}
        _add_lanes(layout, track, request_spans, uuids, flows)
    layout.request_tracks = len(by_request)

    _add_counters(layout, spans, processes, uuids)
    return layout


def _add_lanes(
    layout: TraceLayout, track: TrackSpec, spans: list[StoredSpan], uuids: count, flows: dict[str, tuple[int, bool]]
) -> None:
    """Lane 0 is ``track`` itself; overflow lanes become same-named child tracks.

    ``flows`` maps a span id to its (flow id, is the flow's last hop).
    """
    for index, lane in enumerate(pack_lanes(spans)):
        lane_uuid = track.uuid
        if index:
            lane_uuid = next(uuids)
            layout.tracks.append(TrackSpec(uuid=lane_uuid, name=track.name, parent_uuid=track.uuid))
        placements = []
        for span in lane:
            flow_id, terminates = flows.get(span.span_id, (None, False))
            placements.append(SlicePlacement(span, lane_uuid, flow_id, terminates))
        layout.lanes.append(placements)


def flow_hops(spans: list[StoredSpan]) -> list[StoredSpan]:
    """A request's spans where it arrives at another service instance, in time order.

    Its first span counts as a hop; a flow through these links the request's
    path across services without an arrow for every nested span.
    """
    hops: list[StoredSpan] = []
    for span in sorted(spans, key=lambda s: (s.start_ns, -s.end_ns)):
        if not hops or span.instance_id != hops[-1].instance_id:
            hops.append(span)
    return hops


def _add_counters(layout: TraceLayout, spans: list[StoredSpan], processes: dict[str, TrackSpec], uuids: count) -> None:
    tracks: dict[tuple[str, int | None, str], int] = {}
    for span in sorted(spans, key=lambda s: s.start_ns):
        for key, (label, unit) in COUNTERS.items():
            value = span.attributes.get(key)
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            track_key = (span.instance_id, span.rank, key)
            if track_key not in tracks:
                tracks[track_key] = next(uuids)
                name = label if span.rank is None else f"{label} rank {span.rank}"
                parent = processes[span.instance_id].uuid
                layout.tracks.append(
                    TrackSpec(uuid=tracks[track_key], name=name, parent_uuid=parent, counter_unit=unit)
                )
            layout.counters.append(CounterSample(tracks[track_key], span.start_ns, value))
    layout.counter_tracks = len(tracks)
