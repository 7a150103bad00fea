"""EmbeddedRedis: a real redis-server child process with AOF persistence."""

import os
import signal
import socket
import time
from pathlib import Path

import pytest
import redis

from shardline.stack.redis_server import EmbeddedRedis, RedisServerError, find_redis_server


def _aof_files(data_dir: Path) -> list[Path]:
    # Redis 6 writes appendonly.aof; Redis 7 an appendonlydir/ of several files.
    return [p for p in data_dir.rglob("appendonly*") if p.is_file()]


def test_find_redis_server_prefers_the_bundled_binary() -> None:
    binary = find_redis_server()
    assert binary.name == "redis-server"
    assert os.access(binary, os.X_OK)


def test_start_answers_and_stop_leaves_no_process(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path).start()
    pid = server._process.pid if server._process else -1
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    client = redis.Redis.from_url(server.url)
    assert client.ping()
    client.close()
    server.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped, not a zombie or an orphan
    with pytest.raises(RedisServerError):
        _ = server.url
    server.stop()  # idempotent


def test_writes_reach_the_append_only_file(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        client.set("shardline:probe", "x" * 64)
        client.close()
        deadline = time.monotonic() + 5
        while not any(p.stat().st_size > 0 for p in _aof_files(tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(b"shardline:probe" in p.read_bytes() for p in _aof_files(tmp_path))


def test_data_survives_a_restart_on_the_same_dir(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        client.rpush("shardline:list", 1, 2, 3)
        client.hset("shardline:hash", mapping={"status": "RUNNING"})
        client.close()
    with EmbeddedRedis(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        assert client.lrange("shardline:list", 0, -1) == [b"1", b"2", b"3"]
        assert client.hget("shardline:hash", "status") == b"RUNNING"
        client.close()


def test_a_taken_port_fails_with_the_server_log(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(RedisServerError, match=r"(?s)exited.*log tail.*in use"):
            EmbeddedRedis(tmp_path, port=port, start_timeout_s=5).start()


def test_ctrl_c_while_waiting_for_the_server_stops_it(tmp_path: Path, monkeypatch) -> None:
    """Before start() returns, nothing else knows the server: an interrupted start must stop it itself."""
    server = EmbeddedRedis(tmp_path)
    started = []

    def interrupted_wait(port: int) -> None:
        started.append(server._process)
        raise KeyboardInterrupt

    monkeypatch.setattr(server, "_wait_ready", interrupted_wait)
    with pytest.raises(KeyboardInterrupt):
        server.start()
    assert started and started[0].poll() is not None  # killed and reaped


def test_a_second_server_on_one_data_dir_is_refused(tmp_path: Path) -> None:
    """Two redis-servers appending to one AOF corrupt it: a second `shardline up` from the same
    folder (the default --data-dir) used to start anyway."""
    with EmbeddedRedis(tmp_path) as first:
        with pytest.raises(RedisServerError, match=rf"in use by another Shardline stack \(pid {os.getpid()}\)"):
            EmbeddedRedis(tmp_path).start()
        assert redis.Redis.from_url(first.url).ping()  # the first is untouched
    with EmbeddedRedis(tmp_path) as again:  # stopping released the directory
        assert redis.Redis.from_url(again.url).ping()


def test_a_start_ends_when_its_check_raises(tmp_path: Path) -> None:
    """`shardline up` passes a check that raises once a stop signal came: the start stops the server,
    releases the data directory and raises it, rather than waiting out the server's start."""
    server = EmbeddedRedis(tmp_path)
    calls = []

    def check() -> None:
        calls.append(server._process)
        raise InterruptedError("stop signal")

    with pytest.raises(InterruptedError):
        server.start(check=check)
    assert calls and calls[0].poll() is not None  # killed and reaped
    with EmbeddedRedis(tmp_path) as again:  # the directory was released
        assert redis.Redis.from_url(again.url).ping()


def test_the_server_runs_with_the_durability_settings_docs_redis_md_gives(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path) as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        settings = {key: client.config_get(key)[key] for key in ("appendonly", "appendfsync", "maxmemory-policy")}
        client.close()
    assert settings == {"appendonly": "yes", "appendfsync": "everysec", "maxmemory-policy": "noeviction"}


def test_a_killed_server_respawns_on_its_port_with_its_data(tmp_path: Path) -> None:
    """What `shardline up` does when its Redis dies: same port (every client's URL stays valid), same AOF."""
    server = EmbeddedRedis(tmp_path).start()
    try:
        port, url, first_pid = server.port, server.url, server.pid
        client = redis.Redis.from_url(url)
        client.rpush("shardline:req:a:tokens", 1, 2, 3)
        client.hset("shardline:req:a", mapping={"status": "RUNNING"})
        assert server.exit_code() is None
        os.kill(first_pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while server.exit_code() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.exit_code() == -signal.SIGKILL
        with pytest.raises(redis.exceptions.ConnectionError):
            client.ping()
        server.respawn()
        assert server.pid != first_pid and server.port == port and server.url == url
        with pytest.raises(RedisServerError, match="still running"):
            server.respawn()
        deadline = time.monotonic() + 5
        while True:  # the same client, reconnecting by itself
            try:
                if client.ping():
                    break
            except (redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError):
                assert time.monotonic() < deadline, "the respawned server never answered"
                time.sleep(0.02)
        assert client.lrange("shardline:req:a:tokens", 0, -1) == [b"1", b"2", b"3"]
        assert client.hget("shardline:req:a", "status") == b"RUNNING"
        client.close()
    finally:
        server.stop()
    with pytest.raises(RedisServerError):
        server.respawn()  # stopped: nothing to respawn
