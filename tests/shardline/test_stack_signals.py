"""LocalStack records every child it starts even when Ctrl-C lands mid-spawn, so stop() leaves no orphan."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from shardline.stack import LocalStack, StackConfig


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
