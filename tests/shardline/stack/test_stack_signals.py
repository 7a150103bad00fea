"""Children of a stack: recorded even when Ctrl-C lands mid-spawn, and never outliving the process that started them."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest

from shardline.stack.local_stack import LocalStack, StackConfig, StartInterrupted
from shardline.stack.redis_server import EmbeddedRedis


def test_ctrl_c_during_a_spawn_still_records_the_child():
    handler_before = signal.getsignal(signal.SIGINT)
    stack = LocalStack(StackConfig.on_free_ports())

    def popen_then_ctrl_c(name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        signal.raise_signal(signal.SIGINT)  # lands while Popen returns, before the child is recorded
        return proc

    stack._popen = popen_then_ctrl_c
    with pytest.raises(KeyboardInterrupt):
        stack._spawn("tokenizer", {}, None)
    assert [child.name for child in stack.children] == ["tokenizer"]
    stack.stop(timeout_s=5)
    assert stack.children[0].proc.poll() is not None
    assert signal.getsignal(signal.SIGINT) is handler_before  # restored


def test_an_interrupt_while_starting_stops_what_started(tmp_path):
    # `up`'s signal handlers note the signal, and start() polls: an exception raised from a handler
    # instead is lost when the signal lands in a __del__ (CI saw `up` start on after a SIGHUP).
    stack = LocalStack(StackConfig.on_free_ports(redis_url="redis://127.0.0.1:1"))  # no embedded Redis
    started: list[subprocess.Popen] = []

    def sleeper(name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True))
        return started[-1]

    stack._popen = sleeper
    interrupt = threading.Event()
    timer = threading.Timer(0.5, interrupt.set)  # the services are up but not healthy yet
    timer.start()
    with pytest.raises(StartInterrupted):
        stack.start(interrupted=interrupt.is_set, timeout_s=30)
    assert [child.name for child in stack.children] == ["tokenizer", "scheduler", "worker-0", "gateway"]
    assert all(proc.poll() is not None for proc in started)
    # A signal before the services are spawned: none is.
    idle = LocalStack(StackConfig.on_free_ports(redis_url="redis://127.0.0.1:1"))
    idle._popen = sleeper
    with pytest.raises(StartInterrupted):
        idle.start(interrupted=lambda: True, timeout_s=30)
    assert idle.children == [] and len(started) == 4


def test_an_interrupt_while_the_embedded_redis_starts_stops_it(tmp_path):
    # The embedded Redis can take seconds to start (an AOF to replay): a signal then ends the start.
    stack = LocalStack(StackConfig.on_free_ports(data_dir=tmp_path))
    seen = []

    def interrupted() -> bool:
        seen.append(stack.redis)
        return True

    with pytest.raises(StartInterrupted):
        stack.start(interrupted=interrupted, timeout_s=30)
    assert seen[0] is None  # asked while the server was starting, not once it had
    assert stack.redis is None and stack.children == []
    with EmbeddedRedis(tmp_path / "redis") as again:  # stopped, and its data directory released
        assert again.port
