"""A free local TCP port, for services, TP rendezvous and tests started on one machine."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (another process could still take it before the caller binds)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
