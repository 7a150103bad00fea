"""Tenants: who an API key belongs to, its share of service and its class, from SHARDLINE_TENANTS_FILE.

The file is YAML; keys are stored as the sha256 hex digest of the key, never in clear
(`printf '%s' "$KEY" | sha256sum` gives it):

    tenants:
      acme:
        weight: 2          # share of service within its priority class (default 1)
        priority: 0        # its class: its requests may ask for a later class, never an earlier one
        keys: [9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08]
        limits: {requests_per_minute: 600, tokens_per_minute: 200000, max_concurrent: 32}
        slo: {ttft_target_ms: 1000, refuse_late: true}   # defaults for its requests (gateway/tenancy/slo_params.py)

The gateway re-reads it when its modification time or size changes, checked at most once a
second, so keys and weights change without a restart; a file that no longer parses is logged
and the previous tenants stay.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateway.tenancy.slo_params import MAX_TTFT_TARGET_S, Slo

log = logging.getLogger(__name__)

DIGEST_CHARS = 64  # a sha256 hex digest
OWNER_CHARS = 32  # the owner a request is stored with is the key digest's first 32 characters
RELOAD_CHECK_S = 1.0  # how often a lookup may stat the file for a change


def key_digest(key: str) -> str:
    """The sha256 hex digest of an API key, as the tenants file stores it."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's limits, as the file gives them; None is no limit. The gateway enforces them across
    all gateways through Redis (gateway/tenancy/tenant_limiter.py); each choice of a request counts as one."""

    requests_per_minute: int | None = None  # requests admitted per minute
    tokens_per_minute: int | None = None  # prompt + max_tokens admitted per minute, unused ones given back
    max_concurrent: int | None = None  # requests unfinished at once

    @property
    def enforced(self) -> bool:
        """Whether there is any limit: a tenant without one costs its requests no Redis round trip."""
        return (
            self.requests_per_minute is not None
            or self.tokens_per_minute is not None
            or (self.max_concurrent is not None)
        )


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant: the name its requests carry to the scheduler, Redis and spans, and its share."""

    name: str  # unique; the scheduler's fair queue counts service per name
    weight: float = 1.0  # share of service within its priority class, relative to other tenants'
    priority: int | None = None  # the earliest class its requests may ask for; None leaves theirs
    limits: TenantLimits = field(default_factory=TenantLimits)
    slo: Slo = Slo()  # its requests' TTFT target and refuse_late, where they name none

    def priority_for(self, requested: int) -> int:
        """The class a request of this tenant that asked for `requested` is queued in (lower is earlier)."""
        return requested if self.priority is None else max(requested, self.priority)


# Every request when there is no tenants file, and those of SHARDLINE_API_KEYS keys when there is
# one: a single tenant, so the queue's order within a class is arrival order, as without tenants.
DEFAULT_TENANT = Tenant("default")


class _LimitsEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    max_concurrent: int | None = Field(None, ge=1)


class _SloEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ttft_target_ms: float | None = Field(None, gt=0, le=MAX_TTFT_TARGET_S * 1000)
    refuse_late: bool = False

    def slo(self) -> Slo:
        return Slo(None if self.ttft_target_ms is None else self.ttft_target_ms / 1000.0, self.refuse_late)


class _TenantEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight: float = Field(1.0, gt=0)
    priority: int = Field(0, ge=-(2**31), lt=2**31)
    keys: list[str] = []
    limits: _LimitsEntry = _LimitsEntry()
    slo: _SloEntry = _SloEntry()

    @field_validator("weight")
    @classmethod
    def _finite(cls, weight: float) -> float:
        if not math.isfinite(weight):
            raise ValueError("must be a finite number")
        return weight

    @field_validator("keys")
    @classmethod
    def _digests(cls, keys: list[str]) -> list[str]:
        digests = [key.strip().lower() for key in keys]
        for digest in digests:
            if len(digest) != DIGEST_CHARS or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(f"{digest[:12]!r}...: each key must be its sha256 hex digest (64 characters)")
        return digests


class _TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: dict[str, _TenantEntry]


class TenantsFileError(ValueError):
    """The tenants file cannot be read, or does not describe tenants."""


