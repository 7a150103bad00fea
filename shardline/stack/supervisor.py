"""Restarts the services of a stack when they exit, with a capped exponential backoff for those that crash-loop.

The policy is Docker's restart policy and Kubernetes' CrashLoopBackOff: a service that exits
after a good run is restarted at once; one that keeps exiting soon after its start waits longer
before each new try (up to a cap), and is reported, while the others go on serving. Nothing is
ever given up on: a stack stays up as long as any part of it can serve.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    """When a service that exited is started again."""

    first_delay_s: float = 0.5  # the wait after the second quick exit in a row; it doubles with each further one
    max_delay_s: float = 30.0  # the cap on that wait, so a fixed service is back within this long
    healthy_after_s: float = 10.0  # a run at least this long ends a streak of quick exits
    crash_loop_exits: int = 3  # this many quick exits in a row: reported as crash-looping

    def __post_init__(self) -> None:
        # With no healthy window every exit would be a first one, restarted at once, without end.
        if self.healthy_after_s <= 0 or self.first_delay_s <= 0 or self.max_delay_s < self.first_delay_s:
            raise ValueError(f"a backoff needs healthy_after_s > 0 and 0 < first_delay_s <= max_delay_s: {self}")

    def delay_s(self, quick_exits: int) -> float:
        """The wait before the next start, after `quick_exits` exits in a row (this one included), each
        within healthy_after_s of its start. A first exit is restarted at once: one crash is the usual
        case (a SIGKILL, an OOM kill), and the sooner the service is back the less anyone notices."""
        if quick_exits <= 1:
            return 0.0
        return min(self.max_delay_s, self.first_delay_s * 2.0 ** (quick_exits - 2))


@dataclass(slots=True)
class SupervisedProcess:
    """One service as the supervisor sees it."""

    name: str  # how reports name it: "worker-1", "redis"
    exit_code: Callable[[], int | None]  # its exit status, or None while it runs
    restart: Callable[[], None]  # starts it again the way it was started; may raise


@dataclass(slots=True)
class ServiceRecord:
    """What the supervisor remembers of one service between checks."""

    started_at: float  # when its current run began (the clock's time)
    quick_exits: int = 0  # exits in a row, each within healthy_after_s of its start
    restarts: int = 0  # restarts since the supervisor first saw it
    restart_at: float | None = None  # while it waits out its backoff: when it is started again
    last_code: int | None = None  # the exit status of its last run


@dataclass(slots=True)
class Supervisor:
    """Call check() every fraction of a second, from the thread that started the services.

    That thread, not another: a child started with PR_SET_PDEATHSIG (shardline/stack/parent_death.py) is signalled
    when the thread that forked it ends, so a restart from a helper thread would take the service
    down with the thread.
    """

    services: Callable[[], Iterable[SupervisedProcess]]  # the current services, asked at every check
    policy: BackoffPolicy = field(default_factory=BackoffPolicy)
    report: Callable[[str], None] = log.warning  # where exits, restarts and crash loops are told
    clock: Callable[[], float] = time.monotonic
    records: dict[str, ServiceRecord] = field(default_factory=dict)

    def check(self) -> None:
        """Restart what exited and is due, note what has run long enough to count as healthy again."""
        now = self.clock()
        for service in self.services():
            record = self.records.setdefault(service.name, ServiceRecord(started_at=now))
            if record.restart_at is not None:
                if now >= record.restart_at:
                    self._restart(service, record, now)
                continue
            code = service.exit_code()
            if code is None:
                self._note_running(service, record, now)
            else:
                self._note_exit(service, record, code, now)

    def crash_looping(self) -> list[str]:
        """The services in a crash loop now: out of service, waiting out or trying a backoff restart."""
        return [name for name, record in self.records.items() if record.quick_exits >= self.policy.crash_loop_exits]

    def _note_running(self, service: SupervisedProcess, record: ServiceRecord, now: float) -> None:
        if record.quick_exits == 0 or now - record.started_at < self.policy.healthy_after_s:
            return
        if record.quick_exits >= self.policy.crash_loop_exits:
            self.report(
                f"{service.name} has run {now - record.started_at:.0f}s since its restart: "
                "back in service, its backoff cleared"
            )
        record.quick_exits = 0

    def _note_exit(self, service: SupervisedProcess, record: ServiceRecord, code: int, now: float) -> None:
        ran_s = now - record.started_at
        record.quick_exits = record.quick_exits + 1 if ran_s < self.policy.healthy_after_s else 1
        record.last_code = code
        delay_s = self.policy.delay_s(record.quick_exits)
        when = "now" if delay_s == 0 else f"in {delay_s:.1f}s"
        if record.quick_exits == self.policy.crash_loop_exits:
            self.report(
                f"{service.name} is crash-looping (exited {record.quick_exits} times in a row, each within "
                f"{self.policy.healthy_after_s:.0f}s of its start; last code {code}): out of service, "
                f"restarting it with backoff ({when}, then at most every {self.policy.max_delay_s:.0f}s); "
                "the other services keep running"
            )
        elif record.quick_exits > self.policy.crash_loop_exits:
            self.report(
                f"{service.name} is still crash-looping (exit {record.quick_exits} in a row, code {code}); "
                f"restarting it {when}"
            )
        elif record.restarts:
            self.report(f"{service.name} exited (code {code}) {ran_s:.1f}s after its restart; restarting it {when}")
        else:  # in its first run: when it started is not known here
            self.report(f"{service.name} exited (code {code}); restarting it {when}")
        record.restart_at = now + delay_s
        if delay_s == 0:
            self._restart(service, record, now)

    def _restart(self, service: SupervisedProcess, record: ServiceRecord, now: float) -> None:
        record.restart_at = None
        record.started_at = now
        record.restarts += 1
        try:
            service.restart()
        except Exception as exc:  # one failed start must not end the supervision of every service
            # A start that failed is one more quick exit: it backs off further, as a crash would.
            self.report(f"{service.name} could not be restarted: {exc}")
            self._note_exit(service, record, record.last_code if record.last_code is not None else -1, now)
