"""A multi-tenant workload for `shardline bench --tenants FILE`: who sends what, how often, under which SLOs.

The file is YAML (or JSON, which YAML reads as well):

    duration_s: 60          # each tenant sends for this long; tokens served are counted up to here
    measure_from_s: 10      # ...and from here: the queues fill first (default 0)
    drain: false            # at duration_s, cancel what is in flight (default true: wait for it)
    backlog_threshold: 0.9  # backlogged: a request waiting for its first token this share of the window
    seed: 0
    tenants:
      heavy:
        api_key: sk-heavy   # sent as 'Authorization: Bearer'; or api_key_env: HEAVY_KEY
        weight: 1           # its weight in the server's tenants file: fairness compares service / weight
        request_rate: 10    # open loop: requests/s, gamma gaps of shape burstiness (1: Poisson)...
        burstiness: 1
        # concurrency: 8    # ...or closed loop: this many in flight at once (exactly one of the two)
        max_requests: 2000  # optional cap on the requests it sends
        input_len: 128
        output_len: 64
        priority: 0         # sent as the body's priority (vLLM's field)
        ttft_target_ms: 1000
        refuse_late: true
        slo: {ttft_ms: 1000, tpot_ms: 200}   # goodput: a request is good when it meets both
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shardline.bench.metrics import Slos


class WorkloadError(ValueError):
    """A workload file that does not describe a run: one line naming the file and the field."""


@dataclass(slots=True)
class TenantSpec:
    """One tenant's share of the load."""

    name: str
    api_key: str | None = None  # None: no Authorization header
    weight: float = 1.0  # its weight on the server: its fair share is weight / the backlogged tenants' sum
    request_rate: float | None = None  # open loop, requests/s; None: closed loop at `concurrency`
    burstiness: float = 1.0  # the gamma shape of the gaps between arrivals, as vLLM's --burstiness
    concurrency: int | None = None  # closed loop: requests in flight at once
    max_requests: int | None = None  # None: as many as the duration takes
    input_len: int = 128
    output_len: int = 64
    priority: int | None = None  # None: not sent (the server's default class)
    ttft_target_ms: float | None = None
    refuse_late: bool | None = None
    slos: Slos = field(default_factory=Slos)

    def body_fields(self) -> dict:
        """The OpenAI body's extension fields this tenant sends with each request."""
        fields = {"priority": self.priority, "ttft_target_ms": self.ttft_target_ms, "refuse_late": self.refuse_late}
        return {k: v for k, v in fields.items() if v is not None}


@dataclass(slots=True)
class TenantWorkload:
    """Every tenant's load, run at once for `duration_s`."""

    tenants: list[TenantSpec]
    duration_s: float = 60.0
    measure_from_s: float = 0.0  # the window of fairness and throughput is [measure_from_s, duration_s]
    drain: bool = True  # wait for the requests in flight at duration_s; False cancels them
    backlog_threshold: float = 0.9
    seed: int = 0

    @property
    def window_s(self) -> float:
        return self.duration_s - self.measure_from_s


class _SloEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ttft_ms: float | None = Field(None, gt=0)
    tpot_ms: float | None = Field(None, gt=0)
    e2el_ms: float | None = Field(None, gt=0)


class _TenantEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    api_key: str | None = None
    api_key_env: str | None = None
    weight: float = Field(1.0, gt=0, allow_inf_nan=False)
    request_rate: float | None = Field(None, gt=0, allow_inf_nan=False)
    burstiness: float | None = Field(None, gt=0, allow_inf_nan=False)
    concurrency: int | None = Field(None, ge=1)
    max_requests: int | None = Field(None, ge=1)
    input_len: int = Field(128, ge=1)
    output_len: int = Field(64, ge=1)
    priority: int | None = Field(None, ge=-(2**31), lt=2**31)
    ttft_target_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    refuse_late: bool | None = None
    slo: _SloEntry = _SloEntry()

    @model_validator(mode="after")
    def _consistent(self) -> _TenantEntry:
        # Each message names its field first: the loader puts the tenant's path before it.
        if (self.request_rate is None) == (self.concurrency is None):
            raise ValueError("request_rate: give request_rate (open loop) or concurrency (closed loop), one of them")
        if self.burstiness is not None and self.request_rate is None:
            raise ValueError("burstiness: shapes request_rate's arrivals; a closed loop has none")
        if self.refuse_late and self.ttft_target_ms is None:
            raise ValueError("refuse_late: needs ttft_target_ms, the target to be late against")
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("api_key: give api_key or api_key_env, not both")
        return self


class _WorkloadEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    duration_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    measure_from_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    drain: bool = True
    backlog_threshold: float = Field(0.9, gt=0, le=1)
    seed: int = 0
    tenants: dict[str, _TenantEntry] = Field(min_length=1)

    @model_validator(mode="after")
    def _window(self) -> _WorkloadEntry:
        if self.measure_from_s >= self.duration_s:
            raise ValueError("measure_from_s: must be below duration_s, or the window is empty")
        return self


def load_workload(path: Path) -> TenantWorkload:
    """The workload a YAML or JSON file describes; WorkloadError says in one line what is wrong."""
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise WorkloadError(f"{path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise WorkloadError(f"{path}: not YAML or JSON{where}: {getattr(exc, 'problem', exc)}") from exc
    return parse_workload(raw, str(path))


def parse_workload(raw: object, source: str = "workload") -> TenantWorkload:
    """The workload of a parsed file's contents; `source` starts each error's line."""
    if not isinstance(raw, dict):
        raise WorkloadError(f"{source}: must be a mapping with a 'tenants' mapping")
    try:
        entry = _WorkloadEntry.model_validate(raw)
    except ValidationError as exc:
        raise WorkloadError(f"{source}: {_first_error(exc)}") from None
    tenants = [_tenant(name, t, source) for name, t in entry.tenants.items()]
    return TenantWorkload(
        tenants, entry.duration_s, entry.measure_from_s, entry.drain, entry.backlog_threshold, entry.seed
    )


def _tenant(name: str, t: _TenantEntry, source: str) -> TenantSpec:
    key = t.api_key
    if t.api_key_env is not None:
        key = os.environ.get(t.api_key_env)
        if not key:
            raise WorkloadError(f"{source}: tenants.{name}.api_key_env: ${t.api_key_env} is not set")
    return TenantSpec(
        name=name,
        api_key=key,
        weight=t.weight,
        request_rate=t.request_rate,
        burstiness=t.burstiness if t.burstiness is not None else 1.0,
        concurrency=t.concurrency,
        max_requests=t.max_requests,
        input_len=t.input_len,
        output_len=t.output_len,
        priority=t.priority,
        ttft_target_ms=t.ttft_target_ms,
        refuse_late=t.refuse_late,
        slos=Slos(t.slo.ttft_ms, t.slo.tpot_ms, t.slo.e2el_ms),
    )


def _first_error(exc: ValidationError) -> str:
    """pydantic's first error as `tenants.heavy.request_rate: must be above 0`."""
    error = exc.errors()[0]
    loc = ".".join(str(part) for part in error["loc"])
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "missing":
        message = "is required"
    elif error["type"] == "extra_forbidden":
        message = "is not a field of a workload (a typo?)"
    elif error["type"] == "too_short" and loc == "tenants":
        message = "needs at least one tenant"
    field_first, _, rest = message.partition(": ")
    if rest and field_first.isidentifier():  # a model check named its own field: put it on the path
        loc, message = f"{loc}.{field_first}" if loc else field_first, rest
    return f"{loc}: {message}" if loc else message
