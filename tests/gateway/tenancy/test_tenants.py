"""The tenants file: parsing, hashed keys, reload on change, and the tenant a request carries."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from gateway.tenancy.auth import ApiKeys
from gateway.tenancy.tenants import (
    DEFAULT_TENANT,
    TenantDirectory,
    TenantLimits,
    TenantsFileError,
    key_digest,
    parse_tenants,
    tenant_of,
)
from shardline.core.errors import Unauthenticated
from shardline.proto import generation_pb2
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.scripted_scheduler import Script
from tracing import attributes as attr

ACME, FREE = key_digest("k-acme"), key_digest("k-free")
FILE = f"""
tenants:
  acme:
    weight: 2.5
    priority: 0
    keys: [{ACME.upper()}]
    limits: {{requests_per_minute: 600, max_concurrent: 8}}
  free:
    priority: 3
    keys:
      - {FREE}
"""


def _write(path: Path, text: str) -> None:
    path.write_text(text)
    stat = path.stat()  # a later mtime even on a coarse clock, as an edit a second later would have
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


def test_a_file_maps_key_digests_to_tenants() -> None:
    table = parse_tenants(FILE)
    acme, free = table.tenants["acme"], table.tenants["free"]
    assert (acme.weight, acme.priority, acme.limits) == (2.5, 0, TenantLimits(600, None, 8))
    assert (free.weight, free.priority) == (1.0, 3)
    assert table.by_digest == {ACME: acme, FREE: free}  # digests are kept lower case
    assert table.by_owner[ACME[:32]] is acme


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tenants: {a: {keys: [abc]}}", "sha256 hex digest"),
        (f"tenants: {{a: {{keys: [{ACME}]}}, b: {{keys: [{ACME}]}}}}", "belongs to 'a' too"),
        ("tenants: {a: {weight: 0}}", "greater than 0"),
        ("tenants: {a: {weight: .inf}}", "finite"),
        ("tenants: {a: {wieght: 2}}", "wieght"),
        ("tenants: {'a b': {}}", "names are"),
        ("tenants: [a, b]", "tenants"),
        ("tenants: {a: {", "tenants file"),
    ],
)
def test_a_bad_file_is_refused_naming_the_problem(text: str, message: str) -> None:
    with pytest.raises(TenantsFileError, match=message):
        parse_tenants(text)


def test_priority_is_the_earliest_class_a_tenant_may_ask_for() -> None:
    table = parse_tenants(FILE)
    assert [table.tenants["free"].priority_for(p) for p in (-1, 0, 3, 7)] == [3, 3, 3, 7]
    assert [DEFAULT_TENANT.priority_for(p) for p in (-1, 0, 7)] == [-1, 0, 7]  # as without tenants


def test_the_file_is_reloaded_when_it_changes_and_a_broken_one_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    _write(path, FILE)
    directory = TenantDirectory(path, check_interval_s=0)
    assert directory.knows(ACME) and directory.for_owner(FREE[:32]).name == "free"

    _write(path, f"tenants: {{acme: {{weight: 4, keys: [{ACME}]}}}}")
    assert directory.for_owner(ACME[:32]).weight == 4
    assert not directory.knows(FREE)  # a key taken out of the file is refused from then on
    assert directory.for_owner(FREE[:32]) is DEFAULT_TENANT

    _write(path, "tenants: {acme: {weight: -1}}")
    assert directory.for_owner(ACME[:32]).weight == 4  # the previous tenants stay
    path.unlink()
    assert directory.knows(ACME)


def test_a_lookup_stats_the_file_at_most_once_an_interval(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    _write(path, FILE)
    directory = TenantDirectory(path, check_interval_s=3600)
    _write(path, "tenants: {}")
    assert directory.knows(ACME)  # not looked at again yet


def test_a_missing_or_broken_file_fails_the_start(tmp_path: Path) -> None:
    with pytest.raises(TenantsFileError, match="No such file"):
        TenantDirectory(tmp_path / "absent.yaml")
    (tmp_path / "bad.yaml").write_text("tenants: {a: {weight: x}}")
    with pytest.raises(TenantsFileError, match="weight"):
        TenantDirectory(tmp_path / "bad.yaml")


def test_api_keys_accept_the_files_keys_by_digest_and_the_settings_keys(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    _write(path, FILE)
    directory = TenantDirectory(path)
    keys = ApiKeys(["k-plain"], directory)
    for key in ("k-acme", "k-free", "k-plain"):
        keys.check(f"Bearer {key}")
    for authorization in ("Bearer k-other", None, "Basic k-acme"):
        with pytest.raises(Unauthenticated):
            keys.check(authorization)
    assert tenant_of(directory, keys.owner("Bearer k-acme")).name == "acme"
    assert tenant_of(directory, keys.owner("Bearer k-plain")) is DEFAULT_TENANT
    assert tenant_of(None, keys.owner("Bearer k-acme")) is DEFAULT_TENANT
    # A file with no tenants still turns keys on: it refuses everyone but SHARDLINE_API_KEYS.
    assert ApiKeys([], directory).enabled and not ApiKeys([]).enabled


def test_a_keys_tenant_weight_and_class_reach_the_scheduler(tokenizer_address, text_ids, tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    _write(path, FILE)

    async def body(stack: Stack) -> None:
        for key, priority in (("k-acme", 1), ("k-free", 1), ("k-plain", -1)):
            request = generation_pb2.GenerateRequest(prompt="hi", priority=priority)
            await stack.generation.Generate(request, metadata=[("authorization", f"Bearer {key}")])
        submitted = [(s.tenant, s.tenant_weight, s.priority) for s in stack.scheduler.submitted]
        assert submitted == [("acme", 2.5, 1), ("free", 1.0, 3), ("default", 1.0, -1)]
        tagged = [s.attributes[attr.TENANT] for s in stack.spans.get_finished_spans() if attr.TENANT in s.attributes]
        assert sorted(tagged) == ["acme", "default", "free"]  # one request span each

    # The file's keys also in SHARDLINE_API_KEYS, so that this holds whichever of the two lets them in.
    run_on_stack(tokenizer_address, Script(text_ids), body, api_keys="k-acme,k-free,k-plain", tenants_file=str(path))


def test_the_files_keys_alone_let_requests_in(tokenizer_address, text_ids, tmp_path: Path) -> None:
    """With no SHARDLINE_API_KEYS, the tenants file's keys are the gateway's keys: others get 401."""
    path = tmp_path / "tenants.yaml"
    _write(path, FILE)

    async def body(stack: Stack) -> None:
        await stack.generation.Generate(
            generation_pb2.GenerateRequest(prompt="hi"), metadata=[("authorization", "Bearer k-free")]
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stack.generation.Generate(
                generation_pb2.GenerateRequest(prompt="hi"), metadata=[("authorization", "Bearer k-unknown")]
            )
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert [s.tenant for s in stack.scheduler.submitted] == ["free"]

    run_on_stack(tokenizer_address, Script(text_ids), body, tenants_file=str(path))
