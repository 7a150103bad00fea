"""The report of a multi-tenant run: per tenant, then Jain's index over the backlogged ones and goodput."""

from __future__ import annotations

import statistics

from shardline.bench.fairness import backlog_fraction, jain_index, offered_in, served_in
from shardline.bench.metrics import percentile
from shardline.bench.tenant_load import SentRequest, TenantRun
from shardline.bench.tenant_workload import TenantSpec, TenantWorkload


def _p50_p99(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    ordered = sorted(v * 1000 for v in values)
    return {"p50": statistics.median(ordered), "p99": percentile(ordered, 99)}


def _good(r: SentRequest, tenant: TenantSpec) -> bool:
    """Goodput's test: completed, and within every SLO the tenant gives. A refused request is not good."""
    t = r.timing
    return t.ok and not r.cancelled and bool(t.chunk_times) and tenant.slos.met_by(t)


def tenant_report(tenant: TenantSpec, requests: list[SentRequest], workload: TenantWorkload, wall_s: float) -> dict:
    """One tenant's figures: counts over the whole run, service and backlog within the window."""
    start, end = workload.measure_from_s, workload.duration_s
    window = end - start
    done = [r for r in requests if r.timing.ok and not r.cancelled and r.timing.chunk_times]
    failed = [r for r in requests if not r.timing.ok and not r.cancelled]
    judged = [r for r in requests if not r.cancelled]  # a request the benchmark cut off has no verdict
    service = served_in(requests, start, end)
    good = sum(_good(r, tenant) for r in judged)
    errors: dict[str, int] = {}
    for r in failed:
        errors[r.timing.error] = errors.get(r.timing.error, 0) + 1
    return {
        "sent": len(requests),
        "completed": len(done),
        "failed": len(failed),
        "throttled_429": sum(r.timing.status == 429 for r in failed),
        "refused_503": sum(r.timing.status == 503 for r in failed),
        "cancelled_at_end": sum(r.cancelled for r in requests),
        "input_tokens": service.input_tokens,
        "output_tokens": round(service.output_tokens, 1),
        "weighted_tokens": round(service.weighted, 1),
        "weighted_per_weight": service.weighted / tenant.weight,
        "output_throughput": service.output_tokens / window,
        "weighted_throughput": service.weighted / window,
        "offered_weighted_throughput": offered_in(requests, tenant.input_len, tenant.output_len, start, end) / window,
        "backlog_fraction": backlog_fraction(requests, start, end),
        "ttft_ms": _p50_p99([r.timing.ttft for r in done]),
        "tpot_ms": _p50_p99([r.timing.tpot for r in done if r.timing.tpot is not None]),
        "good": good,
        "slo_attainment": good / len(judged) if tenant.slos.given() and judged else None,
        "goodput": good / wall_s if tenant.slos.given() else None,
        "errors": errors,
    }


def workload_report(workload: TenantWorkload, run: TenantRun) -> dict:
    """Every tenant's report, and the run's: who was backlogged, Jain's index over them, goodput."""
    tenants = {t.name: tenant_report(t, run.requests[t.name], workload, run.wall_s) for t in workload.tenants}
    weights = {t.name: t.weight for t in workload.tenants}
    backlogged = [n for n, r in tenants.items() if r["backlog_fraction"] >= workload.backlog_threshold]
    served = sum(tenants[n]["weighted_throughput"] for n in backlogged)
    for name, r in tenants.items():
        # Its fair share, were every backlogged tenant (and it) to split what they were served by weight.
        pool = backlogged if name in backlogged else [*backlogged, name]
        share = served * weights[name] / sum(weights[n] for n in pool) if pool else 0.0
        r["fair_share_throughput"] = share
        r["offered_over_fair_share"] = r["offered_weighted_throughput"] / share if share else None
    with_slos = [t for t in workload.tenants if t.slos.given()]
    judged = sum(tenants[t.name]["sent"] - tenants[t.name]["cancelled_at_end"] for t in with_slos)
    good = sum(tenants[t.name]["good"] for t in with_slos)
    return {
        "window_s": [workload.measure_from_s, workload.duration_s],
        "wall_s": run.wall_s,
        "backlog_threshold": workload.backlog_threshold,
        "backlogged": backlogged,
        "jain_index": jain_index(tenants[n]["weighted_per_weight"] for n in backlogged) if backlogged else None,
        "goodput": good / run.wall_s if with_slos else None,
        "good": good,
        "slo_attainment": good / judged if judged else None,
        "tenants": tenants,
    }


def _cell(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def print_report(report: dict) -> None:
    """The per-tenant table, then the run's fairness and goodput."""
    tenants = report["tenants"]
    names = list(tenants)
    rows = [
        ("sent", lambda r: r["sent"]),
        ("completed", lambda r: r["completed"]),
        ("throttled (429)", lambda r: r["throttled_429"]),
        ("refused (503)", lambda r: r["refused_503"]),
        ("other failures", lambda r: r["failed"] - r["throttled_429"] - r["refused_503"]),
        ("cancelled at the end", lambda r: r["cancelled_at_end"]),
        ("input tokens served", lambda r: r["input_tokens"]),
        ("output tokens served", lambda r: r["output_tokens"]),
        ("weighted (in + 2 x out)", lambda r: r["weighted_tokens"]),
        ("output tok/s", lambda r: r["output_throughput"]),
        ("weighted tok/s", lambda r: r["weighted_throughput"]),
        ("offered / fair share", lambda r: r["offered_over_fair_share"]),
        ("backlogged share", lambda r: r["backlog_fraction"]),
        ("TTFT p50 (ms)", lambda r: r["ttft_ms"]["p50"]),
        ("TTFT p99 (ms)", lambda r: r["ttft_ms"]["p99"]),
        ("TPOT p50 (ms)", lambda r: r["tpot_ms"]["p50"]),
        ("TPOT p99 (ms)", lambda r: r["tpot_ms"]["p99"]),
        ("SLO attainment", lambda r: r["slo_attainment"]),
        ("goodput (req/s)", lambda r: r["goodput"]),
    ]
    start, end = report["window_s"]
    print(
        f"\nwindow {start:g}-{end:g} s of the run (tokens served, throughput, backlog); wall {report['wall_s']:.1f} s"
    )
    print(f"{'tenant':<26}" + "".join(f"{n[:13]:>14}" for n in names))
    for label, get in rows:
        print(f"{label:<26}" + "".join(f"{_cell(get(tenants[n])):>14}" for n in names))
    backlogged = report["backlogged"]
    print(
        f"backlogged (a request waiting >= {report['backlog_threshold']:.0%} of the window): "
        + (", ".join(backlogged) if backlogged else "none")
    )
    if report["jain_index"] is not None:
        print(f"Jain's index over their weighted tokens per weight: {report['jain_index']:.3f}")
    if report["goodput"] is not None:
        print(
            f"goodput: {report['goodput']:.3f} req/s ({report['good']} good; "
            f"attainment {_cell(report['slo_attainment'])})"
        )
    for name, r in tenants.items():
        for error, count in r["errors"].items():
            print(f"{name}: {count} failed with {error}")