@dataclass(frozen=True, slots=True)
class TenantTable:
    """The tenants of one version of the file, by the digest of each of their keys."""

    tenants: dict[str, Tenant]  # by name
    by_digest: dict[str, Tenant]  # by each key's sha256 hex digest
    by_owner: dict[str, Tenant]  # by each key's owner (its digest's first OWNER_CHARS characters)


def parse_tenants(text: str, source: str = "tenants file") -> TenantTable:
    """The tenants a tenants file's text describes; TenantsFileError names what is wrong."""
    try:
        parsed = _TenantsFile.model_validate(yaml.safe_load(text) or {})
    except (yaml.YAMLError, ValidationError) as exc:
        raise TenantsFileError(f"{source}: {exc}") from exc
    tenants: dict[str, Tenant] = {}
    by_digest: dict[str, Tenant] = {}
    for name, entry in parsed.tenants.items():
        if not name or len(name) > 64 or not all(c.isalnum() or c in "._-" for c in name):
            raise TenantsFileError(f"{source}: tenant {name!r}: names are 1-64 letters, digits, '.', '_' or '-'")
        if entry.slo.refuse_late and entry.slo.ttft_target_ms is None:
            raise TenantsFileError(f"{source}: tenant {name!r}: slo.refuse_late needs slo.ttft_target_ms")
        limits = TenantLimits(**entry.limits.model_dump())
        tenant = Tenant(name, entry.weight, entry.priority, limits, entry.slo.slo())
        tenants[name] = tenant
        for digest in entry.keys:
            if digest in by_digest:
                raise TenantsFileError(f"{source}: key {digest[:12]}... belongs to {by_digest[digest].name!r} too")
            by_digest[digest] = tenant
    by_owner = {digest[:OWNER_CHARS]: tenant for digest, tenant in by_digest.items()}
    return TenantTable(tenants, by_digest, by_owner)


class TenantDirectory:
    """The tenants file, kept current: a lookup stats the file at most every `check_interval_s`
    and re-reads it only when it changed, so requests never read it themselves."""

    def __init__(self, path: str | Path, check_interval_s: float = RELOAD_CHECK_S) -> None:
        self._path = Path(path)
        self._check_interval_s = check_interval_s
        self._version = self._stat()
        self._table = self._read()  # a file that does not parse at start fails the start
        self._checked = time.monotonic()

    def table(self) -> TenantTable:
        """The current tenants, re-read first if the file changed since the last check."""
        now = time.monotonic()
        if now - self._checked >= self._check_interval_s:
            self._checked = now
            self._reload_if_changed()
        return self._table

    def close(self) -> None:
        """Nothing to release for a file (the Redis source stops its thread)."""

    def knows(self, digest: str) -> bool:
        """Whether a key, by its digest, belongs to a tenant."""
        return digest in self.table().by_digest

    def for_owner(self, owner: str) -> Tenant:
        """The tenant of the key a request's owner was made from; the default tenant for other keys."""
        return self.table().by_owner.get(owner, DEFAULT_TENANT)

    def _reload_if_changed(self) -> None:
        try:
            version = self._stat()
        except TenantsFileError as exc:
            log.error("%s; keeping the tenants read before", exc)
            return
        if version == self._version:
            return
        try:
            table = self._read()
        except TenantsFileError as exc:
            log.error("%s; keeping the tenants read before", exc)
            return
        self._version, self._table = version, table
        log.info("tenants file %s reloaded: %d tenants, %d keys", self._path, len(table.tenants), len(table.by_digest))

    def _stat(self) -> tuple[int, int]:
        try:
            stat = os.stat(self._path)
        except OSError as exc:
            raise TenantsFileError(f"tenants file {self._path}: {exc.strerror}") from exc
        return stat.st_mtime_ns, stat.st_size

    def _read(self) -> TenantTable:
        try:
            text = self._path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TenantsFileError(f"tenants file {self._path}: {exc}") from exc
        return parse_tenants(text, f"tenants file {self._path}")


def tenant_of(directory: TenantDirectory | None, owner: str) -> Tenant:
    """The tenant a request with `owner` counts against: the default one without a tenants file."""
    return DEFAULT_TENANT if directory is None else directory.for_owner(owner)
