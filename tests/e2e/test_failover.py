"""Kill a worker mid-stream: the scheduler re-dispatches, and the client's stream goes on unbroken
with exactly the tokens an unbroken run gives (sampling is a pure function of seed and index)."""

from __future__ import annotations

import time

import pytest

from shardline.client import ShardlineClient
from shardline.stack.local_stack import StackConfig
from tests.e2e.conftest import log_dir, running_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    config = StackConfig.on_free_ports(
        workers=2,
        data_dir=tmp_path_factory.mktemp("failover-data"),
        log_dir=log_dir(tmp_path_factory, "failover"),
        env={"HEARTBEAT_INTERVAL_S": "0.5", "KV_CACHE_BYTES": str(64 << 20)},
    )
    with running_stack(config) as stack:
        yield stack


def test_worker_killed_mid_stream(two_workers):
    params = dict(max_tokens=48, temperature=0.8, seed=11, ignore_eos=True)
    with ShardlineClient(f"127.0.0.1:{two_workers.config.grpc_port}", timeout=120) as client:
        reference = client.generate("Tell me about the moon.", **params)
        stream = client.stream("Tell me about the moon.", **params)
        tokens: list[int] = []
        for chunk in stream:
            tokens += chunk.token_ids
            if len(tokens) >= 8:
                break
        victim = client.get_request(chunk.request_id).worker_id
        two_workers.kill(victim)  # SIGKILL: no goodbye, the Session stream just breaks
        t_kill = time.monotonic()
        for chunk in stream:
            tokens += chunk.token_ids
        info = client.get_request(chunk.request_id)
    assert chunk.finish_reason == "length"
    assert tokens == reference.token_ids
    assert info.attempt == 2 and info.worker_id not in ("", victim)
    assert time.monotonic() - t_kill < 60


def test_a_restarted_worker_rejoins(two_workers):
    """What `shardline up` does when a service dies: start it again; it registers and serves."""
    import grpc

    from shardline.proto import scheduler_pb2, scheduler_pb2_grpc

    def live_workers() -> set[str]:
        with grpc.insecure_channel(f"127.0.0.1:{two_workers.config.scheduler_port}") as ch:
            resp = scheduler_pb2_grpc.SchedulerStub(ch).ListWorkers(scheduler_pb2.ListWorkersRequest())
        return {w.worker.worker_id for w in resp.workers}

    dead = two_workers.dead_children()
    assert [c.name for c in dead] and len(live_workers()) == 1  # left so by the test above
    for child in dead:
        two_workers.restart(child)
    deadline = time.monotonic() + 90
    while live_workers() != {"worker-0", "worker-1"}:
        assert time.monotonic() < deadline, live_workers()
        time.sleep(0.5)
    with ShardlineClient(f"127.0.0.1:{two_workers.config.grpc_port}", timeout=120) as client:
        assert len(client.generate("Hello again", max_tokens=4, ignore_eos=True).token_ids) == 4
