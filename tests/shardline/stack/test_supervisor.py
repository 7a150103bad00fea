"""Supervisor: the restart policy on a fake clock, then on real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

from shardline.stack.supervisor import BackoffPolicy, SupervisedProcess, Supervisor

POLICY = BackoffPolicy(first_delay_s=0.5, max_delay_s=4.0, healthy_after_s=10.0, crash_loop_exits=3)


@dataclass
class FakeClock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeService:
    """A service whose exits the test decides; it records when it was restarted."""

    name: str
    clock: FakeClock
    code: int | None = None
    starts: list[float] = field(default_factory=list)

    def restart(self) -> None:
        self.starts.append(self.clock.now)
        self.code = None

    def supervised(self) -> SupervisedProcess:
        return SupervisedProcess(self.name, lambda: self.code, self.restart)


def make(*names: str) -> tuple[FakeClock, dict[str, FakeService], Supervisor, list[str]]:
    clock = FakeClock()
    services = {name: FakeService(name, clock) for name in names}
    reports: list[str] = []
    supervisor = Supervisor(lambda: [s.supervised() for s in services.values()], POLICY, reports.append, clock)
    supervisor.check()  # first sight: every service starts its first run now
    return clock, services, supervisor, reports


def crash_and_wait(clock: FakeClock, service: FakeService, supervisor: Supervisor, after_s: float) -> float:
    """Let it run `after_s`, kill it, and check every 1/8 s until it is restarted; returns the wait."""
    clock.now += after_s
    supervisor.check()
    service.code = -9
    before = len(service.starts)
    died = clock.now
    for _ in range(1000):
        supervisor.check()
        if len(service.starts) > before:
            return service.starts[-1] - died
        clock.now += 0.125  # exact in binary, so the waits compare equal
    raise AssertionError(f"{service.name} was never restarted")


def test_delays_double_from_the_second_quick_exit_and_are_capped():
    assert [POLICY.delay_s(n) for n in range(1, 8)] == [0.0, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_a_first_exit_is_restarted_at_once():
    clock, services, supervisor, reports = make("worker-0")
    assert crash_and_wait(clock, services["worker-0"], supervisor, after_s=60) == 0
    assert crash_and_wait(clock, services["worker-0"], supervisor, after_s=60) == 0
    assert reports == [
        "worker-0 exited (code -9); restarting it now",
        "worker-0 exited (code -9) 60.0s after its restart; restarting it now",
    ]


def test_a_crash_loop_backs_off_is_reported_once_and_leaves_the_others_alone():
    clock, services, supervisor, reports = make("worker-0", "worker-1", "gateway")
    victim = services["worker-1"]
    waits = [crash_and_wait(clock, victim, supervisor, after_s=1.0) for _ in range(6)]
    assert waits == [0.0, 0.5, 1.0, 2.0, 4.0, 4.0]
    looping = [r for r in reports if "is crash-looping" in r]
    assert len(looping) == 1 and looping[0].startswith("worker-1 is crash-looping (exited 3 times in a row")
    assert "out of service" in looping[0] and "the other services keep running" in looping[0]
    assert sum("still crash-looping" in r for r in reports) == 3
    assert supervisor.crash_looping() == ["worker-1"]
    assert services["worker-0"].starts == [] and services["gateway"].starts == []


def test_a_run_past_the_healthy_window_clears_the_backoff():
    clock, services, supervisor, reports = make("scheduler")
    victim = services["scheduler"]
    for _ in range(4):
        crash_and_wait(clock, victim, supervisor, after_s=1.0)
    assert supervisor.crash_looping() == ["scheduler"]
    clock.now += POLICY.healthy_after_s
    supervisor.check()
    assert supervisor.crash_looping() == []
    assert reports[-1].startswith("scheduler has run 10s since its restart: back in service")
    assert crash_and_wait(clock, victim, supervisor, after_s=1.0) == 0  # a fresh streak: at once again


def test_exits_spread_wider_than_the_healthy_window_never_back_off():
    clock, services, supervisor, reports = make("tokenizer")
    waits = [crash_and_wait(clock, services["tokenizer"], supervisor, after_s=11.0) for _ in range(5)]
    assert waits == [0.0] * 5 and not any("crash-looping" in r for r in reports)


def test_a_failed_restart_counts_as_another_quick_exit():
    clock, services, supervisor, reports = make("gateway")
    gateway = services["gateway"]
    attempts: list[float] = []

    def cannot_start() -> None:
        attempts.append(clock.now)
        raise OSError("log folder gone")

    supervisor.services = lambda: [SupervisedProcess("gateway", lambda: gateway.code, cannot_start)]
    clock.now += 30
    gateway.code = 1
    for _ in range(32):  # 4 s of checks
        supervisor.check()
        clock.now += 0.125
    assert [t - attempts[0] for t in attempts] == [0.0, 0.5, 1.5, 3.5]
    assert "gateway could not be restarted: log folder gone" in reports


def test_a_restart_that_raises_anything_is_reported_and_retried():
    clock, services, supervisor, reports = make("redis")
    redis_server = services["redis"]

    def binary_gone() -> None:
        raise RuntimeError("no redis-server binary")

    supervisor.services = lambda: [SupervisedProcess("redis", lambda: redis_server.code, binary_gone)]
    redis_server.code = -9
    supervisor.check()
    assert reports[-1].startswith("redis exited (code -9) 0.0s after its restart; restarting it in 0.5s")
    assert "redis could not be restarted: no redis-server binary" in reports


def test_a_policy_without_a_healthy_window_is_refused():
    with pytest.raises(ValueError, match="healthy_after_s > 0"):
        BackoffPolicy(healthy_after_s=0)
    with pytest.raises(ValueError):
        BackoffPolicy(first_delay_s=2.0, max_delay_s=1.0)


def test_a_service_added_later_is_supervised_from_its_first_check():
    clock, services, supervisor, reports = make("worker-0")
    services["worker-1"] = FakeService("worker-1", clock)
    assert crash_and_wait(clock, services["worker-1"], supervisor, after_s=0.5) == 0


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


@pytest.mark.timeout(30)
def test_real_processes_killed_in_a_loop_back_off_while_a_sibling_runs_on():
    procs = {"flaky": _sleeper(), "steady": _sleeper()}
    steady_pid = procs["steady"].pid

    def restart(name: str) -> None:
        procs[name] = _sleeper()

    reports: list[str] = []
    policy = BackoffPolicy(first_delay_s=0.4, max_delay_s=0.8, healthy_after_s=5.0, crash_loop_exits=3)
    supervisor = Supervisor(
        lambda: [SupervisedProcess(n, p.poll, lambda n=n: restart(n)) for n, p in procs.items()], policy, reports.append
    )
    supervisor.check()
    waits = []
    try:
        for _ in range(4):
            os.kill(procs["flaky"].pid, signal.SIGKILL)
            died, pid = time.monotonic(), procs["flaky"].pid
            while procs["flaky"].pid == pid:
                supervisor.check()
                time.sleep(0.02)
            waits.append(time.monotonic() - died)
        assert waits[0] < 0.5  # at once, give or take a loaded machine's scheduling
        for wait, backoff in zip(waits[1:], [0.4, 0.8, 0.8]):  # doubled, then capped
            assert backoff - 0.05 <= wait < backoff + 0.5, waits
        assert procs["steady"].pid == steady_pid and procs["steady"].poll() is None
        assert supervisor.crash_looping() == ["flaky"]
        assert any("flaky is crash-looping" in r and "code -9" in r for r in reports)
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
