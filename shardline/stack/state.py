"""Where a running `shardline up` stack listens, kept in its data folder for `shardline status` to find."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_NAME = "stack.json"


class StackNotRunning(Exception):
    """No `shardline up` is running on the data folder asked about."""


@dataclass(slots=True)
class ServiceEntry:
    """One service of a running stack."""

    name: str  # as `up` names it: "worker-0"
    address: str | None  # its gRPC health check's address; None: it has none
    pid: int  # its process (of its latest start)


@dataclass(slots=True)
class StackState:
    """What `up` writes once its stack is up, and removes when it stops."""

    pid: int  # the `shardline up` process
    started_at: float  # when it was up (Unix time)
    redis_url: str  # the stack's Redis, password included: the file is the user's alone
    scheduler_address: str  # its public rpcs: ListWorkers, GetStats
    http_url: str  # the gateway's OpenAI-compatible HTTP root
    grpc_address: str  # the gateway's gRPC API
    dashboard_url: str | None  # the trace dashboard; None without tracing
    log_dir: str | None  # where the services log; None: to up's console
    services: list[ServiceEntry] = field(default_factory=list)  # in start order

    def write(self, data_dir: Path) -> None:
        """Replaces the folder's state in one step, so that a reader never sees half of it."""
        data_dir.mkdir(parents=True, exist_ok=True)
        tmp = data_dir / f".{STATE_NAME}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f, indent=2)
        os.replace(tmp, data_dir / STATE_NAME)

    @classmethod
    def read(cls, data_dir: Path) -> StackState:
        """The state of the stack running on `data_dir`; StackNotRunning when there is none."""
        path = data_dir / STATE_NAME
        hint = "`shardline up` starts one; --data-dir names another stack's folder"
        try:
            raw = json.loads(path.read_text())
            services = [ServiceEntry(**s) for s in raw.pop("services")]
            state = cls(**raw, services=services)
        except FileNotFoundError:
            raise StackNotRunning(f"no stack is running on {data_dir} ({hint})") from None
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise StackNotRunning(f"{path} cannot be read ({exc}); is a stack running? ({hint})") from None
        if not pid_alive(state.pid):
            raise StackNotRunning(
                f"no stack is running on {data_dir}: the one started there (pid {state.pid}) has exited ({hint})"
            )
        return state

    def remove(self, data_dir: Path) -> None:
        """Removes the folder's state if it is still this stack's."""
        try:
            if json.loads((data_dir / STATE_NAME).read_text()).get("pid") == self.pid:
                (data_dir / STATE_NAME).unlink()
        except (OSError, ValueError, AttributeError):
            pass

    def uptime_s(self) -> float:
        return max(0.0, time.time() - self.started_at)


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (and is no zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: it exists
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"
