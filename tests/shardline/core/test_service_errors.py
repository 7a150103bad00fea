"""A service that cannot start says why in one line and exits non-zero: no traceback, nothing left running."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from shardline.core.ports import free_port
from shardline.core.service_main import redacted

NO_REDIS = "redis://127.0.0.1:1/0"  # nothing listens on port 1


def serve(service: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardline.cli.main", "serve", service, *args],
        env={**os.environ, "SHARDLINE_TRACING": "0", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("service", "args", "env", "code", "says"),
    [
        ("gateway", [], {"SHARDLINE_HTTP_PORT": "99999"}, 2, "SHARDLINE_HTTP_PORT (--http-port) input should be less"),
        ("gateway", [], {"SHARDLINE_REQUEST_TIMEOUT_S": "soon"}, 2, "SHARDLINE_REQUEST_TIMEOUT_S"),
        ("tokenizer", ["--port", "99999"], {}, 2, "SHARDLINE_PORT (--port)"),
        (
            "scheduler",
            ["--port", "0", "--redis-url", NO_REDIS],
            {},
            1,
            "scheduler cannot start: redis unavailable: Error 111 connecting",
        ),
        ("scheduler", ["--port", "0", "--redis-url", "notaurl"], {}, 1, "scheduler cannot start: Redis URL must"),
        ("scheduler", ["--queue-capacity", "0"], {}, 2, "SHARDLINE_QUEUE_CAPACITY"),
        (
            "tracing",
            ["--otlp-port", "0", "--http-port", "0", "--redis-url", NO_REDIS],
            {},
            1,
            "tracing cannot start: Error 111 connecting",
        ),
        ("tracing", ["--otlp-port", "70000"], {}, 2, "SHARDLINE_OTLP_PORT"),
        ("worker", [], {"SHARDLINE_DEVICE": "gpu"}, 2, 'SHARDLINE_DEVICE (--device) must be "auto", "cpu" or "cuda"'),
    ],
)
def test_bad_settings_and_unreachable_dependencies(service, args, env, code, says):
    done = serve(service, *args, **env)
    assert done.returncode == code, done.stderr
    assert says in done.stderr
    assert "Traceback" not in done.stderr


def test_a_taken_http_port_stops_the_gateway_cleanly():
    """It used to leave its gRPC server and stream hub running into interpreter exit (and sometimes
    segfaulted there)."""
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", port := free_port()))
        taken.listen()
        done = serve(
            "gateway",
            "--http-port",
            str(port),
            "--grpc-port",
            "0",
            "--scheduler-address",
            "127.0.0.1:1",
            SHARDLINE_REQUEST_TIMEOUT_S="5",
        )
    assert done.returncode == 1, done.stderr
    assert "gateway cannot start" in done.stderr and "address already in use" in done.stderr
    assert (
        "Traceback" not in done.stderr and "never awaited" not in done.stderr and "Exception ignored" not in done.stderr
    )


def test_passwords_are_kept_out_of_logs():
    assert redacted("redis://:s3cr3t@10.0.0.5:6380/3") == "redis://:***@10.0.0.5:6380/3"
    assert redacted("rediss://app:pw@[::1]:6379/0") == "rediss://app:***@[::1]:6379/0"
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_a_failure_after_the_start_keeps_its_traceback(caplog):
    """Only a service that never served reports a failed start in one line: a Redis error hours in
    is the run's failure, and whoever reads the log needs its traceback."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    import shardline.core.service_main as service_main

    def fails_before() -> None:
        raise RedisConnectionError("Error 111 connecting to redis:6379")

    def fails_after() -> None:
        service_main.started()
        raise RedisConnectionError("Connection reset by peer")

    try:
        assert service_main.run_service("scheduler", fails_before) == 1
        assert service_main.run_service("scheduler", fails_after) == 1
    finally:
        service_main._started = False
    before, after = caplog.records
    assert before.getMessage() == "scheduler cannot start: Error 111 connecting to redis:6379" and not before.exc_info
    assert after.getMessage() == "scheduler failed" and after.exc_info is not None
