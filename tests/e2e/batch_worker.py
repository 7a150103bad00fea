"""A real batch worker process (`shardline serve batch`, a Celery worker) for a test stack, and the
helpers the batch tests share."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from shardline.core.ports import free_port
from shardline.stack.local_stack import LocalStack

TERMINAL = ("completed", "failed", "expired", "cancelled")


class BatchWorker:
    """`shardline serve batch` against a stack; start() waits for its /health."""

    def __init__(self, stack: LocalStack, log: Path, **settings: object) -> None:
        self.health_port = free_port()
        self.log = log
        self.env = {
            **os.environ,
            "SHARDLINE_REDIS_URL": stack.redis_url,
            "SHARDLINE_GATEWAY_URL": f"http://127.0.0.1:{stack.config.http_port}",
            "SHARDLINE_GATEWAY_GRPC_ADDRESS": f"127.0.0.1:{stack.config.grpc_port}",
            "SHARDLINE_FILES_DIR": stack.files_dir,
            "SHARDLINE_BATCH_HEALTH_PORT": str(self.health_port),
            "SHARDLINE_TRACING": "0",
            **{f"SHARDLINE_{k.upper()}": str(v) for k, v in settings.items()},
        }
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> BatchWorker:
        out = open(self.log, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shardline.cli.main", "serve", "batch"],
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the batch worker exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}"
                )
            if self.healthy():
                return self
            time.sleep(0.2)
        raise TimeoutError(f"the batch worker was not healthy in {timeout_s} s")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/metrics", timeout=5) as response:
            return response.read().decode()

    def kill(self) -> None:
        """SIGKILL, the worker and its threads at once: no warm shutdown, no ack."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def jsonl(lines: list[dict]) -> bytes:
    return ("\n".join(json.dumps(line) for line in lines) + "\n").encode()


def chat_line(custom_id: str, content: str, max_tokens: int = 8, **body: object) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            **body,
        },
    }


def wait_batch(client, batch_id: str, timeout_s: float = 120.0, until=lambda b: b.status in TERMINAL):
    """The batch once `until` holds; fails the test past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status} {batch.request_counts}"
        time.sleep(0.25)


def output_lines(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]
