"""`shardline up` as a newcomer meets it: progress, endpoints (the trace dashboard's among them) and
errors on the console, each service's whole log in a file, and `shardline status` on the running stack."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.e2e.http_client import get, post
from tests.e2e.up_process import INFO_RECORD, UpProcess

pytestmark = pytest.mark.slow

SERVICES = ("tracing", "tokenizer", "scheduler", "worker-0", "gateway", "batch-0")


@pytest.fixture(scope="module")
def up(tmp_path_factory) -> Iterator[UpProcess]:
    stack = UpProcess(tmp_path_factory.mktemp("up-console"))
    try:
        stack.wait_for(r"^Ctrl-C stops everything", timeout_s=240)
        status, _ = post(
            f"http://127.0.0.1:{stack.http_port}/v1/completions",
            {"prompt": "Hello", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert status == 200
        yield stack
    finally:
        stack.stop()


def test_the_console_shows_progress_and_endpoints_with_the_dashboard_but_no_info_lines(up):
    out = up.output
    assert f"  logs in {up.data_dir}/logs/<service>.log (--verbose shows them here)" in out
    assert f"  OpenAI HTTP   http://127.0.0.1:{up.http_port}/v1 " in out
    assert f"  traces        http://127.0.0.1:{up.dashboard_port}/   (dashboard; OTLP on :{up.otlp_port})" in out
    assert f"  status        shardline status --data-dir {up.data_dir}" in out
    assert f"  batches       http://127.0.0.1:{up.http_port}/v1/batches   (1 batch worker(s);" in out
    for name in SERVICES:
        assert f"] {name:<10} ready" in out
    assert not INFO_RECORD.findall(out), out


def test_the_printed_dashboard_answers(up):
    status, page = get(f"http://127.0.0.1:{up.dashboard_port}/", timeout=10)
    assert status == 200, page[:500]


def test_each_services_whole_log_is_a_file_under_the_data_folder(up):
    for name in SERVICES:
        log = (up.data_dir / "logs" / f"{name}.log").read_text()
        assert INFO_RECORD.search(log), f"{name}.log:\n{log}"


def test_status_reports_the_services_the_workers_the_queue_and_redis(up):
    done = up.status()
    assert done.returncode == 0, done
    out = done.stdout
    assert out.startswith(f"shardline stack on {up.data_dir}: up ")
    for name in SERVICES:
        assert f"\n  {name:<12}up    " in out, out
    assert f"dashboard http://127.0.0.1:{up.dashboard_port}/" in out
    assert "\nworkers: 1 registered\n  worker-0    alive 127.0.0.1:" in out, out
    assert "running 0/" in out and "waiting 0  KV " in out and " blocks (" in out
    assert "\nqueue: 0 queued\n  0 running on 1 live worker(s)" in out, out
    assert "\nredis: redis://127.0.0.1:" in out and " reachable, version " in out
    keys = int(out.split("  keys ")[1].split()[0])
    assert keys > 0  # the completion's record, at least


def test_a_killed_service_is_reported_on_the_console_and_status_follows_its_restart(up):
    def tokenizer_pid() -> int:
        state = json.loads((up.data_dir / "stack.json").read_text())
        return next(s["pid"] for s in state["services"] if s["name"] == "tokenizer")

    killed = tokenizer_pid()
    os.killpg(killed, signal.SIGKILL)
    up.wait_for(r"^shardline: tokenizer exited \(code -9\); restarting it now$", timeout_s=30)
    deadline = time.monotonic() + 120
    while (tokenizer_pid() == killed or up.status().returncode != 0) and time.monotonic() < deadline:
        time.sleep(0.5)
    done = up.status()
    assert done.returncode == 0 and tokenizer_pid() != killed, done
    assert not INFO_RECORD.findall(up.output), up.output


def test_batch_commands_find_the_running_stack_by_its_folder(up, tmp_path):
    """`shardline batch` reaches the gateway of the stack on --data-dir, with no --url: a batch submitted
    so runs on the stack's own batch worker."""
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi", "max_tokens": 2}}
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps(line) + "\n")
    command = [
        sys.executable,
        "-m",
        "shardline.cli.main",
        "batch",
        "submit",
        str(data),
        "--endpoint",
        "/v1/completions",
    ]
    done = subprocess.run(
        [*command, "--wait", "--data-dir", str(up.data_dir)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done
    listed = subprocess.run(
        [sys.executable, "-m", "shardline.cli.main", "batch", "list", "--data-dir", str(up.data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0 and "completed" in listed.stdout, listed
