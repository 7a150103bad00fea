"""`shardline up`'s console shows the services' errors from their log files, and every line with --verbose."""

from __future__ import annotations

import time

from shardline.cli.service_logs import LogErrorFilter, ServiceLogFollower

LOG = """\
2026-01-02 03:04:05,678 INFO gateway: serving HTTP on :8000
2026-01-02 03:04:06,001 gpu_worker_svc WARNING slow step
2026-01-02 03:04:07,002 ERROR shardline.scheduler: worker-0 lost
Traceback (most recent call last):
  File "x.py", line 1, in <module>
ValueError: boom
2026-01-02 03:04:08,003 rank0 CRITICAL out of memory
2026-01-02 03:04:09,004 INFO gateway: back to normal
  an INFO record's second line
Traceback (most recent call last):
RuntimeError: uncaught
"""


def test_only_error_records_their_tracebacks_and_uncaught_exceptions_pass():
    errors = LogErrorFilter()
    shown = [line for line in LOG.splitlines() if errors.shown(line)]
    assert shown == [
        "2026-01-02 03:04:07,002 ERROR shardline.scheduler: worker-0 lost",
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "ValueError: boom",
        "2026-01-02 03:04:08,003 rank0 CRITICAL out of memory",
        "Traceback (most recent call last):",
        "RuntimeError: uncaught",
    ]


def test_the_follower_echoes_new_errors_with_the_services_name_and_not_what_was_there_before(tmp_path):
    (tmp_path / "gateway.log").write_text("2026-01-02 03:04:05,678 ERROR gateway: from an earlier run\n")
    echoed: list[str] = []
    follower = ServiceLogFollower(tmp_path, echoed.append)
    with open(tmp_path / "gateway.log", "a") as f:
        f.write("2026-01-02 03:04:05,678 INFO gateway: up\n2026-01-02 03:04:05,679 ERROR gateway: bad")
    (tmp_path / "worker-0.log").write_text("2026-01-02 03:04:05,678 worker CRITICAL gone\n")
    follower.poll()
    assert echoed == ["worker-0   | 2026-01-02 03:04:05,678 worker CRITICAL gone"]  # the error's line is not ended
    with open(tmp_path / "gateway.log", "a") as f:
        f.write(" thing\n")
    follower.poll()
    assert echoed[1:] == ["gateway    | 2026-01-02 03:04:05,679 ERROR gateway: bad thing"]


def test_verbose_echoes_every_line(tmp_path):
    echoed: list[str] = []
    follower = ServiceLogFollower(tmp_path, echoed.append, verbose=True)
    (tmp_path / "scheduler.log").write_text(LOG)
    follower.poll()
    assert echoed == [f"scheduler  | {line}" for line in LOG.splitlines()]


def test_a_started_follower_polls_by_itself_and_once_more_when_stopped(tmp_path):
    echoed: list[str] = []
    follower = ServiceLogFollower(tmp_path, echoed.append).start(period_s=0.05)
    try:
        (tmp_path / "tokenizer.log").write_text("2026-01-02 03:04:05,678 ERROR tokenizer: one\n")
        deadline = time.monotonic() + 10
        while not echoed and time.monotonic() < deadline:
            time.sleep(0.02)
        assert echoed == ["tokenizer  | 2026-01-02 03:04:05,678 ERROR tokenizer: one"]
    finally:
        follower.stop()
    with open(tmp_path / "tokenizer.log", "a") as f:
        f.write("2026-01-02 03:04:05,679 ERROR tokenizer: two\n")
    follower.stop()
    assert echoed[-1].endswith("ERROR tokenizer: two")
