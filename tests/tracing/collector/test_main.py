"""`shardline serve tracing` as a process: health, spans in over OTLP, dashboard out, clean SIGTERM."""

import json
import signal
import subprocess
import sys
import time
import urllib.request

from shardline.core.ports import free_port
from shardline.stack.health_probe import grpc_serving
from tracing import attributes as attr
from tracing.otel_setup import setup_tracing


def _until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _rows(url: str) -> list[dict]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())["requests"]


def test_receives_spans_serves_them_and_stops_on_sigterm(redis_url: str) -> None:
    otlp, http = free_port(), free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardline.cli.main",
            "serve",
            "tracing",
            "--host",
            "127.0.0.1",
            "--otlp-port",
            str(otlp),
            "--http-port",
            str(http),
            "--redis-url",
            redis_url,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        _until(lambda: proc.poll() is not None or grpc_serving(f"127.0.0.1:{otlp}"))
        assert proc.poll() is None, proc.stdout.read().decode()
        handle = setup_tracing("gateway", "gateway-7", endpoint=f"127.0.0.1:{otlp}", install_global=False)
        with handle.tracer.start_as_current_span(
            "gateway.request",
            attributes={
                attr.REQUEST_ID: "r-live",
                attr.GEN_AI_USAGE_OUTPUT_TOKENS: 3,
                attr.GEN_AI_RESPONSE_FINISH_REASONS: ["length"],
            },
        ):
            with handle.tracer.start_as_current_span("tokenize", attributes={attr.REQUEST_ID: "r-live"}):
                pass
        assert handle.force_flush(10)
        handle.shutdown()
        rows = _rows(f"http://127.0.0.1:{http}/api/requests")
        assert [(r["request_id"], r["status"], r["output_tokens"], r["instances"]) for r in rows] == [
            ("r-live", "length", 3, ["gateway-7"])
        ]
        assert rows[0]["e2e_ms"] > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = proc.stdout.read().decode()
    assert "dashboard on http://127.0.0.1:" in log and "Traceback" not in log
