"""SLOs at the gateway: the TTFT target and refuse_late, from the body, gRPC or the tenant's defaults,
reach the scheduler; bad ones are 400 naming the field; a request refused for lateness is a 503."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import grpc
import pytest
from google.protobuf import duration_pb2

from gateway.tenancy.tenants import key_digest
from shardline.core.errors import SLO_UNMET
from shardline.proto import generation_pb2, sampling_pb2
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.scripted_scheduler import Script

TENANTS = f"""
tenants:
  interactive:
    keys: [{key_digest("k-fast")}]
    slo: {{ttft_target_ms: 1000, refuse_late: true}}
  batchy:
    keys: [{key_digest("k-slow")}]
"""


def _target_s(submit) -> float | None:
    return submit.ttft_target.ToNanoseconds() / 1e9 if submit.HasField("ttft_target") else None


def test_targets_reach_the_scheduler_from_the_body_grpc_and_the_tenant(tokenizer_address, text_ids, tmp_path: Path):
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)

    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            for key, extra in (
                ("k-fast", {}),  # the tenant's defaults
                ("k-fast", {"ttft_target_ms": 250, "refuse_late": False}),  # the request's own win
                ("k-slow", {"ttft_target_ms": 10_000}),
                ("k-slow", {}),  # no target at all
            ):
                async with http.post(
                    f"{stack.base_url}/v1/completions",
                    json={"prompt": "hi", "max_tokens": 2, **extra},
                    headers={"Authorization": f"Bearer {key}"},
                ) as response:
                    assert response.status == 200, await response.text()
        target = duration_pb2.Duration(nanos=500_000_000)
        await stack.generation.Generate(
            generation_pb2.GenerateRequest(prompt="hi", ttft_target=target, refuse_late=True),
            metadata=[("authorization", "Bearer k-slow")],
        )
        submitted = [(_target_s(s), s.refuse_late) for s in stack.scheduler.submitted]
        assert submitted == [(1.0, True), (0.25, False), (10.0, False), (None, False), (0.5, True)]

    run_on_stack(tokenizer_address, Script(text_ids), body, tenants_file=str(path))


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"ttft_target_ms": 0}, "ttft_target_ms"),
        ({"ttft_target_ms": "fast"}, "ttft_target_ms"),
        ({"ttft_target_ms": 1e12}, "ttft_target_ms"),
        ({"refuse_late": "yes"}, "refuse_late"),
        ({"refuse_late": True}, "refuse_late"),  # nothing to be late against
    ],
)
def test_bad_slo_fields_are_400_naming_the_field(tokenizer_address, text_ids, extra, field) -> None:
    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{stack.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, **extra}
            ) as response:
                assert response.status == 400
                assert (await response.json())["error"]["param"] == field
        assert stack.scheduler.submitted == []

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_a_request_refused_as_late_is_503_and_unavailable(tokenizer_address, text_ids) -> None:
    refused = Script(text_ids[:0], finish_reason=sampling_pb2.FINISH_REASON_ERROR, error=f"{SLO_UNMET}: refused")

    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{stack.base_url}/v1/completions",
                json={"prompt": "hi", "max_tokens": 2, "ttft_target_ms": 100, "refuse_late": True},
            ) as response:
                assert response.status == 503
                assert SLO_UNMET in (await response.json())["error"]["message"]
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stack.generation.Generate(
                generation_pb2.GenerateRequest(
                    prompt="hi", ttft_target=duration_pb2.Duration(nanos=100_000_000), refuse_late=True
                )
            )
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE

    run_on_stack(tokenizer_address, refused, body)


def test_a_tenants_slo_is_checked_when_the_file_is_read() -> None:
    from gateway.tenancy.tenants import TenantsFileError, parse_tenants

    assert parse_tenants(TENANTS).tenants["interactive"].slo.ttft_target_s == 1.0
    with pytest.raises(TenantsFileError, match="refuse_late needs slo.ttft_target_ms"):
        parse_tenants("tenants: {a: {slo: {refuse_late: true}}}")
    with pytest.raises(TenantsFileError, match="ttft_target_ms"):
        parse_tenants("tenants: {a: {slo: {ttft_target_ms: -5}}}")
