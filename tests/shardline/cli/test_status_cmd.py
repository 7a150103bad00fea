"""`shardline status` without a running stack says so in one line; the state `up` leaves is the user's alone."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from shardline.stack.state import STATE_NAME, ServiceEntry, StackNotRunning, StackState

REPO = Path(__file__).resolve().parents[3]


def _status(data_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardline.cli.main", "status", "--data-dir", str(data_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _state(pid: int) -> StackState:
    return StackState(
        pid=pid,
        started_at=0.0,
        redis_url="redis://:secret@127.0.0.1:1/0",
        scheduler_address="127.0.0.1:1",
        http_url="http://127.0.0.1:2",
        grpc_address="127.0.0.1:3",
        dashboard_url=None,
        log_dir=None,
        services=[ServiceEntry("scheduler", "127.0.0.1:1", pid)],
    )


def test_status_with_no_stack_on_the_folder_says_so_in_one_line(tmp_path):
    done = _status(tmp_path / "data")
    assert done.returncode == 1, done
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"shardline status: no stack is running on {tmp_path / 'data'} "
        "(`shardline up` starts one; --data-dir names another stack's folder)"
    ]


def test_status_after_up_was_killed_names_the_dead_stack(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    _state(dead.pid).write(tmp_path)
    done = _status(tmp_path)
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        f"shardline status: no stack is running on {tmp_path}: the one started there (pid {dead.pid}) has exited "
        "(`shardline up` starts one; --data-dir names another stack's folder)"
    )


def test_status_with_a_garbled_state_file_says_so_in_one_line(tmp_path):
    (tmp_path / STATE_NAME).write_text("{not json")
    done = _status(tmp_path)
    assert done.returncode == 1, done
    assert len(done.stderr.strip().splitlines()) == 1 and "cannot be read" in done.stderr, done.stderr


def test_the_state_round_trips_only_its_owner_may_read_it_and_only_its_writer_removes_it(tmp_path):
    state = _state(os.getpid())
    state.write(tmp_path)
    assert stat.S_IMODE((tmp_path / STATE_NAME).stat().st_mode) == 0o600  # it holds the Redis password
    assert StackState.read(tmp_path) == state
    _state(os.getppid()).remove(tmp_path)  # another stack's: kept
    assert StackState.read(tmp_path) == state
    state.remove(tmp_path)
    with pytest.raises(StackNotRunning):
        StackState.read(tmp_path)
