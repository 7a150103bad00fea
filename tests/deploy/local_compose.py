"""Runs the Shardline services of docker-compose.yml as local processes, as compose would.

There is no Docker engine here, so each service's resolved `command` and `environment`
run on loopback instead: through docker/entrypoint.sh as in the image, started in
`depends_on` order, each one started once its dependencies pass their own compose
`healthcheck` (run locally with docker/healthcheck.py). The one translation is the
network: every `<service>:<port>` the file mentions becomes 127.0.0.1 and a free port,
because the services share one network namespace here instead of one each.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from shardline.core.ports import free_port
from tests.deploy.compose_project import REPO

ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
HEALTHCHECK = REPO / "docker" / "healthcheck.py"


@dataclass(slots=True)
class LocalService:
    """One compose service, translated to run on this machine."""

    name: str
    argv: list[str]  # entrypoint + the compose command
    env: dict[str, str]  # the resolved compose environment, addresses rewritten
    healthcheck: list[str]
    depends_on: list[str]
    log: Path
    proc: subprocess.Popen | None = None


@dataclass(slots=True)
class LocalCompose:
    """The services of a resolved compose config (`docker-compose config --format json`)."""

    config: dict
    services: list[str]  # those to run; the others (redis) are provided
    redis_url: str
    log_dir: Path
    # (service, port in the container) -> port on 127.0.0.1
    ports: dict[tuple[str, int], int] = field(default_factory=dict)
    running: list[LocalService] = field(default_factory=list)

    def __post_init__(self) -> None:
        redis = urlsplit(self.redis_url)
        self.ports[("redis", 6379)] = redis.port
        for name in self.services:
            for variable, value in (self.config["services"][name].get("environment") or {}).items():
                if variable.endswith("_PORT") and value and value.isdigit():
                    self.ports[(name, int(value))] = free_port()

    def local_address(self, service: str, port: int) -> str:
        """Where `service:port` of the compose network is reached here."""
        if (service, port) not in self.ports:
            raise KeyError(f"{service}:{port} is named in docker-compose.yml, but {service} does not listen there")
        return f"127.0.0.1:{self.ports[(service, port)]}"

    def translate(self, name: str) -> LocalService:
        """The service's command, environment and healthcheck, for loopback."""
        service = self.config["services"][name]
        names = "|".join(re.escape(n) for n in self.config["services"])
        address = re.compile(rf"\b({names}):(\d+)\b")
        env = {}
        # A named volume's mount point is a folder of the test's own: every service mounting the volume shares it.
        mounts = {
            v["target"]: self.log_dir / "volumes" / v["source"]
            for v in service.get("volumes") or []
            if v.get("type") == "volume"
        }
        for variable, value in (service.get("environment") or {}).items():
            if value is None:  # passed through from .env only when set there: unset here too
                continue
            for target, folder in mounts.items():
                if value == target or value.startswith(target + "/"):
                    value = str(folder) + value[len(target) :]
            if variable.endswith("_PORT") and value.isdigit():
                value = str(self.ports[(name, int(value))])
            env[variable] = address.sub(lambda m: self.local_address(m[1], int(m[2])), value)
        test = service["healthcheck"]["test"]
        assert test[:2] == ["CMD", "shardline-healthcheck"], test
        kind, target = test[2:]
        target = re.sub(r"localhost:(\d+)", lambda m: self.local_address(name, int(m[1])), target)
        return LocalService(
            name=name,
            argv=["sh", str(ENTRYPOINT), *service["command"]],
            env=env,
            healthcheck=[sys.executable, str(HEALTHCHECK), kind, target],
            depends_on=list(service.get("depends_on", {})),
            log=self.log_dir / f"{name}.log",
        )

    def up(self, timeout_s: float) -> None:
        """Start every service once its dependencies are healthy; return when all are."""
        deadline = time.monotonic() + timeout_s
        pending = [self.translate(name) for name in self.services]
        healthy = {"redis"}
        while pending:
            ready = [s for s in pending if set(s.depends_on) <= healthy]
            if not ready:
                raise RuntimeError(f"depends_on cannot be met: {[(s.name, s.depends_on) for s in pending]}")
            for service in ready:
                self._start(service)
                pending.remove(service)
            for service in ready:
                self._wait_healthy(service, deadline)
                healthy.add(service.name)

    def _start(self, service: LocalService) -> None:
        # `shardline` resolves to this virtualenv's script, as /opt/venv/bin's does in the image.
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        base = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLINE_")}
        env = {**base, "PATH": path, "PYTHONUNBUFFERED": "1", **service.env}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(service.log, "ab") as log:
            service.proc = subprocess.Popen(
                service.argv, env=env, cwd=self.log_dir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.running.append(service)

    def _wait_healthy(self, service: LocalService, deadline: float) -> None:
        while True:
            if service.proc.poll() is not None:
                raise RuntimeError(f"{service.name} exited with {service.proc.returncode}:\n{self.log_tail(service)}")
            if subprocess.run(service.healthcheck, capture_output=True, timeout=30).returncode == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{service.name} not healthy in time:\n{self.log_tail(service)}")
            time.sleep(0.5)

    def down(self, grace_s: float = 30.0) -> dict[str, int]:
        """SIGTERM in reverse start order, as compose stops; SIGKILL after the grace period.

        Returns each service's exit status (negative: killed by that signal).
        """
        for service in reversed(self.running):
            _signal_group(service.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        codes = {}
        for service in reversed(self.running):
            try:
                codes[service.name] = service.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(service.proc.pid, signal.SIGKILL)
                codes[service.name] = service.proc.wait()
        return codes

    def leftover_processes(self) -> list[str]:
        """Processes still alive in the services' sessions (their children included)."""
        sessions = {service.proc.pid for service in self.running}
        left = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # After the command name: state, ppid, pgrp, session.
            if fields[0] != "Z" and int(fields[3]) in sessions:
                left.append(stat.parent.name)
        return left

    def kill_leftovers(self) -> None:
        for service in self.running:
            _signal_group(service.proc.pid, signal.SIGKILL)

    @staticmethod
    def log_tail(service: LocalService, chars: int = 4000) -> str:
        try:
            return service.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
