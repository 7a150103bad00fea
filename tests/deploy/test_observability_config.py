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
    """Each quantity of the dashboard's time view that a Prometheus metric exports has a panel here, named as
    its chart in tracing/collector/dashboard/time_view.js (which adds the unit). MFU, MBU, step time, KV blocks
    and failovers have no metric, so no panel; the 429s panel is the failures chart less its failovers."""
    panels = {panel["title"]: panel for panel in json.loads(next(DASHBOARDS.glob("*.json")).read_text())["panels"]}
    charts = set(re.findall(r'^  \["\w+", "([^"]+)"', TIME_VIEW.read_text(), re.MULTILINE))
    assert len(charts) >= 10, charts
    shared = {  # panel: (the time view's chart, a metric the panel must read)
        "Time to first token (TTFT)": (
            "Time to first token (TTFT), ms",
            "gen_ai_server_time_to_first_token_seconds_bucket",
        ),
        "Time per output token (TPOT)": (
            "Time per output token (TPOT), ms",
            "gen_ai_server_time_per_output_token_seconds_bucket",
        ),
        "Queue depth and requests in flight": ("Queue depth and requests in flight", "shardline_running_requests"),
        "Generation throughput per worker": (
            "Generation throughput per worker, tokens / s",
            "shardline_generation_tokens_per_second",
        ),
        "Batch size per worker": ("Batch size per worker", "shardline_running_requests"),
        "429s and errors / s": ("429s, errors and failovers / s", "shardline_gateway_refused_total"),
    }
    for title, (chart, metric) in shared.items():
        assert chart in charts, (chart, charts)
        used = {name for target in panels[title]["targets"] for name in metric_names(target["expr"])}
        assert metric in used and used <= exported_metrics(), (title, used)
    refused, errors = panels["429s and errors / s"]["targets"]
    assert (refused["legendFormat"], errors["legendFormat"]) == ("429s", "errors")
    assert metric_names(refused["expr"]) == {"shardline_gateway_refused_total", "shardline_gateway_throttled_total"}
    assert metric_names(errors["expr"]) == {"shardline_requests_total"} and '"error"' in errors["expr"]


def test_a_misspelt_metric_is_caught():
    """The negative control of the check above."""
    expr = 'histogram_quantile(0.9, sum by (le) (rate(gen_ai_server_ttft_seconds_bucket{job="gateway"}[5m])))'
    assert metric_names(expr) == {"gen_ai_server_ttft_seconds_bucket"}
    assert not metric_names(expr) <= exported_metrics()
    assert label_names('sum by (model) (shardline_queue_depth{jbo="scheduler"})') == {"model", "jbo"}
