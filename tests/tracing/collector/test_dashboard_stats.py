"""The dashboard's per-request numbers, derived from spans named as the services emit them."""

import pytest

from tests.tracing.collector.fake_request import T0, SpanFactory
from tests.tracing.collector.served_request import MODEL, engine_steps, served_request
from tracing import attributes as attr
from tracing.collector.dashboard_stats import RUNNING, STAGES, summarize

TRACE = "ab" * 16


def test_finished_request_latencies_and_breakdown() -> None:
    f = SpanFactory()
    spans = served_request(f, "r1", TRACE, output_tokens=8) + engine_steps(f, 10, 90)
    row = summarize("r1", spans)
    assert row is not None
    assert (row.request_id, row.trace_id, row.start_ns, row.status) == ("r1", TRACE, T0, "stop")
    assert (row.model, row.input_tokens, row.output_tokens, row.worker) == (MODEL, 12, 8, "worker-0")
    assert row.e2e_ms == pytest.approx(100)
    # First tokens reach the gateway at 22 ms, the last at 92: 70 ms over 7 tokens after the first.
    assert row.ttft_ms == pytest.approx(22)
    assert row.tpot_ms == pytest.approx(10)
    assert list(row.stages_ms) == list(STAGES)
    assert row.stages_ms == pytest.approx({"tokenize": 3, "queue": 7, "prefill": 10, "decode": 70, "detokenize": 10})
    assert sum(row.stages_ms.values()) == pytest.approx(row.e2e_ms)
    assert row.instances == ["gateway-0", "scheduler", "tokenizer-0", "worker-0"]
    as_json = row.to_json()
    assert as_json["start_unix_s"] == pytest.approx(T0 / 1e9)
    assert as_json["stages_ms"]["decode"] == 70.0 and as_json["status"] == "stop"


def test_in_flight_request_is_running_without_e2e() -> None:
    f = SpanFactory()
    early = [s for s in served_request(f, "r2", TRACE) if s.name in ("tokenize", "queue", "prefill")]
    row = summarize("r2", early)
    assert row is not None
    assert (row.status, row.e2e_ms, row.tpot_ms, row.output_tokens) == (RUNNING, None, None, None)
    # Without the gateway's spans the worker's first token stands in for TTFT, from the first span seen.
    assert row.start_ns == T0 + 1_000_000
    assert row.ttft_ms == pytest.approx(19)
    assert row.stages_ms == pytest.approx({"tokenize": 2, "queue": 7, "prefill": 10, "decode": 0, "detokenize": 0})
    assert row.model == MODEL and row.input_tokens == 12


def test_missing_stages_hand_their_time_to_the_next_and_never_go_backwards() -> None:
    f = SpanFactory()
    spans = [s for s in served_request(f, "r3", TRACE, output_tokens=1) if s.name not in ("queue", "detokenize")]
    # A skewed clock on the worker: its prefill "ends" before tokenize did.
    prefill = next(s for s in spans if s.name == "prefill")
    prefill.end_ns = T0 + 2_000_000
    row = summarize("r3", spans)
    assert row is not None
    assert all(ms >= 0 for ms in row.stages_ms.values())
    assert row.stages_ms["queue"] == 0 and row.stages_ms["prefill"] == 0
    assert sum(row.stages_ms.values()) == pytest.approx(100)
    # One output token: no time per output token.
    assert row.tpot_ms is None


def test_failed_and_unknown_requests() -> None:
    f = SpanFactory()
    spans = served_request(f, "r4", TRACE, finish="error")
    spans[0].error = "worker lost"
    row = summarize("r4", spans)
    assert row is not None and (row.status, row.error) == ("error", "worker lost")
    del spans[0].attributes[attr.GEN_AI_RESPONSE_FINISH_REASONS]
    assert summarize("r4", spans).status == "error"
    spans[0].error = ""
    assert summarize("r4", spans).status == "unknown"
    assert summarize("absent", spans) is None


def test_each_choice_of_an_n_request_is_a_row_and_their_container_is_none() -> None:
    # n=2: the choices' own spans are rooted in gateway.choice (usage, finish reasons); the HTTP
    # gateway.request lists them and carries the id the client got, for a whole-trace export.
    f = SpanFactory()
    choices = []
    for i in range(2):
        spans = served_request(f, f"cmpl-x-{i}", TRACE, output_tokens=6 + i, finish="length")
        spans[0] = f.span("gateway.choice", "gateway", "gateway-0", 0, 100, trace_id=TRACE, **spans[0].attributes)
        choices += spans
    container = f.span(
        "gateway.request",
        "gateway",
        "gateway-0",
        0,
        101,
        trace_id=TRACE,
        **{attr.REQUEST_ID: "cmpl-x", attr.CHOICES: ["cmpl-x-0", "cmpl-x-1"]},
    )
    spans = [container, *choices]
    rows = [summarize(rid, spans) for rid in ("cmpl-x-0", "cmpl-x-1")]
    assert [(r.status, r.output_tokens, r.e2e_ms) for r in rows] == [("length", 6, 100.0), ("length", 7, 100.0)]
    assert summarize("cmpl-x", spans) is None
