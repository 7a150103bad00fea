"""Signals held back across a critical section (see signals_deferred)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

# The signals that stop `shardline up` and the stacks it runs: Ctrl-C, kill, a closed terminal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


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
    received: list[signal.Signals] = []
    previous = {
        sig: signal.signal(sig, lambda sig, frame: received.append(signal.Signals(sig))) for sig in STOP_SIGNALS
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            # None: a handler installed outside Python, which cannot be put back; the default is closest.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for sig in received:
            signal.raise_signal(sig)
