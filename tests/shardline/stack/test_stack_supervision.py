"""LocalStack's supervisor: its embedded Redis and its services, restarted when they die."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import redis

from shardline.stack.local_stack import LocalStack, StackConfig
from shardline.stack.redis_server import EmbeddedRedis


def _sleeper(name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)


def test_the_supervisor_brings_back_a_killed_redis_on_its_port_with_its_data_and_a_killed_service(tmp_path):
    stack = LocalStack(StackConfig.on_free_ports(data_dir=tmp_path))
    stack._popen = _sleeper  # stand-ins for the services: what is checked here is how they are restarted
    stack.redis = EmbeddedRedis(tmp_path / "redis").start()
    stack.redis_url = stack.redis.url
    reports: list[str] = []
    try:
        tokenizer = stack._spawn("tokenizer", {}, None)
        scheduler = stack._spawn("scheduler", {}, None)
        supervisor = stack.supervisor(report=reports.append)
        assert [s.name for s in stack.supervised()] == ["redis", "tokenizer", "scheduler"]
        supervisor.check()
        client = redis.Redis.from_url(stack.redis_url, socket_timeout=1)
        client.hset("shardline:req:r1", mapping={"status": "RUNNING", "attempt": 1})
        port, redis_pid = stack.redis.port, stack.redis.pid
        tokenizer_pid, scheduler_pid = tokenizer.proc.pid, scheduler.proc.pid
        os.kill(redis_pid, signal.SIGKILL)
        os.killpg(tokenizer_pid, signal.SIGKILL)
        killed = time.monotonic()
        while stack.redis.pid == redis_pid or tokenizer.proc.pid == tokenizer_pid:
            assert time.monotonic() - killed < 5, reports
            supervisor.check()
            time.sleep(0.05)
        while True:
            try:
                if client.ping():
                    break
            except (redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError):
                assert time.monotonic() - killed < 5, "the restarted Redis never answered"
                time.sleep(0.02)
        assert time.monotonic() - killed < 2
        assert stack.redis.port == port and stack.redis_url == f"redis://127.0.0.1:{port}/0"
        assert client.hgetall("shardline:req:r1") == {b"status": b"RUNNING", b"attempt": b"1"}
        client.close()
        assert scheduler.proc.pid == scheduler_pid and scheduler.proc.poll() is None  # left alone
        assert tokenizer.proc.poll() is None
        assert sorted(r.split(" (")[0] for r in reports) == ["redis exited", "tokenizer exited"]
    finally:
        stack.stop(timeout_s=5)
    assert stack.redis is None and all(child.proc.poll() is not None for child in stack.children)
