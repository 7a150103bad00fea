"""`python -m scheduler_svc.main`: flags, serving, and a clean exit on SIGTERM."""

import re
import signal
import subprocess
import sys
import time

import grpc

from scheduler_svc.main import parse_args
from shardline.proto import scheduler_pb2, scheduler_pb2_grpc


def test_flags_override_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("SHARDLINE_QUEUE_CAPACITY", "7")
    monkeypatch.setenv("SHARDLINE_PORT", "6000")
    settings, level = parse_args(["--port", "7000", "--redis-url", "redis://r:1/0", "--no-tracing"])
    assert (settings.port, settings.redis_url, settings.queue_capacity, settings.tracing) == (
        7000,
        "redis://r:1/0",
        7,
        False,
    )
    assert level == "INFO"


def test_serves_until_sigterm(redis_url: str) -> None:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "scheduler_svc.main",
            "--port",
            "0",
            "--host",
            "127.0.0.1",
            "--redis-url",
            redis_url,
            "--no-tracing",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        port = None
        while port is None and time.monotonic() < deadline:
            line = process.stderr.readline()
            assert line, "the scheduler exited before serving"
            if match := re.search(r"serving on port (\d+)", line):
                port = int(match.group(1))
        assert port is not None
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stats = scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)
        assert stats.workers == 0
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()
