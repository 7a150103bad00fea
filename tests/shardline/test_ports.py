"""free_port: ports that outgoing connections will not take before a service binds them."""

import socket

from shardline.ports import _ephemeral_start, free_port


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)  # never handed out twice by one process
    start = _ephemeral_start()
    if start > 11000:
        assert all(port < start for port in ports)
    for port in ports[:20]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
