"""The dashboard's per-tenant view, summed from stored request spans as the gateway emits them."""

import pytest

from tests.tracing.collector.fake_request import MS, SpanFactory
from tests.tracing.collector.served_request import served_request
from tracing import attributes as attr
from tracing.collector.dashboard_stats import summarize
from tracing.collector.stored_span import StoredSpan
from tracing.collector.tenant_stats import by_tenant, percentile


def _request(
    f: SpanFactory, n: int, tenant: str | None, ttft_ms: float | None = 22, outcome: str | None = None, **kw
) -> list[StoredSpan]:
    """Request r<n>; its first tokens reach the gateway ``ttft_ms`` after arrival (None: none came)."""
    extra: dict = {} if tenant is None else {attr.TENANT: tenant}
    if outcome is not None:
        extra |= {attr.TTFT_TARGET_MS: 50.0, attr.SLO_OUTCOME: outcome}
    spans = served_request(f, f"r{n}", f"{n:032x}", at_ms=200 * n, **kw, **extra)
    if ttft_ms is None:  # refused in the queue: no worker, no tokens
        return [s for s in spans if s.name in ("gateway.request", "tokenize", "queue")]
    detokenize = next(s for s in spans if s.name == "detokenize")
    detokenize.start_ns = spans[0].start_ns + int(ttft_ms * MS)
    return spans


def _rows(spans_by_request: list[list[StoredSpan]]) -> list:
    rows = [summarize(spans[0].attributes[attr.REQUEST_ID], spans) for spans in spans_by_request]
    assert all(row is not None for row in rows)
    return rows


def test_requests_are_summed_per_tenant_with_ttft_percentiles_and_slo_attainment() -> None:
    f = SpanFactory()
    requests = [
        _request(f, 1, "acme", ttft_ms=20, outcome="met"),
        _request(f, 2, "acme", ttft_ms=40, outcome="met"),
        _request(f, 3, "acme", ttft_ms=90, outcome="missed"),
        _request(f, 4, "acme", ttft_ms=None, outcome="refused", output_tokens=0, finish="error"),
        _request(f, 5, "free", ttft_ms=30, output_tokens=4),
        _request(f, 6, None, ttft_ms=None, output_tokens=0, finish="error"),  # refused before its Submit
    ]
    rows = _rows(requests)
    assert (rows[2].tenant, rows[2].ttft_target_ms, rows[2].slo_outcome) == ("acme", 50.0, "missed")
    assert (rows[4].tenant, rows[4].ttft_target_ms, rows[4].slo_outcome) == ("free", None, None)
    tenants = {t.tenant: t.to_json() for t in by_tenant(rows)}
    assert list(tenants) == ["", "acme", "free"]
    assert tenants["acme"] == {
        "tenant": "acme",
        "requests": 4,
        "running": 0,
        "errors": 1,
        "input_tokens": 48,
        "output_tokens": 24,
        "ttft_p50_ms": 40.0,
        "ttft_p99_ms": 90.0,
        "slo": {"met": 2, "missed": 1, "refused": 1},
        "slo_attainment": 0.5,
    }
    free = tenants["free"]
    assert (free["requests"], free["errors"], free["output_tokens"], free["ttft_p50_ms"]) == (1, 0, 4, 30.0)
    # No request of its had a target: no attainment to speak of, rather than 0 % or 100 %.
    assert (free["slo"], free["slo_attainment"]) == ({"met": 0, "missed": 0, "refused": 0}, None)
    assert (tenants[""]["requests"], tenants[""]["errors"], tenants[""]["ttft_p50_ms"]) == (1, 1, None)


def test_a_request_in_flight_counts_as_running() -> None:
    f = SpanFactory()
    early = [s for s in _request(f, 1, "acme") if s.name in ("tokenize", "queue")]
    (tenant,) = by_tenant(_rows([early]))
    # Its gateway span has not ended, so its tenant is not known yet.
    assert (tenant.tenant, tenant.requests, tenant.running) == ("", 1, 1)


@pytest.mark.parametrize(("p", "value"), [(50, 2.0), (99, 4.0), (25, 1.0), (100, 4.0)])
def test_percentiles_are_nearest_rank(p: float, value: float) -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], p) == value
    assert percentile([], p) is None
