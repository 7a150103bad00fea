"""Signals held back across a critical section (see signals_deferred), and children that die with their parent."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

# The signals that stop `shardline up` and the stacks it runs: Ctrl-C, kill, a closed terminal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None) -> Callable[[], None]:
    """A Popen preexec_fn: the child gets SIGTERM when its parent dies, however it dies (SIGKILL
    included), so a stack's services never outlive the process that started them. Linux only.

    Call it in the parent (`preexec_fn=die_with_parent()`): it notes the parent's pid there. A
    parent that dies between the fork and the child's prctl sends no signal, so the child checks
    that its parent is still the one that forked it, and ends itself if not. (`up` killed while
    starting its worker left the worker running, registering with a dead scheduler for ever.)
    """
    parent = os.getpid() if parent_pid is None else parent_pid
    # Looked up in the parent: the child of a process with other threads (gRPC's) must not dlopen
    # between fork and exec, where a lock another thread held at the fork stays held (it crashed).
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
            if os.getppid() != parent:  # orphaned already: no exec, nothing to clean up
                os.kill(os.getpid(), signal.SIGKILL)

    return preexec


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP wait until the block ends, then take effect as they would have.

    Wrap the start of a child process and the line that records it: Ctrl-C inside Popen (after
    the fork, while it waits for the exec) raises out of it without killing the child, and
    before it is recorded nothing could stop it; either way it would outlive its parent.
    """
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield
        return
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda sig, frame: received.append(sig)) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            # None: a handler installed outside Python, which cannot be put back; the default is closest.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for sig in received:
            signal.raise_signal(sig)
