"""`shardline up` stopped while it is still starting (Ctrl-C, a closed terminal, or killed outright):
it exits at once and leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardline.core.ports import free_port

pytestmark = pytest.mark.slow


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4: the parent's pid
                found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _logs(tmp_path: Path) -> str:
    return "".join(
        f"\n--- {log.name}\n{log.read_text(errors='replace')[-2000:]}"
        for log in sorted((tmp_path / "logs").glob("*.log"))
    )


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP, signal.SIGKILL])
def test_stopping_up_while_starting_stops_every_service(tmp_path, sig):
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardline.cli.main",
            "up",
            "--http-port",
            str(free_port()),
            "--grpc-port",
            str(free_port()),
            "--otlp-port",
            str(free_port()),
            "--dashboard-port",
            str(free_port()),
            "--data-dir",
            str(tmp_path / "data"),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        # Redis, tracing, the tokenizer and the scheduler start first; the worker's model load keeps `up` starting.
        deadline = time.monotonic() + 60
        while len(children := _children(up.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(children) >= 3, up.stdout.read() if up.poll() is not None else "services did not start"
        assert up.poll() is None
        up.send_signal(sig)
        if sig == signal.SIGKILL:  # no cleanup runs in `up`: its services die with it (PR_SET_PDEATHSIG)
            assert up.wait(timeout=30) == -signal.SIGKILL
        else:
            try:
                code = up.wait(timeout=30)
            except subprocess.TimeoutExpired:
                up.kill()
                pytest.fail(f"`up` did not exit within 30 s of {sig.name}:\n{up.communicate()[0]}{_logs(tmp_path)}")
            output = up.stdout.read()
            assert code == 130, output
            assert "interrupted while starting" in output
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in children if _alive(pid)]
    finally:
        if up.poll() is None:
            up.kill()
