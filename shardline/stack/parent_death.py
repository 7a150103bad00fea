"""Children that die with their parent: `python -m shardline.stack.parent_death PID -- ARGV...`.

A stack's services and its Redis must never outlive the process that started them, however it
dies (SIGKILL included). Linux's PR_SET_PDEATHSIG does that, and survives exec; this small
launcher sets it, then execs the real program. It used to be set by a Popen preexec_fn, but a
preexec_fn runs Python between fork and exec in a copy of a process whose other threads may hold
gRPC's or the interpreter's locks: the autoscaler's forks, made while a dozen streams were open,
died of SIGSEGV before their exec. Here nothing runs between the fork and the exec.

The parent named on the command line is checked after the prctl: a parent that died between the
fork and the prctl sends no signal, so a launcher that finds another parent ends before its exec.
(`up` killed while starting its worker left the worker registering with a dead scheduler for ever.)
The signal comes when the *thread* that forked the child ends: start children from the thread
that lives as long as they should (see Supervisor).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def dying_with_parent(argv: list[str], parent_pid: int | None = None) -> list[str]:
    """The command line that runs argv as a child that gets SIGTERM when this process dies."""
    if not sys.platform.startswith("linux"):  # no PR_SET_PDEATHSIG: run it as it is
        return argv
    parent = os.getpid() if parent_pid is None else parent_pid
    return [sys.executable, "-m", "shardline.stack.parent_death", str(parent), "--", *argv]


def main(args: list[str]) -> None:
    parent, separator, *argv = args
    if separator != "--" or not argv:
        sys.exit("usage: python -m shardline.stack.parent_death PARENT_PID -- PROGRAM [ARGS...]")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        sys.exit(f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
    if os.getppid() != int(parent):  # orphaned already: nothing to run, nothing to clean up
        os.kill(os.getpid(), signal.SIGKILL)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
