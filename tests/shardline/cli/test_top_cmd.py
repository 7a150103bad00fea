"""`shardline top` in a pseudo-terminal against a real tracing service: it renders, refreshes with what
arrives, and leaves cleanly on q and on Ctrl-C, giving the terminal back."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pexpect
import pytest

from shardline.cli.top_cmd import LEAVE
from shardline.core.ports import free_port
from tests.tracing.collector.fake_request import SpanFactory
from tests.tracing.collector.series_load import at, request, worker_steps
from tests.tracing.collector.served_request import to_otlp
from tracing.collector.otlp_receiver import series_resolutions
from tracing.collector.span_store import SpanStore
from tracing.collector.stored_span import StoredSpan
from tracing.settings import TracingSettings

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow  # starts the tracing service as a process


def seed(redis_url: str, spans: list[StoredSpan]) -> None:
    async def add() -> None:
        store = SpanStore.from_url(
            redis_url, max_spans=100_000, max_age_s=3600, series=series_resolutions(TracingSettings())
        )
        try:
            await store.add(to_otlp(spans))
        finally:
            await store.close()

    asyncio.run(add())


@pytest.fixture
def dashboard(redis_url: str) -> Iterator[str]:
    """A real `shardline serve tracing` on free ports, over the test's Redis."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "shardline.cli.main", "serve", "tracing", "--otlp-port", "0", "--http-port", str(port),
         "--host", "127.0.0.1", "--redis-url", redis_url],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def top(url: str, interval: float = 0.5) -> pexpect.spawn:
    return pexpect.spawn(
        sys.executable,
        ["-m", "shardline.cli.main", "top", "--url", url, "--interval", str(interval)],
        cwd=str(REPO),
        dimensions=(40, 120),
        encoding="utf-8",
        timeout=30,
    )


def test_top_renders_refreshes_with_new_spans_and_quits_on_q(redis_url: str, dashboard: str) -> None:
    f = SpanFactory()
    now = time.time()
    seed(redis_url, at(request(f, "r-1", "acme", 42.0) + worker_steps(f, "worker-0", 0, 1000), now - 3))
    view = top(dashboard)
    try:
        view.expect("requests/s")
        view.expect("TTFT p50 / p99 ms")
        view.expect("worker-0")
        assert "worker-1" not in view.before
        # A second worker's steps arrive; a later screen shows it without a restart.
        seed(redis_url, at(worker_steps(f, "worker-1", 0, 1000), time.time() - 2))
        view.expect("worker-1")
        view.send("q")
        view.expect(pexpect.EOF)
    finally:
        view.close()
    assert view.exitstatus == 0, view.before
    assert LEAVE in view.before  # the terminal's own screen and cursor are given back
    assert "Traceback" not in view.before


def test_top_leaves_cleanly_on_ctrl_c_and_says_when_the_dashboard_is_gone(redis_url: str, dashboard: str) -> None:
    view = top(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    try:
        view.expect("does not answer")
        view.expect("retrying every 0.5 s")
        view.sendintr()
        view.expect(pexpect.EOF)
    finally:
        view.close()
    assert view.exitstatus == 0 and "Traceback" not in view.before


def test_top_off_a_terminal_prints_one_screen(redis_url: str, dashboard: str) -> None:
    f = SpanFactory()
    seed(redis_url, at(request(f, "r-1", "acme", 42.0) + worker_steps(f, "worker-0", 0, 1000), time.time() - 3))
    done = subprocess.run(
        [sys.executable, "-m", "shardline.cli.main", "top", "--url", dashboard],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"shardline top  {dashboard}")
    requests = next(line for line in lines if line.startswith("requests/s")).split()
    assert requests[1:] == ["0.10", "0.02"]  # one request over 10 s and over 60 s
    assert any(line.startswith("worker-0") for line in lines)
    unreachable = subprocess.run(
        [sys.executable, "-m", "shardline.cli.main", "top", "--url", f"http://127.0.0.1:{free_port()}"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert unreachable.returncode == 1 and unreachable.stdout == ""
    assert (
        unreachable.stderr.startswith("shardline top: the trace dashboard at") and "Traceback" not in unreachable.stderr
    )
