"""The commands of docker-compose.yml are real: they run, find each other, and serve a completion.

Every Shardline service is started from its resolved compose `command` and `environment`
(with .env.example as .env) as a local process; see local_compose.py for the one
translation, the network. Redis is the test session's redis-server.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest
import yaml

from tests.deploy.compose_project import REPO, SHARDLINE_SERVICES, resolved_config
from tests.deploy.local_compose import LocalCompose
from tests.deploy.promql import SAMPLE_SUFFIXES, dashboard_metric_names

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(redis_server, tmp_path_factory):
    compose = LocalCompose(
        resolved_config(), list(SHARDLINE_SERVICES), redis_server, tmp_path_factory.mktemp("compose-logs")
    )
    try:
        compose.up(timeout_s=300)
    except Exception:
        compose.down(grace_s=5)
        for service in compose.running:
            print(f"----- {service.name}\n{compose.log_tail(service)}")
        raise
    yield compose
    if any(service.proc.poll() is None for service in compose.running):
        compose.down(grace_s=5)
    compose.kill_leftovers()


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return reply.status, reply.read()


def test_each_compose_command_is_shardline_serve(stack):
    for service in stack.running:
        assert service.argv[2:5] == ["shardline", "serve", service.argv[4]]
        assert service.argv[4] in ("tokenizer", "scheduler", "worker", "gateway", "tracing", "batch")
        assert service.proc.poll() is None, f"{service.name} died:\n{stack.log_tail(service)}"


@pytest.fixture(scope="module")
def completion(stack) -> dict:
    """One /v1/completions request through the gateway that compose publishes."""
    http = f"http://{stack.local_address('gateway', 8000)}"
    return _post(
        f"{http}/v1/completions",
        {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
    )


def test_completion_end_to_end(completion):
    (choice,) = completion["choices"]
    assert choice["text"].strip()
    assert choice["finish_reason"] in ("length", "stop")
    assert 0 < completion["usage"]["completion_tokens"] <= 8


def test_spans_reach_the_tracing_service(stack, completion):
    """SHARDLINE_OTLP_ENDPOINT=tracing:4317 leads every service's spans to the tracing service."""
    request_id = completion["id"]
    dashboard = f"http://{stack.local_address('tracing', 8080)}"
    deadline = time.monotonic() + 30
    while True:
        rows = json.loads(_get(f"{dashboard}/api/requests?limit=20")[1])["requests"]
        row = next((r for r in rows if r["request_id"] == request_id), None)
        # Complete once the gateway's root span, which ends last, has been exported too.
        if row is not None and row["output_tokens"] is not None:
            break
        assert time.monotonic() < deadline, f"no complete trace of {request_id}: {rows}"
        time.sleep(0.5)
    assert row["output_tokens"] == completion["usage"]["completion_tokens"]
    services = {instance.split("-")[0] for instance in row["instances"]}
    assert services == {"gateway", "tokenizer", "scheduler", "worker"}, row["instances"]


def test_prometheus_targets_serve_the_dashboard_metrics(stack, completion):
    """Each scrape target of deploy/prometheus/prometheus.yml answers /metrics on the port compose
    gives it, and together they export every metric the Grafana dashboard queries."""
    scrape = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    exported: set[str] = set()
    for job in scrape["scrape_configs"]:
        for sd in job["dns_sd_configs"]:
            for name in sd["names"]:
                status, body = _get(f"http://{stack.local_address(name, sd['port'])}/metrics")
                assert status == 200, job["job_name"]
                text = body.decode()
                # A labelled metric with no sample yet is still declared by its TYPE line.
                for name, kind in re.findall(r"^# TYPE (\S+) (\S+)", text, re.M):
                    exported |= {name, *(name + suffix for suffix in SAMPLE_SUFFIXES.get(kind, ()))}
    assert dashboard_metric_names() - exported == {"up"}  # `up` is Prometheus's own
    # The request above was timed where Prometheus looks for it.
    gateway = _get(f"http://{stack.local_address('gateway', 8000)}/metrics")[1].decode()
    count = re.search(r"^gen_ai_server_time_to_first_token_seconds_count\{[^}]*\} (\S+)", gateway, re.M)
    assert count and float(count[1]) >= 1


def test_compose_down_stops_everything_with_no_orphans(stack):
    codes = stack.down()
    # Every service handles SIGTERM by draining and exiting 0, within compose's grace period.
    assert codes == {name: 0 for name in SHARDLINE_SERVICES}, {
        s.name: stack.log_tail(s, 1500) for s in stack.running if codes[s.name] != 0
    }
    time.sleep(0.5)
    assert stack.leftover_processes() == []
