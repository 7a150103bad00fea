import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from gpu_worker_svc.engine.outputs import RequestOutput, StepResult, StepStats
from gpu_worker_svc.model.config import ModelConfig
from gpu_worker_svc.server.telemetry import StepTelemetry
from gpu_worker_svc.server.utilization import DevicePeak, StepCostModel
from tracing import attributes as attr

TRACE_ID, PARENT_ID = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=100,
    hidden_size=8,
    intermediate_size=16,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    tie_word_embeddings=True,
)
MS = 1_000_000


def _stats(step: int, batch: int, tokens: int, kv_used: int, running: int) -> StepStats:
    return StepStats(
        step=step,
        batch_size=batch,
        num_tokens=tokens,
        num_prefill_tokens=0,
        num_decode_tokens=0,
        prefix_cache_hit_tokens=4 if step == 0 else 0,
        kv_blocks_used=kv_used,
        kv_blocks_total=10,
        num_waiting=0,
        num_running=running,
        num_preempted=0,
        step_time_s=0.01,
        attention_pairs=tokens * 4,
        kv_tokens_read=tokens * 2,
    )


def _token(rid: str, offset: int, finish: str | None = None) -> RequestOutput:
    return RequestOutput(rid, [10 + offset], offset, None, finish, num_prompt_tokens=20, num_cached_tokens=0)


@pytest.fixture
def recorded():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    cost = StepCostModel.for_model(CONFIG, 4, DevicePeak(1e9, 1e9), 1)
    telemetry = StepTelemetry(provider.get_tracer("test"), cost, "tiny")
    telemetry.request_added("r", f"00-{TRACE_ID}-{PARENT_ID}-01", 20, 3, 0.0)
    telemetry.request_added("one", "", 5, 1, 0.0)
    telemetry.request_added("dropped", "", 5, 8, 0.0)
    steps = [
        StepResult([_token("one", 0, "length")], _stats(0, 3, 30, 5, 2), admitted_ids=["r", "one", "dropped"]),
        StepResult([_token("r", 0)], _stats(1, 2, 2, 4, 2)),
        StepResult([_token("r", 1)], _stats(2, 1, 1, 4, 1)),
        StepResult([_token("r", 2, "length")], _stats(3, 1, 1, 0, 0)),
    ]
    for i, out in enumerate(steps):
        if i == 2:
            telemetry.request_dropped("dropped", 105 * MS)
        telemetry.step(i, out, start_ns=(100 + 10 * i) * MS, end_ns=(109 + 10 * i) * MS)
    return exporter.get_finished_spans()


def _one(spans, name: str, rid: str | None = None):
    found = [s for s in spans if s.name == name and (rid is None or s.attributes[attr.REQUEST_ID] == rid)]
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


def test_one_engine_step_span_per_step_with_the_counters(recorded):
    steps = sorted((s for s in recorded if s.name == "engine_step"), key=lambda s: s.start_time)
    assert [s.attributes[attr.STEP] for s in steps] == [0, 1, 2, 3]
    first = steps[0].attributes
    assert (
        first[attr.BATCH_SIZE],
        first[attr.NUM_TOKENS],
        first[attr.PREFIX_CACHE_HITS],
        first[attr.KV_BLOCKS_USED],
    ) == (3, 30, 4, 5)
    assert first[attr.TOKENS_PER_S] == pytest.approx(1 / 0.01)  # one token sampled in 10 ms
    assert first[attr.MFU] > 0 and first[attr.MBU] > 0
    assert (steps[0].start_time, steps[0].end_time) == (100 * MS, 109 * MS)


def test_prefill_then_decode_spans_join_the_request_trace(recorded):
    prefill, decode = _one(recorded, "prefill", "r"), _one(recorded, "decode", "r")
    for span in (prefill, decode):
        assert format(span.context.trace_id, "032x") == TRACE_ID
        assert format(span.parent.span_id, "016x") == PARENT_ID
        assert span.attributes[attr.GEN_AI_USAGE_INPUT_TOKENS] == 20
    assert (prefill.start_time, prefill.end_time) == (100 * MS, 119 * MS)  # admitted → first token
    assert (decode.start_time, decode.end_time) == (119 * MS, 139 * MS)  # first token → finish
    assert decode.attributes[attr.GEN_AI_USAGE_OUTPUT_TOKENS] == 3
    assert decode.attributes[attr.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)


def test_a_request_finishing_on_its_first_token_has_no_decode_span(recorded):
    prefill = _one(recorded, "prefill", "one")
    assert prefill.parent is None  # no traceparent: a root span
    assert prefill.attributes[attr.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
    assert not [s for s in recorded if s.name == "decode" and s.attributes[attr.REQUEST_ID] == "one"]


def test_a_dropped_request_ends_as_aborted(recorded):
    prefill = _one(recorded, "prefill", "dropped")
    assert prefill.end_time == 105 * MS
    assert prefill.attributes[attr.GEN_AI_RESPONSE_FINISH_REASONS] == ("abort",)


def test_metrics_follow_the_last_step(recorded):
    assert REGISTRY.get_sample_value("shardline_generation_tokens_per_second") == pytest.approx(100.0)
    cost = StepCostModel.for_model(CONFIG, 4, DevicePeak(1e9, 1e9), 1)
    telemetry = StepTelemetry(TracerProvider().get_tracer("test"), cost, "tiny", enabled=False)
    telemetry.occupancy(running=3, kv_blocks_used=5, kv_blocks_total=20)
    assert REGISTRY.get_sample_value("shardline_kv_cache_usage_ratio") == 0.25
    assert REGISTRY.get_sample_value("shardline_running_requests") == 3.0
    assert REGISTRY.get_sample_value("shardline_kv_blocks_used") == 5.0


def test_step_time_and_utilization_metrics_are_kept_with_tracing_off():
    """The Grafana panels for step time, MFU and MBU read these; a worker exporting no spans still sets them."""
    cost = StepCostModel.for_model(CONFIG, 4, DevicePeak(1e9, 1e9), 1)
    telemetry = StepTelemetry(TracerProvider().get_tracer("test"), cost, "tiny", enabled=False)
    count = REGISTRY.get_sample_value("shardline_engine_step_duration_seconds_count") or 0.0
    total = REGISTRY.get_sample_value("shardline_engine_step_duration_seconds_sum") or 0.0
    stats = _stats(0, 4, 4, 2, 4)
    telemetry.step(0, StepResult([_token("r", 0)], stats), start_ns=0, end_ns=10 * MS)
    assert REGISTRY.get_sample_value("shardline_engine_step_duration_seconds_count") == count + 1
    assert REGISTRY.get_sample_value("shardline_engine_step_duration_seconds_sum") == pytest.approx(total + 0.01)
    mfu, mbu = cost.utilization(4, 4, stats.attention_pairs, stats.kv_tokens_read, 0.01)
    assert mfu > 0 and mbu > 0
    assert REGISTRY.get_sample_value("shardline_model_flops_utilization") == pytest.approx(mfu)
    assert REGISTRY.get_sample_value("shardline_model_bandwidth_utilization") == pytest.approx(mbu)
