"""CLI failures a user can cause end in one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shardline.core.ports import free_port

REPO = Path(__file__).resolve().parents[3]


def _shardline(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardline.cli.main", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s
    )


@pytest.mark.parametrize("blocked", ["data", "logs"])
def test_up_with_a_folder_it_cannot_create_says_so_in_one_line(tmp_path, blocked):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    folders = {name: (blocker if name == blocked else tmp_path) / name for name in ("data", "logs")}
    done = _shardline(
        "up",
        "--http-port",
        str(free_port()),
        "--grpc-port",
        str(free_port()),
        "--data-dir",
        str(folders["data"]),
        "--log-dir",
        str(folders["logs"]),
    )
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr
    # The embedded Redis makes its folder inside the data dir; the log dir is made as given.
    unmade = folders["data"] / "redis" if blocked == "data" else folders["logs"]
    assert done.stderr.strip().splitlines()[-1] == (
        f"shardline: failed to start: [Errno 20] Not a directory: '{unmade}'"
    ), done.stderr


def test_bench_against_no_stack_says_so_in_one_line():
    done = _shardline("bench", "--url", f"127.0.0.1:{free_port()}", "--num-prompts", "2")
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("shardline bench: UNAVAILABLE: "), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--http-port", "0"], "argument --http-port: must be a port from 1 to 65535, got 0"),
        (["--grpc-port", "70000"], "argument --grpc-port: must be a port from 1 to 65535, got 70000"),
        (
            ["--http-port", "18123", "--grpc-port", "18123"],
            "shardline up: --http-port and --grpc-port are both 18123; give two ports",
        ),
    ],
)
def test_up_refuses_bad_ports_before_starting_anything(tmp_path, flags, error):
    done = _shardline("up", *flags, "--data-dir", str(tmp_path / "data"))
    assert done.returncode == 2, done
    assert done.stderr.strip().splitlines()[-1].endswith(error), done.stderr
    assert not (tmp_path / "data").exists()  # nothing started
