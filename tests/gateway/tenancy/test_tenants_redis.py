"""Tenants from a Redis key (SHARDLINE_TENANTS_REDIS_KEY), against a real Redis: read at start,
polled for changes, the previous tenants kept while the key is broken, gone or unreadable."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from pydantic import ValidationError

from gateway.settings import GatewaySettings
from gateway.tenancy.tenants import DEFAULT_TENANT, TenantsFileError
from gateway.tenancy.tenants_redis import RedisTenantDirectory
from shardline.proto import generation_pb2
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.scripted_scheduler import Script
from tests.gateway.tenancy.test_tenants import ACME, FILE, FREE


def _until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not reached"
        time.sleep(0.02)


def test_the_key_is_polled_for_changes_and_a_broken_or_missing_one_keeps_the_tenants(redis_url: str) -> None:
    admin = redis.Redis.from_url(redis_url)
    key = f"shardline:tenants:{uuid.uuid4().hex}"
    with pytest.raises(TenantsFileError, match="not set in Redis"):
        RedisTenantDirectory(redis_url, key)  # missing at start: the start fails, as with a file
    admin.set(key, FILE)
    directory = RedisTenantDirectory(redis_url, key, check_interval_s=0.05)
    try:
        assert directory.knows(ACME) and directory.for_owner(FREE[:32]).name == "free"

        admin.set(key, f"tenants: {{acme: {{weight: 4, keys: [{ACME}]}}}}")  # every gateway sees the change
        _until(lambda: directory.for_owner(ACME[:32]).weight == 4)
        assert not directory.knows(FREE) and directory.for_owner(FREE[:32]) is DEFAULT_TENANT

        admin.set(key, "tenants: {acme: {weight: -1}}")
        time.sleep(0.3)  # several polls
        assert directory.for_owner(ACME[:32]).weight == 4  # the previous tenants stay
        admin.delete(key)
        time.sleep(0.3)
        assert directory.knows(ACME)
    finally:
        directory.close()
        admin.delete(key)
        admin.close()
    assert not directory._thread.is_alive()


def test_one_source_of_tenants_and_the_key_needs_a_redis() -> None:
    with pytest.raises(ValidationError, match="not both"):
        GatewaySettings(tenants_file="t.yaml", tenants_redis_key="k", redis_url="redis://127.0.0.1:1")
    with pytest.raises(ValidationError, match="needs redis_url"):
        GatewaySettings(tenants_redis_key="k")


def test_a_gateway_takes_its_tenants_and_keys_from_the_redis_key(tokenizer_address, text_ids, redis_url) -> None:
    admin = redis.Redis.from_url(redis_url)
    key = f"shardline:tenants:{uuid.uuid4().hex}"
    admin.set(key, FILE)

    async def body(stack: Stack) -> None:
        for api_key in ("k-acme", "k-free"):
            await stack.generation.Generate(
                generation_pb2.GenerateRequest(prompt="hi"), metadata=[("authorization", f"Bearer {api_key}")]
            )
        assert [(s.tenant, s.tenant_weight) for s in stack.scheduler.submitted] == [("acme", 2.5), ("free", 1.0)]

    try:
        run_on_stack(tokenizer_address, Script(text_ids), body, redis_url=redis_url, tenants_redis_key=key)
    finally:
        admin.delete(key)
        admin.close()
