"""A free local TCP port, for services, TP rendezvous and tests started on one machine."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000
_handed_out: set[int] = set()  # by this process: never twice, even once they are free again


def free_port() -> int:
    """A port nothing listens on now (another process could still take it before the caller binds).

    Taken from below the kernel's ephemeral range when there is room there: a port the kernel
    hands out (bind to port 0) is one it may give any outgoing connection a moment later, and a
    service started seconds after its port was chosen then fails with EADDRINUSE.
    """
    start = _ephemeral_start()
    for _ in range(100):
        port = random.randrange(_LOWEST, start) if start > _LOWEST + 1000 else 0
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise OSError("no free local TCP port found")


def _ephemeral_start() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # unknown: let the kernel choose
