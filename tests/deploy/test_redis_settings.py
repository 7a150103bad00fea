"""The Redis of docker-compose.yml and deploy/k8s runs with what docs/redis.md prescribes.

The arguments are read from the files, then given to a real redis-server (the bundled one), whose
CONFIG GET says what took effect: a misspelt or misplaced flag fails here, not in production.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
import redis
import yaml

from shardline.core.ports import free_port
from shardline.stack.redis_server import find_redis_server
from tests.deploy.compose_project import REPO, resolved_config

DOC = REPO / "docs" / "redis.md"
# What docs/redis.md says every deployment's Redis must set.
REQUIRED = {"appendonly": "yes", "appendfsync": "everysec", "maxmemory-policy": "noeviction"}
UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "k": 1000,
    "mb": 1000**2,
    "m": 1000**2,
    "gb": 1000**3,
    "g": 1000**3,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
}


def compose_argv() -> list[str]:
    return resolved_config()["services"]["redis"]["command"]


def k8s_container() -> dict:
    docs = yaml.safe_load_all((REPO / "deploy" / "k8s" / "redis.yaml").read_text())
    (statefulset,) = [d for d in docs if d and d["kind"] == "StatefulSet"]
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    return container


def k8s_argv() -> list[str]:
    container = k8s_container()
    return container.get("command", []) + container.get("args", [])


def options(argv: list[str]) -> dict[str, str]:
    """`redis-server --key value ...` as {key: value}."""
    assert argv[0] == "redis-server", argv
    flags = argv[1:]
    assert len(flags) % 2 == 0 and all(f.startswith("--") for f in flags[::2]), argv
    return {key.removeprefix("--"): value for key, value in zip(flags[::2], flags[1::2])}


def size_bytes(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)\s*([a-zA-Z]*)", text).groups()
    return int(number) * UNITS[unit.lower()]


def effective_config(argv: list[str], data_dir: Path) -> dict[str, str]:
    """Start a real redis-server with these arguments (its --dir moved to `data_dir`) and read its config."""
    settings = {**options(argv), "dir": str(data_dir), "port": str(free_port()), "bind": "127.0.0.1"}
    flags = [item for key, value in settings.items() for item in (f"--{key}", value)]
    server = subprocess.Popen([str(find_redis_server()), *flags], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    client = redis.Redis(
        port=int(settings["port"]),
        password=settings.get("requirepass"),
        decode_responses=True,
        socket_connect_timeout=0.5,
    )
    try:
        for _ in range(250):
            assert server.poll() is None, f"redis-server refused {flags}"
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                time.sleep(0.02)
        return {key: client.config_get(key)[key] for key in [*REQUIRED, "maxmemory"]}
    finally:
        client.close()
        server.kill()
        server.wait()


@pytest.mark.parametrize("argv", [compose_argv, k8s_argv], ids=["compose", "k8s"])
def test_the_redis_of_each_deployment_runs_with_aof_everysec_and_noeviction(argv, tmp_path):
    config = effective_config(argv(), tmp_path)
    assert {key: config[key] for key in REQUIRED} == REQUIRED


def test_the_k8s_redis_keeps_maxmemory_at_most_half_its_memory_limit():
    # Past the limit the pod is OOM-killed; past maxmemory, writes fail with an error that says why.
    # Half: an AOF rewrite forks, and its copy-on-write pages count against the limit too.
    container = k8s_container()
    limit = size_bytes(container["resources"]["limits"]["memory"])
    maxmemory = size_bytes(options(k8s_argv())["maxmemory"])
    assert 0 < maxmemory <= limit // 2


def test_the_doc_names_the_settings_the_deployments_are_checked_for():
    text = DOC.read_text()
    for key, value in REQUIRED.items():
        assert f"{key} {value}" in text, f"docs/redis.md does not say `{key} {value}`"
    assert "appendfsync always" in text
