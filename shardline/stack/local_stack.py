"""Runs the whole stack on one machine as child processes: what `shardline up` and the e2e tests use.

Each service is `python -m shardline.cli.main serve <service>`, configured through
its SHARDLINE_* environment (the same settings compose passes), in its own process
group so that stopping it also stops the tensor-parallel ranks it spawned. Its
supervisor() restarts whatever dies, the embedded Redis included (shardline/stack/supervisor.py).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shardline.core.host_memory import MALLOC_ENV, REEXEC_MARKER
from shardline.core.ports import free_port
from shardline.stack.health_probe import healthy, http_ok
from shardline.stack.parent_death import dying_with_parent
from shardline.stack.redis_server import EmbeddedRedis
from shardline.stack.signals import signals_deferred
from shardline.stack.supervisor import BackoffPolicy, SupervisedProcess, Supervisor

log = logging.getLogger(__name__)

# Where the stack's internal services and the trace dashboard (which has no authentication) listen:
# this machine only. The gateway listens on every interface, as vLLM's server does.
LOOPBACK = "127.0.0.1"


@dataclass(slots=True)
class StackConfig:
    model: str | None = None  # HF folder or .gguf; None: the default model
    workers: int = 1  # the workers that run requests: role decode with prefill workers, else both
    prefill_workers: int = 0  # workers of role prefill (docs/kv_transfer.md#worker-roles), named prefill-<i>
    tp_size: int = 1
    http_port: int = 8000
    grpc_port: int = 50051
    # The internal services' ports; 0 (the default): free ones, picked when the stack is made, so a
    # second stack on this machine can never find (and join) the first one's services.
    tokenizer_port: int = 0
    scheduler_port: int = 0
    worker_base_port: int = 0  # 0: a free port per worker
    batch_workers: int = 0  # batch workers (Celery, `shardline serve batch`) running the Batch API's jobs
    # The scheduler's autoscaling policy and bounds (SHARDLINE_AUTOSCALE_*); "static": `workers` stays.
    autoscale: str = "static"
    min_workers: int = 1
    max_workers: int = 1
    redis_url: str | None = None  # None: start an embedded redis-server with AOF in data_dir
    data_dir: Path | None = None
    tracing: bool = False  # start the tracing service first and export every service's spans to it
    otlp_port: int = 4317  # tracing service: OTLP/gRPC receiver
    dashboard_port: int = 8080  # tracing service: trace dashboard (HTTP)
    log_dir: Path | None = None  # None: children log to this process's stderr
    # LoRA adapters every worker serves, NAME=PATH items separated by commas (SHARDLINE_LORA_ADAPTERS)
    lora_adapters: str = ""
    env: dict[str, str] = field(default_factory=dict)  # extra SHARDLINE_* settings for every service

    def __post_init__(self) -> None:
        self.tokenizer_port = self.tokenizer_port or free_port()
        self.scheduler_port = self.scheduler_port or free_port()

    @classmethod
    def on_free_ports(cls, **kwargs) -> StackConfig:
        ports = {k: free_port() for k in ("http_port", "grpc_port", "otlp_port", "dashboard_port")}
        return cls(**{**ports, **kwargs})


@dataclass(slots=True)
class ServiceSpec:
    """One service of the stack, as start() runs it: `shardline serve <service>` with its settings."""

    name: str  # how logs, reports and `shardline status` name it: "worker-1"
    settings: dict[str, object]  # its SHARDLINE_* settings, without the prefix; None values are left out
    health: str | None  # gRPC address (or HTTP URL) whose health check says it is ready; None: ready once it runs
    service: str | None = None  # the `shardline serve` service, when it is not `name`
    ready_first: bool = False  # ready before the services after it start


class StartInterrupted(Exception):
    """LocalStack.start's `interrupted` said so while it started: what had started is stopped."""


