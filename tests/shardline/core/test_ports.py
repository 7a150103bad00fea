"""free_port: ports that outgoing connections will not take before a service binds them."""

import socket

from shardline.core.ports import _ephemeral_start, free_port


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)  # never handed out twice by one process
    start = _ephemeral_start()
    if start > 11000:
        assert all(port < start for port in ports)
    for port in ports[:20]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_each_stack_gets_internal_ports_of_its_own():
    """Two `shardline up` on one machine: the second must not find (and join) the first's tokenizer and
    scheduler on fixed ports. Only the public ports are fixed; a given internal port is kept."""
    from shardline.stack.local_stack import StackConfig

    first, second = StackConfig(), StackConfig()
    assert (first.http_port, first.grpc_port) == (second.http_port, second.grpc_port) == (8000, 50051)
    internal = [first.tokenizer_port, first.scheduler_port, second.tokenizer_port, second.scheduler_port]
    assert len(set(internal)) == 4 and 0 not in internal
    assert first.worker_base_port == 0  # a free port per worker
    assert StackConfig(scheduler_port=7001).scheduler_port == 7001
