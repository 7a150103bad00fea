"""The .pftrace writer: decoded with Perfetto's own protos, then loaded in its trace processor."""

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from tests.tracing.collector.fake_request import STEPS, WORKER_RANKS, request_walk
from tracing import attributes as attr
from tracing.collector.perfetto_writer import SEQUENCE_ID, encode_pftrace, write_pftrace

REPO = Path(__file__).resolve().parents[3]
PERFETTO_QUERY = REPO.parent / "shared" / "tools" / "perfetto_query" / "perfetto_query.py"
LIFECYCLE = ["generate", "tokenize", "queue", "prefill", "decode", "detokenize"]


@dataclass
class Slice:
    name: str
    category: str
    ts: int
    track: int
    annotations: dict
    flow_ids: list[int]
    terminating_flow_ids: list[int]
    end_ts: int | None = None


@dataclass
class Decoded:
    """A .pftrace read back the way a Perfetto reader must: interned ids resolved per sequence."""

    first: pb.TracePacket
    tracks: dict[int, pb.TrackDescriptor] = field(default_factory=dict)
    slices: list[Slice] = field(default_factory=list)
    counters: dict[int, list[tuple[int, float]]] = field(default_factory=dict)


def _annotation_value(annotation: pb.DebugAnnotation):
    kind = annotation.WhichOneof("value")
    if kind is None:
        return [_annotation_value(item) for item in annotation.array_values]
    return getattr(annotation, kind)


def decode(data: bytes) -> Decoded:
    trace = pb.Trace.FromString(data)
    decoded = Decoded(first=trace.packet[0])
    interned: dict[str, dict[int, str]] = {}
    open_by_track: dict[int, list[Slice]] = {}
    for packet in trace.packet:
        assert packet.trusted_packet_sequence_id == SEQUENCE_ID
        if packet.sequence_flags & pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED:
            interned = {}
        for kind in ("event_names", "event_categories", "debug_annotation_names"):
            for entry in getattr(packet.interned_data, kind):
                interned.setdefault(kind, {})[entry.iid] = entry.name
        if packet.HasField("track_descriptor"):
            decoded.tracks[packet.track_descriptor.uuid] = packet.track_descriptor
        if not packet.HasField("track_event"):
            continue
        assert packet.sequence_flags & pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
        event = packet.track_event
        assert event.track_uuid in decoded.tracks, "event before its track descriptor"
        stack = open_by_track.setdefault(event.track_uuid, [])
        if event.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
            names = interned["debug_annotation_names"]
            opened = Slice(
                name=interned["event_names"][event.name_iid],
                category=interned["event_categories"][event.category_iids[0]],
                ts=packet.timestamp,
                track=event.track_uuid,
                annotations={names[a.name_iid]: _annotation_value(a) for a in event.debug_annotations},
                flow_ids=list(event.flow_ids),
                terminating_flow_ids=list(event.terminating_flow_ids),
            )
            if stack:
                assert stack[-1].ts <= opened.ts, "a slice begins before the one enclosing it"
            stack.append(opened)
            decoded.slices.append(opened)
        elif event.type == pb.TrackEvent.TYPE_SLICE_END:
            stack.pop().end_ts = packet.timestamp
        else:
            value = event.counter_value if event.HasField("counter_value") else event.double_counter_value
            decoded.counters.setdefault(event.track_uuid, []).append((packet.timestamp, value))
    assert not any(open_by_track.values()), "slices left open"
    return decoded


@pytest.fixture(scope="module")
def walk_trace(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Decoded]:
    path = tmp_path_factory.mktemp("pftrace") / "walk.pftrace"
    stats = write_pftrace(request_walk(), path)
    assert (stats.processes, stats.threads, stats.request_tracks, stats.flows) == (4, 4, 1, 4)
    assert stats.slices == len(request_walk()) and stats.bytes == path.stat().st_size
    return path, decode(path.read_bytes())


def test_first_packet_clears_state_and_sets_the_realtime_clock(walk_trace: tuple[Path, Decoded]) -> None:
    first = walk_trace[1].first
    assert first.sequence_flags == pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
    assert first.trace_packet_defaults.timestamp_clock_id == pb.BUILTIN_CLOCK_REALTIME
    assert first.clock_snapshot.primary_trace_clock == pb.BUILTIN_CLOCK_REALTIME