@dataclass(slots=True)
class Child:
    name: str
    proc: subprocess.Popen
    health: str | None  # gRPC address whose health check says when it is ready
    ready: bool = False  # its health check has passed once
    argv: list[str] = field(default_factory=list)  # how it was started, to restart it the same way
    env: dict[str, str] = field(default_factory=dict)

    def exit_code(self) -> int | None:
        """Its process's exit status, or None while it runs (the process restart() gave it, if any)."""
        return self.proc.poll()


class LocalStack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.redis: EmbeddedRedis | None = None
        self.children: list[Child] = []
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.redis_url = config.redis_url or ""
        self.files_dir = ""  # the Batch API's file store, under the data folder
        self.worker_ports: list[int] = []
        self._interrupted: Callable[[], bool] | None = None

    # -- lifecycle ------------------------------------------------------------
    def start(
        self,
        progress: Callable[[str], None] = lambda msg: None,
        timeout_s: float = 300.0,
        interrupted: Callable[[], bool] | None = None,
    ) -> LocalStack:
        """Start every service and wait until all are healthy; on any failure (or Ctrl-C) stop what started.

        The services run in sessions of their own, so nothing else would stop them.

        `interrupted`: whether to abandon the start (a stop signal came); it is polled while the
        services come up, and start() then stops them and raises StartInterrupted. A signal handler
        that raises instead (KeyboardInterrupt) can be lost: a signal handled inside a __del__, as
        when a health check's gRPC channel is collected, has its exception ignored, and the start
        carries on.
        """
        self._interrupted = interrupted
        try:
            self._start(progress, timeout_s)
        except BaseException:
            self.stop()
            raise
        finally:
            self._interrupted = None
        return self

    def _start(self, progress: Callable[[str], None], timeout_s: float) -> None:
        c = self.config
        data_dir = c.data_dir
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="shardline-")
            data_dir = Path(self._tmp.name)
        self.files_dir = str(Path(data_dir) / "files")
        if c.redis_url is None:
            # Its start may take seconds (an AOF to replay): a stop signal ends it there too.
            self.redis = EmbeddedRedis(Path(data_dir) / "redis").start(check=self._check_interrupt)
            self.redis_url = self.redis.url
            progress(f"redis      {self.redis_url} (embedded, AOF in {data_dir}/redis)")
        deadline = time.monotonic() + timeout_s
        for spec in self.services():
            child = self._spawn(spec.name, spec.settings, spec.health, spec.service)
            if spec.ready_first:
                self._wait_healthy([child], progress, deadline)
        self.wait_ready(progress, max(0.0, deadline - time.monotonic()))
        self._check_interrupt()

    def services(self) -> list[ServiceSpec]:
        """The services start() runs, in start order (stop() goes the other way); a new one goes here."""
        c = self.config
        tracing = ServiceSpec(
            "tracing",
            {"HOST": LOOPBACK, "OTLP_PORT": c.otlp_port, "HTTP_PORT": c.dashboard_port, "REDIS_URL": self.redis_url},
            f"127.0.0.1:{c.otlp_port}",
            ready_first=True,  # so that no service's first spans wait on retries
        )
        gateway = ServiceSpec(
            "gateway",
            {
                "HTTP_PORT": c.http_port,
                "GRPC_PORT": c.grpc_port,
                "GATEWAY_ID": "gateway-0",
                "TOKENIZER_ADDRESS": f"127.0.0.1:{c.tokenizer_port}",
                "SCHEDULER_ADDRESS": f"127.0.0.1:{c.scheduler_port}",
                # The Batch API: its records in the stack's Redis, its files in the data folder.
                "REDIS_URL": self.redis_url,
                "FILES_DIR": self.files_dir,
            },
            f"127.0.0.1:{c.grpc_port}",
        )
        return [
            *([tracing] if c.tracing else []),
            ServiceSpec(
                "tokenizer",
                {"HOST": LOOPBACK, "PORT": c.tokenizer_port, "MODEL": c.model},
                f"127.0.0.1:{c.tokenizer_port}",
            ),
            ServiceSpec(
                "scheduler",
                {
                    "HOST": LOOPBACK,
                    "PORT": c.scheduler_port,
                    "REDIS_URL": self.redis_url,
                    "AUTOSCALE_POLICY": c.autoscale,
                    "AUTOSCALE_MIN_WORKERS": c.min_workers,
                    "AUTOSCALE_MAX_WORKERS": max(c.max_workers, c.min_workers),
                },
                f"127.0.0.1:{c.scheduler_port}",
            ),
            *(self._worker(i, "prefill") for i in range(c.prefill_workers)),
            *(self._worker(i) for i in range(c.workers)),
            gateway,
            *(self._batch_worker(i) for i in range(c.batch_workers)),
        ]

    def _batch_worker(self, index: int) -> ServiceSpec:
        c, port = self.config, free_port()
        return ServiceSpec(
            f"batch-{index}",
            {
                "REDIS_URL": self.redis_url,
                "GATEWAY_URL": f"http://127.0.0.1:{c.http_port}",
                "GATEWAY_GRPC_ADDRESS": f"127.0.0.1:{c.grpc_port}",
                "FILES_DIR": self.files_dir,
                "BATCH_HEALTH_PORT": port,
            },
            f"http://127.0.0.1:{port}/health",
            service="batch",
        )

    def add_worker(self, index: int) -> Child:
        spec = self._worker(index)
        return self._spawn(spec.name, spec.settings, spec.health, spec.service)

    def remove(self, name: str) -> subprocess.Popen:
        """Takes a service out of the stack (no longer supervised) and SIGTERMs it; the caller reaps it."""
        child = next(c for c in self.children if c.name == name)
        self.children.remove(child)
        _signal_group(child.proc, signal.SIGTERM)
        return child.proc

    def _worker(self, index: int, role: str | None = None) -> ServiceSpec:
        """Worker `index` that runs requests, or with role "prefill", prefill worker `index`."""
        c = self.config
        if role is None:
            role = "decode" if c.prefill_workers else "both"
            port = c.worker_base_port + index if c.worker_base_port else free_port()
        else:  # worker_base_port numbers the workers that run requests
            port = free_port()
        self.worker_ports.append(port)
        name = f"prefill-{index}" if role == "prefill" else f"worker-{index}"
        return ServiceSpec(
            name,
            {
                "HOST": LOOPBACK,
                "PORT": port,
                "WORKER_ID": name,
                "ROLE": role,
                "ADVERTISE_ADDRESS": f"127.0.0.1:{port}",
                "SCHEDULER_ADDRESS": f"127.0.0.1:{c.scheduler_port}",
                "MODEL": c.model,
                "TP_SIZE": c.tp_size,
                "LORA_ADAPTERS": c.lora_adapters or None,
            },
            f"127.0.0.1:{port}",
            service="worker",
        )

    def _spawn(self, name: str, settings: dict[str, object], health: str | None, service: str | None = None) -> Child:
        self._check_interrupt()  # a stop signal during the start: start nothing more
        env = {
            **_own_environ(),
            "SHARDLINE_TRACING": "1" if self.config.tracing else "0",
            "SHARDLINE_INSTANCE_ID": name,
            "PYTHONUNBUFFERED": "1",
        }
        if self.config.tracing:
            env["SHARDLINE_OTLP_ENDPOINT"] = f"127.0.0.1:{self.config.otlp_port}"
        env.update({f"SHARDLINE_{k}": str(v) for k, v in self.config.env.items()})
        env.update({f"SHARDLINE_{k}": str(v) for k, v in settings.items() if v is not None})
        argv = [sys.executable, "-m", "shardline.cli.main", "serve", service or name]
        with signals_deferred():
            child = Child(name, self._popen(name, argv, env), health, argv=argv, env=env)
            self.children.append(child)
        return child

    def _popen(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        if self.config.log_dir is None:
            return subprocess.Popen(dying_with_parent(argv), env=env, start_new_session=True)
        self.config.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.config.log_dir / f"{name}.log", "ab") as out:  # the child keeps its own copy
            return subprocess.Popen(
                dying_with_parent(argv), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def restart(self, child: Child) -> None:
        """Start a dead service again with its old settings; state it needs comes back from Redis."""
        _signal_group(child.proc, signal.SIGKILL)  # whatever it left behind (TP ranks) goes first
        child.proc.wait()
        with signals_deferred():
            child.proc = self._popen(child.name, child.argv, child.env)
        child.ready = False

    def wait_ready(self, progress: Callable[[str], None], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        self._wait_healthy(self.children, progress, deadline)
        url = f"http://127.0.0.1:{self.config.http_port}/health"
        while not http_ok(url):  # the gateway is healthy once it reaches the scheduler and a worker is up
            self._check_interrupt()
            if time.monotonic() > deadline:
                raise TimeoutError(f"gateway /health not OK after {timeout_s:.0f}s")
            time.sleep(0.2)

    def _check_interrupt(self) -> None:
        if self._interrupted is not None and self._interrupted():
            raise StartInterrupted("interrupted while starting")

    def _last_words(self, child: Child) -> str:
        """With --log-dir, the end of a failed child's log (what it said on stderr, otherwise)."""
        if self.config.log_dir is None:
            return ""
        try:
            lines = (self.config.log_dir / f"{child.name}.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        tail = [line for line in lines if line.strip()][-3:]
        return "".join(f"\n  {line}" for line in tail)

    def _wait_healthy(self, children: list[Child], progress: Callable[[str], None], deadline: float) -> None:
        pending = [child for child in children if not child.ready]
        while pending:
            for child in list(pending):
                self._check_interrupt()
                if child.proc.poll() is not None:
                    raise RuntimeError(
                        f"{child.name} exited with code {child.proc.returncode} while starting"
                        + self._last_words(child)
                    )
                if child.health is None or healthy(child.health):
                    progress(f"{child.name:<10} ready" + (f" ({child.health})" if child.health else ""))
                    child.ready = True
                    pending.remove(child)
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready in time: {', '.join(c.name for c in pending)}")
            time.sleep(0.2)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send a signal to one service's whole process group (tests use this to simulate a crash)."""
        child = next(c for c in self.children if c.name == name)
        os.killpg(child.proc.pid, sig)
        child.proc.wait(timeout=30)

    def dead_children(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is not None]

    def supervised(self) -> list[SupervisedProcess]:
        """The embedded Redis (restarted on its port and AOF) and every service, as a Supervisor sees them."""
        services = []
        if self.redis is not None:
            services.append(SupervisedProcess("redis", self.redis.exit_code, self.redis.respawn))
        for child in self.children:
            services.append(SupervisedProcess(child.name, child.exit_code, functools.partial(self.restart, child)))
        return services

    def supervisor(self, report: Callable[[str], None], policy: BackoffPolicy | None = None) -> Supervisor:
        """A supervisor of this stack's processes; call its check() from the thread that started them."""
        return Supervisor(self.supervised, policy or BackoffPolicy(), report)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM in reverse start order, then SIGKILL whatever is left; no orphans.

        The tracing service goes last, once the others have exited, so it receives the spans they flush on exit.
        """
        deadline = time.monotonic() + timeout_s
        services = [child for child in reversed(self.children) if child.name != "tracing"]
        for group in (services, [child for child in self.children if child.name == "tracing"]):
            for child in group:
                if child.proc.poll() is None:
                    _signal_group(child.proc, signal.SIGTERM)
            for child in group:
                try:
                    child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in time: killing it", child.name)
                _signal_group(child.proc, signal.SIGKILL)  # its TP ranks too, if any outlived it
                child.proc.wait()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _own_environ() -> dict[str, str]:
    """This process's environment, less the malloc settings it was restarted under (`shardline bench
    --engine`): those are a CPU worker's, which it sets for itself; the user's own pass through."""
    if REEXEC_MARKER not in os.environ:
        return dict(os.environ)
    return {k: v for k, v in os.environ.items() if k not in MALLOC_ENV and k != REEXEC_MARKER}
