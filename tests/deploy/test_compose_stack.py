"""docker compose for real: the images built from this checkout, the CPU stack up on a Docker engine,
and what a user does with it, faults included.

Run after the suite (`.ci/run`): `pytest -m compose -s tests/deploy/test_compose_stack.py`. It
starts a Docker engine where it can (scripts/docker-engine.sh) and skips, saying why, where it
cannot. Base images come from Debian packages (docker/base-images.sh), so no registry is needed
but Debian's and PyPI; a local wheelhouse that pip is configured with (this machine's CPU torch)
is served to the build over HTTP, and the machine's CA bundle given as the build secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import json
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardline.client import ShardlineClient
from shardline.core.ports import free_port
from tests.chaos.streams import MAX_TOKENS, StreamResult, prompts, run_streams, summary
from tests.deploy.promql import dashboard_queries

pytestmark = [pytest.mark.compose, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
FILES = ("-f", "docker-compose.yml", "-f", "deploy/compose/cpu-worker.yml")
STREAMS = 16
WHEELHOUSE_PORT = 18765
BASE_IMAGES = {
    "PYTHON_IMAGE": "shardline-base/python:bookworm",
    "REDIS_IMAGE": "shardline-base/redis:bookworm",
    "PROMETHEUS_IMAGE": "shardline-base/prometheus:bookworm",
}


def _run(*command: str | Path, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in command], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, command))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return done


@dataclass(slots=True)
class ComposeStack:
    """The compose project under test: its settings file and the ports it publishes on this host."""

    project: str
    env_file: Path
    http_port: int
    grpc_port: int
    prometheus_port: int
    times: dict[str, float]

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        return _run(
            "docker", "compose", "-p", self.project, "--env-file", self.env_file, *FILES, *args,
            timeout=timeout, check=check,
        )  # fmt: skip

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def containers(self) -> list[dict]:
        out = self.compose("ps", "--all", "--format", "json").stdout
        # One JSON document per line in compose v2.2x and later; a list before.
        rows = [json.loads(line) for line in out.splitlines() if line.strip()]
        return rows[0] if len(rows) == 1 and isinstance(rows[0], list) else rows

    def wait_healthy(self, timeout_s: float = 240.0) -> None:
        """Every container of the project running and healthy (those with a healthcheck)."""
        deadline = time.monotonic() + timeout_s
        while True:
            rows = self.containers()
            bad = [f"{r['Name']}: {r['State']} {r.get('Health', '')}" for r in rows if not _healthy(r)]
            if rows and not bad:
                return
            assert time.monotonic() < deadline, f"not healthy after {timeout_s:.0f} s: {bad}"
            time.sleep(1)


def _healthy(row: dict) -> bool:
    return row["State"] == "running" and row.get("Health", "") in ("", "healthy")


def _pip_setting(name: str) -> str:
    done = subprocess.run([sys.executable, "-m", "pip", "config", "get", name], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def _local_wheelhouse() -> Path | None:
    """The local folder pip finds wheels in here (this machine's CPU torch), if it is configured with one."""
    for entry in (os.environ.get("PIP_FIND_LINKS", "") + " " + _pip_setting("global.find-links")).split():
        path = Path(urllib.parse.urlparse(entry).path if entry.startswith("file:") else entry)
        if path.is_dir() and any(path.glob("*.whl")):
            return path
    return None


@contextlib.contextmanager
def _served(folder: Path, host: str) -> Iterator[str]:
    """`folder` over plain HTTP on `host`, for pip's find-links inside the image build."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *_args: object) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(folder))
    try:
        # One port run after run: the URL is a build argument, and a new one would rebuild every layer after it.
        server = http.server.ThreadingHTTPServer((host, WHEELHOUSE_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer((host, 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def _bridge_address() -> str:
    """This host's address on Docker's default bridge, where the build's containers reach it."""
    inspect = "{{range .IPAM.Config}}{{.Gateway}}{{end}}"
    address = _run("docker", "network", "inspect", "bridge", "-f", inspect).stdout.strip()
    if not address:  # an engine that leaves the gateway out of IPAM: the docker0 interface has it
        interface = _run("ip", "-4", "-o", "addr", "show", "dev", "docker0").stdout.split()
        address = interface[interface.index("inet") + 1].split("/")[0]
    return address


def _build_settings() -> tuple[dict[str, str], Path | None]:
    settings = dict(BASE_IMAGES)
    ca = os.environ.get("PIP_CERT") or _pip_setting("global.cert") or "/etc/ssl/certs/ca-certificates.crt"
    if Path(ca).is_file():
        settings["BUILD_PIP_CA_BUNDLE"] = ca
    return settings, _local_wheelhouse()


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[ComposeStack]:
    engine = subprocess.run([str(REPO / "scripts" / "docker-engine.sh")], capture_output=True, text=True)
    if engine.returncode != 0:
        pytest.skip(f"no Docker engine here: {engine.stderr.strip().splitlines()[-1]}")
    print(f"\n{engine.stdout.strip()}")
    times: dict[str, float] = {}
    started = time.monotonic()
    _run(REPO / "docker" / "base-images.sh", timeout=900)
    times["base images"] = time.monotonic() - started
    bridge = _bridge_address()
    settings, wheelhouse = _build_settings()
    ports = {name: free_port() for name in ("GATEWAY_HTTP_PORT", "GATEWAY_GRPC_PORT", "PROMETHEUS_PORT")}
    ports["TRACING_DASHBOARD_PORT"] = free_port()
    env_file = tmp_path_factory.mktemp("compose") / ".env"
    project = f"shardline-test-{secrets.token_hex(3)}"
    running = ComposeStack(
        project, env_file, ports["GATEWAY_HTTP_PORT"], ports["GATEWAY_GRPC_PORT"], ports["PROMETHEUS_PORT"], times
    )
    with contextlib.ExitStack() as cleanup:
        if wheelhouse is not None:
            url = cleanup.enter_context(_served(wheelhouse, bridge))
            # torch's CPU build is in the wheelhouse: no separate index for it.
            settings |= {"BUILD_PIP_FIND_LINKS": url, "BUILD_PIP_TRUSTED_HOST": bridge, "BUILD_CPU_TORCH_INDEX_URL": ""}
        settings |= {name: str(port) for name, port in ports.items()}
        settings["REDIS_PASSWORD"] = secrets.token_hex(12)
        env_file.write_text("".join(f"{name}={value}\n" for name, value in settings.items()))
        started = time.monotonic()
        running.compose("build", timeout=1800)
        times["build"] = time.monotonic() - started
        images = _run("docker", "images", "-q", "shardline/service").stdout.split()
        assert images, "docker compose build left no shardline/service image"
        started = time.monotonic()
        try:
            running.compose("up", "-d", "--wait", timeout=600)
            running.wait_healthy(timeout_s=60)  # every service there and healthy, whatever compose answered
            times["up"] = time.monotonic() - started
            print("compose: " + ", ".join(f"{what} {seconds:.0f} s" for what, seconds in times.items()))
            yield running
        finally:
            logs = running.compose("logs", "--no-color", "--tail", "40", check=False).stdout
            running.compose("--profile", "observability", "down", "-v", "--remove-orphans", "-t", "10", check=False)
            print(f"\ncompose timings: {times}\n--- last logs ---\n{logs[-6000:]}")


@pytest.fixture(scope="module")
def reference(stack: ComposeStack) -> dict[int, list[int]]:
    """Each prompt's tokens in a run with no fault."""
    results = asyncio.run(run_streams(stack.grpc_target, [f"reference-{i}" for i in range(STREAMS)], prompts(STREAMS)))
    assert all(r.finish_reason == "length" and len(r.tokens) == MAX_TOKENS for r in results), results
    return {i: r.tokens for i, r in enumerate(results)}


def _under_fault(stack: ComposeStack, reference: dict[int, list[int]], name: str, fault) -> list[StreamResult]:
    """16 streams; `fault` runs once each has a few tokens; every stream must end as in `reference`,
    directly or through a resume of a loud, resumable error."""
    stack.wait_healthy()

    async def body() -> list[StreamResult]:
        started = asyncio.Event()
        streams = asyncio.create_task(
            run_streams(
                stack.grpc_target,
                [f"{name}-{i}" for i in range(STREAMS)],
                prompts(STREAMS),
                started=started,
                started_after_tokens=2,
                resume_for_s=120,
            )
        )
        await asyncio.wait_for(started.wait(), 120)
        await asyncio.to_thread(fault)
        return await streams

    results = asyncio.run(body())
    print(f"\n{name}: {summary(results, reference)}")
    for i, result in enumerate(results):
        assert result.gaps == 0, (name, result)
        assert result.finish_reason == "length" and result.tokens == reference[i], (name, result)
    stack.wait_healthy()
    return results


def test_every_container_is_healthy_and_none_runs_as_root(stack):
    rows = stack.containers()
    assert {r["Service"] for r in rows} == {
        "redis", "tracing", "tokenizer", "scheduler", "gpu-worker", "gateway", "batch",
    }  # fmt: skip
    assert all(_healthy(r) for r in rows), rows
    for row in rows:
        uid = _run("docker", "exec", row["Name"], "id", "-u").stdout.strip()
        assert uid != "0", f"{row['Service']} runs as root"
    # The worker loaded the kernels built into the image (it has no compiler).
    worker_log = stack.compose("logs", "--no-color", "gpu-worker").stdout
    assert "CPU kernels loaded from /opt/venv/" in worker_log, worker_log[-3000:]
    assert "compiling" not in worker_log and "cannot run here" not in worker_log


def test_the_official_openai_client_streams(stack):
    from openai import OpenAI

    client = OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a river."}], max_tokens=16, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_a_four_line_batch_completes(stack, tmp_path):
    from openai import OpenAI

    client = OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused")
    lines = tmp_path / "batch.jsonl"
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 8}
    lines.write_text(
        "".join(
            json.dumps(
                {
                    "custom_id": f"line-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": body | {"messages": [{"role": "user", "content": f"Count to {i}"}]},
                }
            )
            + "\n"
            for i in range(4)
        )
    )
    upload = client.files.create(file=lines.open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 180
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(1)
    assert batch.status == "completed" and batch.request_counts.completed == 4, batch
    output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == [f"line-{i}" for i in range(4)]
    assert all(o["response"]["status_code"] == 200 for o in output)


def test_the_workers_process_killed_inside_its_container(stack, reference):
    kill = (
        "import os, signal\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "    argv = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')\n"
        "    if int(pid) != os.getpid() and b'serve' in argv and b'worker' in argv:\n"
        "        os.kill(int(pid), signal.SIGKILL)\n"
    )

    def fault() -> None:
        stack.compose("exec", "-T", "gpu-worker", "python", "-c", kill)

    results = _under_fault(stack, reference, "worker-killed", fault)
    with ShardlineClient(stack.grpc_target) as client:
        attempts = [client.get_request(r.request_id).attempt for r in results]
    assert max(attempts) >= 2, attempts  # they ran again, on the worker the container restarted


def test_redis_restarted(stack, reference):
    _under_fault(stack, reference, "redis-restarted", lambda: stack.compose("restart", "redis"))


def test_two_workers_both_serve(stack, reference):
    stack.compose("up", "-d", "--wait", "--scale", "gpu-worker=2")
    with ShardlineClient(stack.grpc_target) as client:
        deadline = time.monotonic() + 120
        while _live_workers(stack) < 2:
            assert time.monotonic() < deadline, "the second worker did not register"
            time.sleep(1)
        results = _under_fault(stack, reference, "two-workers", lambda: None)
        workers = {client.get_request(r.request_id).worker_id for r in results}
    assert len(workers) == 2, workers


def _live_workers(stack: ComposeStack) -> int:
    # The scheduler publishes no port: ask it from inside the compose network, through the gateway's
    # container, which has the SDK's stubs.
    probe = (
        "import grpc\n"
        "from shardline.proto import scheduler_pb2, scheduler_pb2_grpc\n"
        "with grpc.insecure_channel('scheduler:50053') as c:\n"
        "    print(len(scheduler_pb2_grpc.SchedulerStub(c).ListWorkers(scheduler_pb2.ListWorkersRequest()).workers))\n"
    )
    return int(stack.compose("exec", "-T", "gateway", "python", "-c", probe).stdout.strip())


def test_prometheus_scrapes_every_service_and_answers_every_dashboard_query(stack):
    stack.compose("--profile", "observability", "up", "-d", "--wait", "prometheus")
    api = f"http://127.0.0.1:{stack.prometheus_port}/api/v1"
    deadline = time.monotonic() + 120
    while True:
        targets = json.loads(urllib.request.urlopen(f"{api}/targets", timeout=5).read())["data"]["activeTargets"]
        jobs = {t["labels"]["job"] for t in targets if t["health"] == "up"}
        if jobs >= {"gateway", "scheduler", "gpu-worker", "batch"}:
            break
        assert time.monotonic() < deadline, [(t["labels"]["job"], t["health"], t.get("lastError")) for t in targets]
        time.sleep(2)
    with ShardlineClient(stack.grpc_target) as client:  # traffic inside the rate windows
        for i in range(6):
            client.generate(f"Prometheus probe {i}", max_tokens=4)
    missing: list[str] = []
    deadline = time.monotonic() + 90
    while True:
        missing = [where for where, expr in dashboard_queries() if not _promql_has_data(api, expr)]
        if not missing:
            break
        assert time.monotonic() < deadline, f"dashboard queries without data: {missing}"
        time.sleep(5)


def _promql_has_data(api: str, expr: str) -> bool:
    expr = expr.replace("$__rate_interval", "1m").replace("$model", ".*")
    if expr.startswith("label_values("):  # Grafana's, not PromQL: the series that carry the label
        metric, label = (part.strip() for part in expr.removeprefix("label_values(").removesuffix(")").split(","))
        expr = f"group by ({label}) ({metric})"
    url = f"{api}/query?{urllib.parse.urlencode({'query': expr})}"
    reply = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert reply["status"] == "success", (expr, reply)
    return bool(reply["data"]["result"])


def test_down_then_up_keeps_the_request_records(stack, reference):
    stack.compose("--profile", "observability", "down", "-t", "20")
    stack.compose("up", "-d", "--wait", timeout=600)
    with ShardlineClient(stack.grpc_target) as client:
        for i in (0, STREAMS - 1):
            info = client.get_request(f"reference-{i}")
            assert info.status == "finished" and list(info.output_token_ids) == reference[i], info


def test_with_no_worker_left_a_request_fails_with_503_and_says_why(stack):
    stack.compose("stop", "gpu-worker")
    started = time.monotonic()
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"{stack.http_url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=120)
    waited = time.monotonic() - started
    assert refused.value.code == 503 and int(refused.value.headers["Retry-After"]) >= 1
    message = json.loads(refused.value.read())["error"]["message"]
    assert "no live worker serves the model" in message, message
    # The scheduler's bound (30 s, from when the worker left) and a sweep, not the request's 600 s deadline.
    assert 25 < waited < 60, waited
    print(f"\nno worker left: 503 after {waited:.1f} s: {message}")
