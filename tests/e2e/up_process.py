"""A real `shardline up` as a child process, on free ports, with its console collected as it comes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from shardline.core.ports import free_port

REPO = Path(__file__).resolve().parents[2]
# A logging record's first line in the services' formats: "<asctime> [name] INFO ...".
INFO_RECORD = re.compile(r"^\S*\s*\|?\s*\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (?:\S+ )?INFO\b", re.MULTILINE)


class UpProcess:
    """`shardline up *flags` on free ports and its own data folder; stop() ends it as Ctrl-C does."""

    def __init__(self, tmp_path: Path, *flags: str) -> None:
        self.data_dir = tmp_path / "data"
        self.http_port, self.grpc_port = free_port(), free_port()
        self.otlp_port, self.dashboard_port = free_port(), free_port()
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "shardline.cli.main", "up"),
                *("--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port)),
                *("--otlp-port", str(self.otlp_port), "--dashboard-port", str(self.dashboard_port)),
                *("--data-dir", str(self.data_dir), *flags),
            ],
            cwd=REPO,
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
            if found := re.search(pattern, self.output, re.MULTILINE):
                return found
            if self.proc.poll() is not None:
                time.sleep(0.5)  # the reader's last lines
                break
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r} in `up`'s console (exit {self.proc.poll()}):\n{self.output}")

    def status(self) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "shardline.cli.main", "status", "--data-dir", str(self.data_dir)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()
