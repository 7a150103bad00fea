"""Per-tenant metrics on the gateway's /metrics: requests, tokens, TTFT, SLO outcomes and queue depth, exact
after known requests; and the SLO outcome a request's end is judged by."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.output.request_stream import StreamTiming
from gateway.runner.request_metrics import MET, MISSED, REFUSED, RequestEnd, slo_outcome
from gateway.tenancy.tenants import key_digest
from shardline.core.errors import SLO_UNMET
from shardline.proto import sampling_pb2
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.scripted_scheduler import Script
from tracing import attributes as attr

# Tenant names of this module only: the counters are the process's, shared with the other tests.
FAST, SLOW = "metrics-fast", "metrics-slow"
TENANTS = f"""
tenants:
  {FAST}:
    keys: [{key_digest("k-mfast")}]
    slo: {{ttft_target_ms: 50}}
  {SLOW}:
    keys: [{key_digest("k-mslow")}]
"""
HELD_S = 0.2  # how long the first request waits for its first token: well past FAST's 50 ms


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _of(samples: dict, name: str, tenant: str) -> dict[frozenset[tuple[str, str]], float]:
    """The samples of `name` for `tenant`, by their other labels."""
    return {
        labels - {("tenant", tenant)}: value
        for (sample_name, labels), value in samples.items()
        if sample_name == name and ("tenant", tenant) in labels
    }


def test_tenant_metrics_count_requests_tokens_and_slo_outcomes(tokenizer_address, text_ids, tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    refused = Script(text_ids[:0], finish_reason=sampling_pb2.FINISH_REASON_ERROR, error=f"{SLO_UNMET}: refused")

    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:

            async def complete(key: str, **extra: object) -> int:
                async with http.post(
                    f"{stack.base_url}/v1/completions",
                    json={"prompt": "hi", "max_tokens": 2, **extra},
                    headers={"Authorization": f"Bearer {key}"},
                ) as response:
                    await response.read()
                    return response.status

            held = asyncio.create_task(complete("k-mfast"))  # the tenant's 50 ms target, held past it: missed
            await asyncio.sleep(HELD_S)
            stack.scheduler.release()
            assert await held == 200
            assert await complete("k-mfast", ttft_target_ms=10_000) == 200  # met
            assert await complete("k-mslow") == 200  # no target: counted, but not in the SLO outcomes
            stack.scheduler.script = refused
            assert await complete("k-mslow", ttft_target_ms=100, refuse_late=True) == 503  # refused
            async with http.get(f"{stack.base_url}/metrics") as response:
                samples = _samples(await response.text())
        prompts = {FAST: 0, SLOW: 0}
        for submit, key in zip(stack.scheduler.submitted, (FAST, FAST, SLOW, SLOW), strict=True):
            prompts[key] += len(submit.prompt_token_ids)
        length, error = frozenset({("finish_reason", "length")}), frozenset({("finish_reason", "error")})
        assert _of(samples, "shardline_tenant_requests_total", FAST) == {length: 2}
        assert _of(samples, "shardline_tenant_requests_total", SLOW) == {length: 1, error: 1}
        for tenant, generated in ((FAST, 4), (SLOW, 2)):
            assert _of(samples, "shardline_tenant_prompt_tokens_total", tenant) == {frozenset(): prompts[tenant]}
            assert _of(samples, "shardline_tenant_generation_tokens_total", tenant) == {frozenset(): generated}
        slo = "shardline_tenant_slo_requests_total"
        assert _of(samples, slo, FAST) == {frozenset({("outcome", MET)}): 1, frozenset({("outcome", MISSED)}): 1}
        assert _of(samples, slo, SLOW) == {frozenset({("outcome", REFUSED)}): 1}
        ttft = "shardline_tenant_time_to_first_token_seconds"
        assert _of(samples, f"{ttft}_count", FAST) == {frozenset(): 2}
        assert _of(samples, f"{ttft}_count", SLOW) == {frozenset(): 1}  # the refused one had no token
        assert _of(samples, f"{ttft}_bucket", FAST)[frozenset({("le", "0.1")})] <= 1  # the held one is later
        # From GetStats at scrape time; the tenant a gateway naming none queued under is the default one.
        assert _of(samples, "shardline_tenant_queue_depth", "default") == {frozenset(): 1}
        assert _of(samples, "shardline_tenant_queue_depth", "acme") == {frozenset(): 2}
        # The autoscaler's figures, from the same GetStats (once: the gateway's own empty gauges left out).
        model = frozenset({("model", "test-model")})
        assert samples[("shardline_autoscaler_desired_workers", model)] == 3
        assert samples[("shardline_autoscaler_ready_workers", model)] == 2
        assert samples[("shardline_autoscaler_forecast_requests_per_second", model)] == 1.5

        roots = [s for s in stack.spans.get_finished_spans() if s.name == "gateway.request"]
        seen = [
            (s.attributes[attr.TENANT], s.attributes.get(attr.TTFT_TARGET_MS), s.attributes.get(attr.SLO_OUTCOME))
            for s in sorted(roots, key=lambda s: s.start_time)
        ]
        assert seen == [(FAST, 50.0, MISSED), (FAST, 10_000.0, MET), (SLOW, None, None), (SLOW, 100.0, REFUSED)]

    run_on_stack(tokenizer_address, Script(text_ids, hold_after=0), body, tenants_file=str(path))


def _end(
    target_s: float | None,
    first_token_s: float | None = None,
    finish_reason: str = "stop",
    end_s: float = 5.0,
    timed_out: bool = False,
    error: str = "",
) -> RequestEnd:
    return RequestEnd(
        request_id="r",
        model="m",
        tenant="t",
        ttft_target_s=target_s,
        arrival_s=0.0,
        timing=StreamTiming(first_token_s=first_token_s, last_token_s=first_token_s),
        end_s=end_s,
        usage=sampling_pb2.Usage(),
        finish_reason=finish_reason,
        timed_out=timed_out,
        error=error,
    )


@pytest.mark.parametrize(
    ("end", "outcome"),
    [
        (_end(None, first_token_s=9.0), None),  # no target, nothing to judge
        (_end(1.0, first_token_s=1.0), MET),  # on the target counts as within it
        (_end(1.0, first_token_s=1.01), MISSED),
        (_end(1.0, finish_reason="error", error=f"{SLO_UNMET}: too late"), REFUSED),
        (_end(1.0, finish_reason="error", error="worker-0 failed"), MISSED),  # no token came at all
        (_end(1.0, finish_reason="abort", end_s=0.5), None),  # the client left before the target passed
        (_end(1.0, finish_reason="abort", end_s=2.0), MISSED),  # ... or after it, still without a token
        (_end(30.0, finish_reason="abort", end_s=10.0, timed_out=True), MISSED),  # its own deadline ended it
    ],
)
def test_the_slo_outcome_of_a_request_end(end: RequestEnd, outcome: str | None) -> None:
    assert slo_outcome(end) == outcome
