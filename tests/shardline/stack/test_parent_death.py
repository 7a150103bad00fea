"""The launcher that makes a stack's children die with their parent, with nothing run between fork and exec."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from shardline.stack.parent_death import dying_with_parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as stat:  # a zombie waiting for init to reap it is gone too
            if stat.read().split(") ")[1].startswith("Z"):
                return True
        time.sleep(0.05)
    return False


def test_a_child_whose_parent_died_before_its_prctl_ends_itself():
    # A parent killed between the fork and the child's PR_SET_PDEATHSIG sends no death signal: the
    # launcher sees another parent than the one that forked it, and ends before it execs.
    orphan = subprocess.Popen(dying_with_parent(["sleep", "30"], parent_pid=os.getpid() + 10**6))
    assert orphan.wait(timeout=10) == -signal.SIGKILL
    kept = subprocess.Popen(dying_with_parent(["sleep", "30"]))  # its parent is alive: it runs
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            kept.wait(timeout=0.5)
    finally:
        kept.kill()
        kept.wait()


def test_the_child_gets_sigterm_when_its_parent_is_sigkilled():
    parent_code = textwrap.dedent(
        """
        import subprocess, sys, time
        from shardline.stack.parent_death import dying_with_parent
        child = subprocess.Popen(dying_with_parent(["sleep", "60"]))
        print(child.pid, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    time.sleep(0.5)  # the launcher has exec'd sleep
    with open(f"/proc/{child_pid}/cmdline", "rb") as cmdline:
        assert cmdline.read().split(b"\0")[0] == b"sleep"  # the real program runs under the same pid
    parent.kill()
    parent.wait()
    assert _gone(child_pid, timeout_s=10)


def test_children_start_while_other_threads_are_inside_grpc():
    # With gRPC's fork handlers on (a program that imports grpc before shardline), a child forked
    # while other threads were mid-call used to hang or die of SIGSEGV in the preexec_fn; nothing
    # runs between the fork and the exec now.
    code = textwrap.dedent(
        """
        import os, subprocess, sys, threading
        from concurrent import futures
        import grpc
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        from shardline.stack.parent_death import dying_with_parent

        server = grpc.server(futures.ThreadPoolExecutor(8))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()

        def hammer():
            stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
            while True:
                stub.Check(health_pb2.HealthCheckRequest())

        for _ in range(6):
            threading.Thread(target=hammer, daemon=True).start()
        codes = [subprocess.Popen(dying_with_parent(["true"])).wait(timeout=20) for _ in range(30)]
        print(codes, flush=True)
        os._exit(0)  # gRPC's own shutdown, with calls in flight and fork support on, can hang
        """
    )
    env = {**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str([0] * 30)
