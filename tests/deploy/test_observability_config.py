"""Prometheus scrape configs and the Grafana provisioning agree with what the services export."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.deploy.compose_project import REPO, resolved_config
from tests.deploy.promql import (
    DASHBOARDS,
    dashboard_queries,
    exported_labels,
    exported_metrics,
    label_names,
    metric_names,
)

PROMETHEUS = REPO / "deploy" / "prometheus"
PROVISIONING = REPO / "deploy" / "grafana" / "provisioning"
TIME_VIEW = REPO / "tracing" / "collector" / "dashboard" / "time_view.js"
# Where each compose service serves /metrics: the variable holding its port.
METRICS_PORT = {
    "gateway": "SHARDLINE_HTTP_PORT",
    "scheduler": "SHARDLINE_METRICS_PORT",
    "gpu-worker": "SHARDLINE_METRICS_PORT",
    "batch": "SHARDLINE_BATCH_HEALTH_PORT",
}


@pytest.fixture(scope="module")
def services() -> dict:
    return resolved_config("--profile", "observability")["services"]


def test_compose_scrape_jobs_reach_each_metrics_port(services):
    scrape = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert set(jobs) == set(METRICS_PORT)
    for name, job in jobs.items():
        (sd,) = job["dns_sd_configs"]
        assert sd["names"] == [name] and sd["type"] == "A"
        assert str(sd["port"]) == services[name]["environment"][METRICS_PORT[name]], name


def test_prometheus_reads_the_config_it_is_given(services):
    prometheus = services["prometheus"]
    (flag,) = [arg for arg in prometheus["command"] if arg.startswith("--config.file=")]
    mounts = {m["target"]: m["source"] for m in prometheus["volumes"] if m["type"] == "bind"}
    assert mounts[flag.split("=", 1)[1]] == str(PROMETHEUS / "prometheus.yml")


def test_kubernetes_scrape_config_names_jobs_after_the_pods():
    scrape = yaml.safe_load((PROMETHEUS / "kubernetes.yml").read_text())
    (job,) = scrape["scrape_configs"]
    assert job["kubernetes_sd_configs"][0]["role"] == "pod"
    targets = {rule.get("target_label"): rule for rule in job["relabel_configs"]}
    assert targets["job"]["source_labels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_name"]


def test_grafana_provisioning_matches_compose_and_the_dashboards(services):
    grafana = services["grafana"]
    mounts = {m["target"]: m["source"] for m in grafana["volumes"] if m["type"] == "bind"}
    assert mounts["/etc/grafana/provisioning"] == str(PROVISIONING)
    datasources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"]
    (prometheus,) = datasources
    assert prometheus["type"] == "prometheus" and prometheus["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((PROVISIONING / "dashboards" / "shardline.yml").read_text())["providers"]
    assert mounts[provider["options"]["path"]] == str(DASHBOARDS)
    for path in DASHBOARDS.glob("*.json"):
        dashboard = json.loads(path.read_text())
        for panel in dashboard["panels"]:
            assert panel["datasource"]["uid"] == prometheus["uid"], panel["title"]


def test_dashboard_panels_are_well_formed():
    (path,) = DASHBOARDS.glob("*.json")
    dashboard = json.loads(path.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"]
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr


def test_dashboard_shows_latency_throughput_queue_and_kv_usage():
    used = {name for _where, expr in dashboard_queries() for name in metric_names(expr)}
    assert {
        "gen_ai_server_time_to_first_token_seconds_bucket",
        "gen_ai_server_time_per_output_token_seconds_bucket",
        "shardline_generation_tokens_per_second",
        "gen_ai_server_request_duration_seconds_count",
        "shardline_queue_depth",
        "shardline_kv_cache_usage_ratio",
    } <= used


def test_every_dashboard_query_uses_metrics_and_labels_the_code_defines():
    defined = exported_metrics() | {"up"}  # `up`: Prometheus's own, per target
    labels = {"job", "instance", "le"} | exported_labels()
    for where, expr in dashboard_queries():
        names = metric_names(expr)
        assert names, (where, expr)
        assert names <= defined, (where, names - defined)
        assert label_names(expr) <= labels, (where, label_names(expr) - labels)


def test_the_dashboard_charts_what_the_time_view_charts_under_the_same_names():
    """Every chart of the dashboard's time view has a panel here reading the same quantity, named as the
    chart in tracing/collector/dashboard/time_view.js, less the unit the chart's title adds (Grafana shows it
    on the axis). The time view's failures chart also counts the Submits a full scheduler queue refused."""
    panels = {panel["title"]: panel for panel in json.loads(next(DASHBOARDS.glob("*.json")).read_text())["panels"]}
    charts = set(re.findall(r'^  \["\w+", "([^"]+)"', TIME_VIEW.read_text(), re.MULTILINE))
    shared = {  # the time view's chart: (its panel, the metrics the panel must read)
        "Requests / s, by model and tenant": (
            "Requests / s, by model and tenant",
            {"gen_ai_server_request_duration_seconds_count", "shardline_tenant_requests_total"},
        ),
        "Output tokens / s, by model and tenant": (
            "Output tokens / s, by model and tenant",
            {"shardline_generation_tokens_total", "shardline_tenant_generation_tokens_total"},
        ),
        "Time to first token (TTFT), ms": (
            "Time to first token (TTFT)",
            {"gen_ai_server_time_to_first_token_seconds_bucket"},
        ),
        "Time per output token (TPOT), ms": (
            "Time per output token (TPOT)",
            {"gen_ai_server_time_per_output_token_seconds_bucket"},
        ),
        "Queue depth and requests in flight": (
            "Queue depth and requests in flight",
            {"shardline_queue_depth", "shardline_running_requests"},
        ),
        "429s, errors and failovers / s": (
            "429s, errors and failovers / s",
            {
                "shardline_gateway_refused_total",
                "shardline_gateway_throttled_total",
                "shardline_requests_total",
                "shardline_failovers_total",
            },
        ),
        "Generation throughput per worker, tokens / s": (
            "Generation throughput per worker",
            {"shardline_generation_tokens_per_second"},
        ),
        "Batch size per worker": ("Batch size per worker", {"shardline_running_requests"}),
        "Step time per worker, ms": (
            "Step time per worker",
            {"shardline_engine_step_duration_seconds_sum", "shardline_engine_step_duration_seconds_count"},
        ),
        "KV blocks in use per worker": ("KV blocks in use per worker", {"shardline_kv_blocks_used"}),
        "MFU and MBU per worker": (
            "MFU and MBU per worker",
            {"shardline_model_flops_utilization", "shardline_model_bandwidth_utilization"},
        ),
    }
    assert charts == set(shared), charts ^ set(shared)
    for title, metrics in shared.values():
        used = {name for target in panels[title]["targets"] for name in metric_names(target["expr"])}
        assert used == metrics and used <= exported_metrics(), (title, used)
    refused, errors, failovers = panels["429s, errors and failovers / s"]["targets"]
    assert [t["legendFormat"] for t in (refused, errors, failovers)] == ["429s", "errors", "failovers"]
    assert '"error"' in errors["expr"]
    per_worker = [title for title, _ in shared.values() if title.endswith("per worker")]
    for title in per_worker:  # a worker's own series, not the zeros the other services export
        assert all('job="gpu-worker"' in t["expr"] for t in panels[title]["targets"]), title


def test_a_misspelt_metric_is_caught():
    """The negative control of the check above."""
    expr = 'histogram_quantile(0.9, sum by (le) (rate(gen_ai_server_ttft_seconds_bucket{job="gateway"}[5m])))'
    assert metric_names(expr) == {"gen_ai_server_ttft_seconds_bucket"}
    assert not metric_names(expr) <= exported_metrics()
    assert label_names('sum by (model) (shardline_queue_depth{jbo="scheduler"})') == {"model", "jbo"}
