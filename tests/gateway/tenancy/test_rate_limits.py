"""Tenants' limits at one gateway, on a real Redis: requests/min, tokens/min with the unused given back,
the concurrency cap, their 429 / RESOURCE_EXHAUSTED, and Redis down (fail open)."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from pathlib import Path

import aiohttp
import grpc
import pytest
import redis

from gateway.tenancy.rate_limits import PREFIX
from gateway.tenancy.tenant_limiter import duration_text
from gateway.tenancy.tenants import key_digest
from shardline.core.ports import free_port
from shardline.proto import generation_pb2, sampling_pb2
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.scripted_scheduler import Script

KEY = {"authorization": "Bearer k-acme"}
PROMPT = [11, 12, 13, 14]  # 4 prompt tokens


def tenants_file(tmp_path: Path, limits: str) -> str:
    path = tmp_path / "tenants.yaml"
    path.write_text(
        f"tenants:\n  acme:\n    keys: [{key_digest('k-acme')}]\n    limits: {limits}\n"
        f"  open:\n    keys: [{key_digest('k-open')}]\n"
    )
    return str(path)


async def complete(stack: Stack, http: aiohttp.ClientSession, max_tokens: int = 8, **headers: str):
    body = {"prompt": PROMPT, "max_tokens": max_tokens}
    url, headers = f"{stack.base_url}/v1/completions", {**KEY, **headers}
    # Bounded: a request let through that the scripted scheduler holds would otherwise wait forever,
    # and the test would end at pytest's timeout instead of at the answer it did not expect.
    async with http.post(url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=20)) as response:
        return response.status, dict(response.headers), await response.json()


async def metric(stack: Stack, http: aiohttp.ClientSession, name: str, **labels: str) -> float:
    async with http.get(f"{stack.base_url}/metrics") as response:
        page = await response.text()
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    found = re.search(rf"^{name}\{{{re.escape(wanted)}\}} (\S+)$", page, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_requests_per_minute_lets_exactly_the_limit_through_then_429_with_retry_after(
    tokenizer_address, text_ids, tmp_path: Path, redis_url: str
) -> None:
    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            throttled = await metric(stack, http, "shardline_gateway_throttled_total", tenant="acme", reason="requests")
            answers = [await complete(stack, http) for _ in range(4)]
            assert [status for status, _, _ in answers] == [200, 200, 200, 429]
            for remaining, (_, headers, _) in zip(("2", "1", "0"), answers):
                assert headers["x-ratelimit-limit-requests"] == "3"
                assert headers["x-ratelimit-remaining-requests"] == remaining
                assert "x-ratelimit-limit-tokens" not in headers  # no tokens/min set
            _, headers, refusal = answers[3]
            # One request refills every 60 s / 3: the 4th may come 20 s after the 3rd.
            assert headers["Retry-After"] == "20"
            assert headers["x-ratelimit-remaining-requests"] == "0"
            error = refusal["error"]
            assert (error["type"], error["code"], error["param"]) == ("requests", "rate_limit_exceeded", None)
            assert "Limit 3, Used 3, Requested 1" in error["message"]
            after = await metric(stack, http, "shardline_gateway_throttled_total", tenant="acme", reason="requests")
            assert after == throttled + 1
            # Another tenant without limits is untouched, and gets no x-ratelimit headers.
            status, headers, _ = await complete(stack, http, authorization="Bearer k-open")
            assert status == 200 and not any(h.startswith("x-ratelimit") for h in headers)
        assert len(stack.scheduler.submitted) == 4  # the refused one never reached the scheduler

    path = tenants_file(tmp_path, "{requests_per_minute: 3}")
    run_on_stack(tokenizer_address, Script(text_ids[:3]), body, tenants_file=path, redis_url=redis_url)


def test_tokens_per_minute_charges_prompt_plus_max_tokens_and_gives_back_the_unused(
    tokenizer_address, text_ids, tmp_path: Path, redis_url: str
) -> None:
    bucket = redis.Redis.from_url(redis_url, decode_responses=True)

    def owed() -> float:
        return float(bucket.hget(f"{PREFIX}{{acme}}:tokens", "level"))

    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            # 4 + 46 = 50 reserved; it uses 4 + 5 = 9 and gives 41 back at its end.
            status, headers, answer = await complete(stack, http, max_tokens=46)
            assert status == 200 and answer["usage"]["total_tokens"] == 9
            assert (headers["x-ratelimit-limit-tokens"], headers["x-ratelimit-remaining-tokens"]) == ("100", "50")
            assert owed() == pytest.approx(9, abs=0.5)  # drained meanwhile at 100/min: well under a token
            # Exactly the rest fits: 9 + (4 + 87) = 100. Without the refund it would be 141.
            status, headers, _ = await complete(stack, http, max_tokens=87)
            assert status == 200 and headers["x-ratelimit-remaining-tokens"] == "0"
            assert owed() == pytest.approx(18, abs=0.5)
            # 18 + (4 + 81) = 103: over by 3 tokens, which drain in 60 s * 3 / 100 = 1.8 s.
            status, headers, refusal = await complete(stack, http, max_tokens=81)
            assert status == 429 and headers["Retry-After"] == "2"
            assert (refusal["error"]["type"], refusal["error"]["code"]) == ("tokens", "rate_limit_exceeded")
            assert owed() == pytest.approx(18, abs=0.5)  # a refusal charges nothing
            # Alone over the limit, it could never pass: 400 naming max_tokens, no Retry-After to wait on.
            status, headers, refusal = await complete(stack, http, max_tokens=97)
            assert status == 400 and "Retry-After" not in headers
            assert refusal["error"]["param"] == "max_tokens" and "101 tokens" in refusal["error"]["message"]

    path = tenants_file(tmp_path, "{tokens_per_minute: 100}")
    try:
        run_on_stack(tokenizer_address, Script(text_ids[:5]), body, tenants_file=path, redis_url=redis_url)
    finally:
        bucket.close()


def test_the_concurrency_cap_refuses_over_grpc_until_a_request_finishes(
    tokenizer_address, text_ids, tmp_path: Path, redis_url: str
) -> None:
    metadata = tuple(KEY.items())

    async def body(stack: Stack) -> None:
        request = generation_pb2.GenerateRequest(prompt_token_ids={"ids": PROMPT})
        streams = [stack.generation.GenerateStream(request, metadata=metadata) for _ in range(2)]
        for stream in streams:
            await stream.read()  # admitted and running: its first token is out
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stack.generation.Generate(request, metadata=metadata)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "Concurrency limit reached for tenant 'acme': 2 requests running" in refused.value.details()
        assert dict(refused.value.trailing_metadata())["retry-after"] == "1"
        stack.scheduler.release()
        for stream in streams:
            while await stream.read() != grpc.aio.EOF:
                pass
        # Each slot was freed before its last chunk went out, so the next request passes at once.
        reply = await stack.generation.Generate(request, metadata=metadata)
        assert reply.finish_reason == sampling_pb2.FINISH_REASON_STOP

    path = tenants_file(tmp_path, "{max_concurrent: 2}")
    script = Script(text_ids[:4], hold_after=1)
    run_on_stack(tokenizer_address, script, body, tenants_file=path, redis_url=redis_url)


def test_a_named_request_keeps_its_slot_after_its_client_leaves_until_it_ends(
    tokenizer_address, text_ids, tmp_path: Path, redis_url: str
) -> None:
    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            gone = asyncio.create_task(complete(stack, http, **{"X-Request-Id": "line-1"}))
            while not stack.scheduler.records:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            gone.cancel()  # the client leaves; its named request runs on (request_attach.py)
            await asyncio.gather(gone, return_exceptions=True)
            await asyncio.sleep(2.5)  # longer than the lease: the gateway renews it meanwhile
            status, _, refusal = await complete(stack, http)
            assert status == 429 and refusal["error"]["type"] == "requests"
            stack.scheduler.release()  # it runs to its end with nobody reading it
            deadline = time.monotonic() + 3
            while (status := (await complete(stack, http))[0]) == 429 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert status == 200
        assert "line-1" not in stack.scheduler.cancelled

    path = tenants_file(tmp_path, "{max_concurrent: 1}")
    script = Script(text_ids[:4], hold_after=1)
    # A lease of 2 s, renewed every 0.67 s: long enough that the in-process stack's event loop, busy
    # on a loaded machine, does not let it lapse between renewals.
    run_on_stack(tokenizer_address, script, body, tenants_file=path, redis_url=redis_url, rate_limit_lease_s=2.0)


def test_redis_down_lets_requests_through_counted_and_logged(
    tokenizer_address, text_ids, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            before = await metric(stack, http, "shardline_gateway_rate_limits_unchecked_total", tenant="acme")
            started = time.perf_counter()
            statuses = [(await complete(stack, http))[0] for _ in range(3)]
            elapsed = time.perf_counter() - started
            assert statuses == [200, 200, 200]  # over the limit of 1, but nothing can count it: fail open
            after = await metric(stack, http, "shardline_gateway_rate_limits_unchecked_total", tenant="acme")
            assert after == before + 3
            assert elapsed < 1.5  # one failed try, then Redis is left alone: no timeout per request
        assert any("Redis unreachable" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)

    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    path = tenants_file(tmp_path, "{requests_per_minute: 1, max_concurrent: 1}")
    with caplog.at_level(logging.WARNING, logger="gateway.tenancy.tenant_limiter"):
        run_on_stack(tokenizer_address, Script(text_ids[:3]), body, tenants_file=path, redis_url=dead)


def test_tenants_without_limits_cost_no_redis_round_trip(tokenizer_address, text_ids, tmp_path: Path) -> None:
    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                status, headers, _ = await complete(stack, http, authorization="Bearer k-open")
                assert status == 200 and not any(h.startswith("x-ratelimit") for h in headers)
            # With Redis unreachable, any try would have been counted as let through unchecked.
            assert await metric(stack, http, "shardline_gateway_rate_limits_unchecked_total", tenant="open") == 0

    dead = f"redis://127.0.0.1:{free_port()}/0"
    path = tenants_file(tmp_path, "{requests_per_minute: 1}")
    run_on_stack(tokenizer_address, Script(text_ids[:3]), body, tenants_file=path, redis_url=dead)


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.0, "0ms"), (0.0201, "21ms"), (1.5, "1.5s"), (20.0, "20s"), (360.0, "6m0s")]
)
def test_reset_headers_read_as_openai_writes_them(seconds: float, text: str) -> None:
    assert duration_text(seconds) == text
