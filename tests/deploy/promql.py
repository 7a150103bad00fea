"""Metric names in PromQL, and the names Shardline's code exports: enough to check a dashboard."""

from __future__ import annotations

import json
import re

from prometheus_client.metrics import MetricWrapperBase

from tests.deploy.compose_project import REPO

DASHBOARDS = REPO / "deploy" / "grafana" / "dashboards"
# The samples Prometheus stores for one metric of each type.
SAMPLE_SUFFIXES = {
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "counter": ("_total", "_created"),
    "gauge": (),
    "summary": ("_count", "_sum", "_created"),
}
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}
_LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*(\w+)\s*\)")


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (label names, functions and keywords left out)."""
    if match := _LABEL_VALUES.fullmatch(expr.strip()):
        return {match[1]}
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges, $__rate_interval included
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.$])([a-zA-Z_:][\w:]*)(\s*\()?", expr):
        if not match[2] and match[1].lower() not in _KEYWORDS:
            names.add(match[1])
    return names


def label_names(expr: str) -> set[str]:
    """Labels an expression matches on or groups by."""
    if match := _LABEL_VALUES.fullmatch(expr.strip()):
        return {match[2]}
    labels = set()
    for matchers in re.findall(r"\{([^}]*)\}", re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)):
        labels |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
    for grouping in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        labels |= {label.strip() for label in grouping.split(",") if label.strip()}
    return labels


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and templating query of every dashboard."""
    queries = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        dashboard = json.loads(path.read_text())
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                queries.append((f"{path.name}: {panel['title']}", target["expr"]))
        for variable in dashboard.get("templating", {}).get("list", []):
            if variable.get("type") == "query":
                query = variable["query"]
                text = query["query"] if isinstance(query, dict) else query
                queries.append((f"{path.name}: ${variable['name']}", text))
    return queries


def dashboard_metric_names() -> set[str]:
    return {name for _where, expr in dashboard_queries() for name in metric_names(expr)}


def _code_metrics() -> list[MetricWrapperBase]:
    """Every metric the services' modules define: tracing/metrics.py's, the gateway's and the batch service's."""
    import batch_svc.metrics
    import gateway.metrics
    import gateway.runner.admission
    import gateway.tenancy.tenant_limiter
    import tracing.metrics

    modules = (
        tracing.metrics,
        gateway.metrics,
        gateway.runner.admission,
        gateway.tenancy.tenant_limiter,
        batch_svc.metrics,
    )
    found = {id(m): m for module in modules for m in vars(module).values() if isinstance(m, MetricWrapperBase)}
    return list(found.values())


def exported_metrics() -> set[str]:
    """The sample names of every metric the services' code defines (_code_metrics)."""
    samples: set[str] = set()
    for metric in _code_metrics():
        for family in metric.describe():
            samples |= {family.name + suffix for suffix in ("", *SAMPLE_SUFFIXES[family.type])}
    return samples


def exported_labels() -> set[str]:
    """The label names of those metrics."""
    return {label for metric in _code_metrics() for label in metric._labelnames}
