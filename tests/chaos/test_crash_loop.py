"""`shardline up` under crashes: a worker killed over and over is restarted with backoff while the rest
of the stack serves on, and a SIGKILLed embedded Redis comes back on its port with its data.

Real processes: `shardline up --workers 2` with the default model and its embedded redis-server.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from shardline.core.ports import free_port
from tests.e2e.http_client import post

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

SERVICES = ("tokenizer", "scheduler", "worker-0", "worker-1", "gateway")


class UpProcess:
    """A `shardline up` child, its output collected line by line as it comes."""

    def __init__(self, tmp_path: Path) -> None:
        self.http_port = free_port()
        self.logs = tmp_path / "logs"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shardline.cli.main",
                "up",
                "--workers",
                "2",
                "--http-port",
                str(self.http_port),
                "--grpc-port",
                str(free_port()),
                "--otlp-port",
                str(free_port()),
                "--dashboard-port",
                str(free_port()),
                "--data-dir",
                str(tmp_path / "data"),
                "--log-dir",
                str(self.logs),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "SHARDLINE_HEARTBEAT_INTERVAL_S": "0.5"},
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.search(pattern, self.output)
            if found:
                return found
            assert self.proc.poll() is None, f"`up` exited ({self.proc.returncode}):\n{self.output}{self.log_tails()}"
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} within {timeout_s:.0f}s:\n{self.output}{self.log_tails()}")

    def pid_of(self, instance: str) -> int | None:
        """The live process `up` started as `instance` (its SHARDLINE_INSTANCE_ID), if any."""
        marker = f"SHARDLINE_INSTANCE_ID={instance}".encode()
        for pid in _children(self.proc.pid):
            try:
                if marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    return pid
            except OSError:  # gone, or a zombie not reaped yet
                continue
        return None

    def redis_pid(self) -> int:
        (pid,) = [pid for pid in _children(self.proc.pid) if b"redis-server" in _cmdline(pid)]
        return pid

    def log_tails(self) -> str:
        return "".join(
            f"\n--- {log.name}\n{log.read_text(errors='replace')[-1500:]}" for log in sorted(self.logs.glob("*.log"))
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _complete(up: UpProcess, prompt: str) -> tuple[int, dict]:
    return post(
        f"http://127.0.0.1:{up.http_port}/v1/completions",
        {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )


@pytest.fixture(scope="module")
def up(tmp_path_factory) -> Iterator[UpProcess]:
    stack = UpProcess(tmp_path_factory.mktemp("crash-loop"))
    try:
        stack.wait_for(r"shardline is up", timeout_s=180)
        yield stack
    finally:
        stack.stop()


@pytest.mark.timeout(120)
def test_a_crash_looping_worker_backs_off_alone_while_the_stack_serves(up):
    others = {name: up.pid_of(name) for name in SERVICES if name != "worker-1"}
    assert all(others.values()), others
    kills = []
    t0 = time.monotonic()
    for _ in range(4):  # four deaths in about four seconds, each as soon as the last restart is seen
        deadline = time.monotonic() + 10
        while (pid := up.pid_of("worker-1")) is None or pid in kills:
            assert time.monotonic() < deadline, f"worker-1 not restarted:\n{up.output}"
            time.sleep(0.02)
        os.killpg(pid, signal.SIGKILL)
        kills.append(pid)
    up.wait_for(r"worker-1 is crash-looping \(exited 3 times in a row.*out of service", timeout_s=5)
    up.wait_for(r"worker-1 is still crash-looping \(exit 4 in a row, code -9\); restarting it in 2\.0s", timeout_s=5)
    killed_in_s = time.monotonic() - t0
    # The rest of the stack serves on worker-0 while worker-1 waits out its backoff.
    status, body = _complete(up, "The capital of France is")
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 4
    assert up.proc.poll() is None and "stopping" not in up.output
    assert {name: up.pid_of(name) for name in others} == others  # none of them was restarted
    # worker-1 comes back after its backoff, and is counted healthy again once it has run 10 s.
    up.wait_for(r"worker-1 has run \d+s since its restart: back in service", timeout_s=30)
    assert up.pid_of("worker-1") not in (None, *kills)
    print(f"4 kills of worker-1 in {killed_in_s:.1f}s; restarts at once, then after 0.5, 1 and 2 s")


@pytest.mark.timeout(120)
def test_a_killed_embedded_redis_is_back_on_its_port_with_its_data(up):
    port = int(up.wait_for(r"redis +redis://127\.0\.0\.1:(\d+)/0", timeout_s=1).group(1))
    client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
    client.set("shardline:chaos:probe", "before the kill")
    old = up.redis_pid()
    os.kill(old, signal.SIGKILL)
    killed = time.monotonic()
    while True:
        try:
            if client.ping():
                break
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.BusyLoadingError):
            pass
        assert time.monotonic() - killed < 5, f"Redis not back after 5 s:\n{up.output}"
        time.sleep(0.01)
    back_in_s = time.monotonic() - killed
    assert back_in_s < 2, back_in_s
    assert up.redis_pid() != old
    assert client.get("shardline:chaos:probe") == b"before the kill"
    client.close()
    up.wait_for(r"redis exited \(code -9\); restarting it now", timeout_s=1)
    # The services' clients reconnect to the same URL: the stack serves again.
    deadline = time.monotonic() + 30
    while (answer := _complete(up, "After the outage,"))[0] != 200:
        assert time.monotonic() < deadline, f"no completion 30 s after Redis came back: {answer}"
        time.sleep(0.5)
    served_in_s = time.monotonic() - killed
    assert up.proc.poll() is None
    print(
        f"embedded Redis answered PING on port {port} again {back_in_s:.2f}s after its SIGKILL; "
        f"a completion served {served_in_s:.1f}s after it"
    )