def test_process_per_instance_and_thread_per_rank(walk_trace: tuple[Path, Decoded]) -> None:
    tracks = walk_trace[1].tracks.values()
    pids = {t.process.process_name: t.process.pid for t in tracks if t.HasField("process")}
    assert set(pids) == {"gateway-0", "tokenizer-0", "scheduler-0", "worker-0"}
    assert len(set(pids.values())) == 4
    worker_threads = {t.thread.thread_name for t in tracks if t.HasField("thread") and t.thread.pid == pids["worker-0"]}
    assert worker_threads == {f"rank {rank}" for rank in WORKER_RANKS}
    # The pid comes from the instance id alone, so it is the same in every trace.
    only_worker = [span for span in request_walk() if span.instance_id == "worker-0"]
    again = decode(encode_pftrace(only_worker)[0]).tracks.values()
    assert [t.process.pid for t in again if t.HasField("process")] == [pids["worker-0"]]


def test_request_track_holds_the_lifecycle_with_every_attribute(walk_trace: tuple[Path, Decoded]) -> None:
    decoded = walk_trace[1]
    [request_track] = [uuid for uuid, t in decoded.tracks.items() if t.name == "request req-1"]
    on_track = [s for s in decoded.slices if s.track == request_track]
    assert [s.name for s in on_track] == LIFECYCLE
    assert {s.category for s in on_track} == {"gateway", "tokenizer", "scheduler", "gpu_worker"}
    spans = {span.name: span for span in request_walk()}
    for s in on_track:
        span = spans[s.name]
        assert (s.ts, s.end_ts) == (span.start_ns, span.end_ns)
        assert s.annotations == {
            "service.name": span.service_name,
            "service.instance.id": span.instance_id,
            "trace_id": span.trace_id,
            "span_id": span.span_id,
            **span.attributes,
        }
    generate = on_track[0].annotations
    assert generate[attr.GEN_AI_REQUEST_TEMPERATURE] == 0.7
    assert generate[attr.GEN_AI_RESPONSE_FINISH_REASONS] == ["length"]


def test_flow_hops_across_services_in_time_order(walk_trace: tuple[Path, Decoded]) -> None:
    slices = {s.name: s for s in walk_trace[1].slices if s.name in LIFECYCLE}
    [flow_id] = slices["generate"].flow_ids
    for name in ("tokenize", "queue", "prefill"):
        assert slices[name].flow_ids == [flow_id]
    assert slices["detokenize"].terminating_flow_ids == [flow_id]
    # decode follows prefill on the same worker, so the flow does not stop there.
    assert slices["decode"].flow_ids == [] and slices["decode"].terminating_flow_ids == []


def test_counter_tracks_sample_step_attributes(walk_trace: tuple[Path, Decoded]) -> None:
    decoded = walk_trace[1]
    by_name = {t.name: uuid for uuid, t in decoded.tracks.items() if t.HasField("counter")}
    expected = {"queue depth"} | {f"{n} rank 0" for n in ("batch size", "KV blocks used", "tokens/s")}
    expected |= {f"{n} rank {r}" for n in ("MFU", "MBU") for r in WORKER_RANKS}
    assert set(by_name) == expected
    worker_uuid = next(u for u, t in decoded.tracks.items() if t.process.process_name == "worker-0")
    assert decoded.tracks[by_name["batch size rank 0"]].parent_uuid == worker_uuid
    step_starts = sorted({s.ts for s in decoded.slices if s.name == "decode_step"})
    assert [value for _, value in decoded.counters[by_name["batch size rank 0"]]] == [1, 2, 3, 4]
    assert [ts for ts, _ in decoded.counters[by_name["tokens/s rank 0"]]] == step_starts
    assert [value for _, value in decoded.counters[by_name["MFU rank 2"]]] == [pytest.approx(0.32)] * STEPS


def test_partly_overlapping_spans_get_a_child_lane(walk_trace: tuple[Path, Decoded]) -> None:
    decoded = walk_trace[1]
    lanes = {s.name: s.track for s in decoded.slices if s.name in ("dispatch", "heartbeat")}
    loop = decoded.tracks[lanes["dispatch"]]
    assert loop.thread.thread_name == "loop"
    overflow = decoded.tracks[lanes["heartbeat"]]
    assert overflow.parent_uuid == loop.uuid and overflow.name == "loop"


