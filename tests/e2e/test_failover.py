"""Kill a worker mid-stream: the scheduler re-dispatches, and the client's stream goes on unbroken
with exactly the tokens an unbroken run gives (sampling is a pure function of seed and index)."""

from __future__ import annotations

import time

import pytest

from shardline.client import ShardlineClient
from shardline.stack import StackConfig
from tests.e2e.conftest import log_dir, running_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    config = StackConfig.on_free_ports(workers=2, data_dir=tmp_path_factory.mktemp("failover-data"),
                                       log_dir=log_dir(tmp_path_factory, "failover"),
                                       env={"HEARTBEAT_INTERVAL_S": "0.5", "KV_CACHE_BYTES": str(64 << 20)})
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
