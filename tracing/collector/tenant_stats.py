"""The dashboard's per-tenant view: the stored requests' rows (dashboard_stats.py) summed by tenant.

It covers the requests whose spans the store still holds, so it tells how tenants fared lately;
Prometheus' counters on the gateway's /metrics (shardline_tenant_*) keep the totals since start.
"""

import math
from dataclasses import dataclass, field

from tracing.collector.dashboard_stats import RUNNING, RequestSummary

OUTCOMES = ("met", "missed", "refused")


@dataclass(slots=True)
class TenantSummary:
    """One row of the tenants table."""

    # The tenant's name; "" for requests refused before the gateway named their tenant.
    tenant: str
    requests: int = 0
    # Of those, not finished yet.
    running: int = 0
    # Failed (finish reason error, or a failed span), SLO refusals included.
    errors: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    # TTFT of the requests that had a first token, nearest-rank percentiles.
    ttft_ms: list[float] = field(default_factory=list)
    # Requests with a TTFT target, by outcome: met, missed, refused.
    slo: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))

    def add(self, row: RequestSummary) -> None:
        self.requests += 1
        self.running += row.status == RUNNING
        self.errors += row.status == "error" or bool(row.error)
        self.input_tokens += row.input_tokens or 0
        self.output_tokens += row.output_tokens or 0
        if row.ttft_ms is not None:
            self.ttft_ms.append(row.ttft_ms)
        if row.slo_outcome in self.slo:
            self.slo[row.slo_outcome] += 1

    def to_json(self) -> dict[str, object]:
        """The row as an ``/api/tenants`` JSON object."""
        judged = sum(self.slo.values())
        return {
            "tenant": self.tenant,
            "requests": self.requests,
            "running": self.running,
            "errors": self.errors,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "ttft_p50_ms": _round(percentile(self.ttft_ms, 50)),
            "ttft_p99_ms": _round(percentile(self.ttft_ms, 99)),
            "slo": dict(self.slo),
            # Met over all that had a target; None when none had one.
            "slo_attainment": round(self.slo["met"] / judged, 4) if judged else None,
        }


def percentile(values: list[float], p: float) -> float | None:
    """The nearest-rank percentile: a value that occurred, so p99 of a few requests is their slowest."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def by_tenant(rows: list[RequestSummary]) -> list[TenantSummary]:
    """The rows summed per tenant, the tenants in name order."""
    tenants: dict[str, TenantSummary] = {}
    for row in rows:
        tenants.setdefault(row.tenant, TenantSummary(row.tenant)).add(row)
    return [tenants[name] for name in sorted(tenants)]