def _query(path: Path, sql: str) -> list[dict]:
    run = subprocess.run(
        [sys.executable, str(PERFETTO_QUERY), str(path), sql, "--json"], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


needs_trace_processor = pytest.mark.skipif(
    shutil.which("node") is None or not PERFETTO_QUERY.is_file(), reason="needs node and shared/tools/perfetto_query"
)


@needs_trace_processor
def test_trace_processor_sees_the_request_across_four_services(walk_trace: tuple[Path, Decoded]) -> None:
    path = walk_trace[0]
    assert _query(path, "select name, value from stats where severity in ('error', 'data_loss') and value > 0") == []
    rows = _query(
        path,
        "select s.name, t.name as track, extract_arg(s.arg_set_id, 'debug.service_name') as service "
        "from slice s join track t on s.track_id = t.id "
        "where extract_arg(s.arg_set_id, 'debug.shardline_request_id') = 'req-1' order by s.ts",
    )
    assert [row["name"] for row in rows] == LIFECYCLE
    assert {row["track"] for row in rows} == {"request req-1"}
    assert {row["service"] for row in rows} == {"gateway", "tokenizer", "scheduler", "gpu_worker"}
    flows = _query(
        path,
        "select a.name as src, b.name as dst, extract_arg(b.arg_set_id, 'debug.service_instance_id') as dst_instance "
        "from flow f join slice a on f.slice_out = a.id join slice b on f.slice_in = b.id order by a.ts",
    )
    assert [(f["src"], f["dst"], f["dst_instance"]) for f in flows] == [
        ("generate", "tokenize", "tokenizer-0"),
        ("tokenize", "queue", "scheduler-0"),
        ("queue", "prefill", "worker-0"),
        ("prefill", "detokenize", "tokenizer-0"),
    ]


@needs_trace_processor
def test_trace_processor_sees_steps_per_rank_and_counters(walk_trace: tuple[Path, Decoded]) -> None:
    path = walk_trace[0]
    steps = _query(
        path,
        "select p.name as process, t.name as thread, s.name, count(*) as n, min(s.depth) as depth, "
        "max(s.depth) as max_depth, group_concat(extract_arg(s.arg_set_id, 'debug.shardline_step')) as steps "
        "from slice s join thread_track tt on s.track_id = tt.id join thread t using (utid) "
        "join process p using (upid) where p.name = 'worker-0' group by 1, 2, 3 order by 2, 3",
    )
    assert [(r["process"], r["thread"], r["name"], r["n"], r["depth"], r["max_depth"]) for r in steps] == [
        ("worker-0", f"rank {rank}", name, STEPS, depth, depth)
        for rank in WORKER_RANKS
        for name, depth in (("decode_step", 0), ("forward", 1))
    ]
    assert sorted(int(step) for step in steps[0]["steps"].split(",")) == list(range(STEPS))
    counters = _query(
        path,
        "select t.name, p.name as process, count(*) as n, max(c.value) as peak from counter c "
        "join process_counter_track t on c.track_id = t.id join process p using (upid) group by 1, 2",
    )
    by_name = {row["name"]: row for row in counters}
    assert by_name["queue depth"]["process"] == "scheduler-0" and by_name["queue depth"]["peak"] == 3
    assert by_name["batch size rank 0"]["n"] == STEPS and by_name["batch size rank 0"]["peak"] == STEPS
    assert by_name["tokens/s rank 0"]["peak"] == 100.0 * STEPS
    assert {f"{n} rank {r}" for n in ("MFU", "MBU") for r in WORKER_RANKS} <= set(by_name)
    assert {row["process"] for row in counters} == {"scheduler-0", "worker-0"}


def test_the_autoscalers_rounds_become_counter_tracks_of_the_scheduler() -> None:
    """Each `autoscale` span (one a round) samples the desired and ready workers and the forecast:
    the dashboard's view of a scale-out, desired stepping up before ready follows."""
    from tests.tracing.collector.fake_request import SpanFactory

    f = SpanFactory()
    rounds = [(1, 1, 0.5), (3, 1, 4.0), (3, 2, 4.2), (3, 3, 4.1)]
    spans = [
        f.span(
            "autoscale",
            "scheduler",
            "scheduler-0",
            10 * i,
            10 * i + 1,
            **{attr.DESIRED_WORKERS: desired, attr.READY_WORKERS: ready, attr.FORECAST_RPS: rps},
        )
        for i, (desired, ready, rps) in enumerate(rounds)
    ]
    decoded = decode(encode_pftrace(spans)[0])
    by_name = {t.name: uuid for uuid, t in decoded.tracks.items() if t.HasField("counter")}
    assert set(by_name) == {"desired workers", "ready workers", "forecast arrivals"}
    assert [v for _, v in decoded.counters[by_name["desired workers"]]] == [1, 3, 3, 3]
    assert [v for _, v in decoded.counters[by_name["ready workers"]]] == [1, 1, 2, 3]
    assert [v for _, v in decoded.counters[by_name["forecast arrivals"]]] == pytest.approx([0.5, 4.0, 4.2, 4.1])
