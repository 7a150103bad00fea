"""Spans for the series tests, at a chosen wall-clock time, and a clock the tests move by hand."""

import dataclasses

from tests.tracing.collector.fake_request import T0, SpanFactory
from tests.tracing.collector.served_request import engine_steps, served_request
from tracing import attributes as attr
from tracing.collector.stored_span import StoredSpan


class ManualClock:
    """time.time for a SeriesStore, moved by the test instead of by waiting."""

    def __init__(self, now_s: float) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def at(spans: list[StoredSpan], start_s: float) -> list[StoredSpan]:
    """The spans moved so that the factory's origin falls at unix second ``start_s``."""
    shift = int(start_s * 1e9) - T0
    return [dataclasses.replace(s, start_ns=s.start_ns + shift, end_ns=s.end_ns + shift) for s in spans]


def request(
    f: SpanFactory, request_id: str, tenant: str, ttft_ms: float, at_ms: float = 0, **attributes: object
) -> list[StoredSpan]:
    """A served request of tenant ``tenant`` whose gateway measured ``ttft_ms``; 8 output tokens."""
    return served_request(
        f,
        request_id,
        f"{abs(hash(request_id)):032x}"[-32:],
        at_ms=at_ms,
        **{attr.TENANT: tenant, attr.TTFT_MS: ttft_ms, attr.TPOT_MS: 10.0, **attributes},
    )


def worker_steps(f: SpanFactory, worker: str, start_ms: float, end_ms: float, step_ms: float = 10) -> list[StoredSpan]:
    """engine_step spans of ``worker``, ``step_ms`` each, batch 2, one token per request per step."""
    steps = engine_steps(f, start_ms, end_ms, step_ms)
    for step in steps:
        step.resource[attr.SERVICE_INSTANCE_ID] = worker
        step.attributes[attr.GEN_AI_USAGE_OUTPUT_TOKENS] = 2
    return steps
