"""Two tenants on the real stack, one sending ten times the other's load: the light tenant's requests
are served as if it were alone, each overtaking the heavy tenant's backlog (VTC), where arrival
order would put it behind all of it."""

from __future__ import annotations

import asyncio
import hashlib
import statistics
import threading

import grpc
import pytest

from shardline.client import ShardlineClient
from shardline.core.store.request_store import RequestStore
from shardline.proto import scheduler_pb2, scheduler_pb2_grpc
from shardline.stack.local_stack import StackConfig
from tests.e2e.conftest import log_dir, running_stack

pytestmark = pytest.mark.slow


def key_digest(key: str) -> str:
    """As the tenants file holds a key: its sha256 hex digest."""
    return hashlib.sha256(key.encode()).hexdigest()


HEAVY_CLIENTS = 10  # the light tenant runs one request at a time
LIGHT_REQUESTS = 4
TOKENS = 16


def test_a_tenant_sending_ten_times_more_does_not_delay_the_other(tmp_path_factory):
    data = tmp_path_factory.mktemp("tenants-data")
    tenants = data / "tenants.yaml"
    tenants.write_text(
        f"tenants:\n  heavy: {{keys: [{key_digest('k-heavy')}]}}\n  light: {{keys: [{key_digest('k-light')}]}}\n"
    )
    config = StackConfig.on_free_ports(
        data_dir=data,
        log_dir=log_dir(tmp_path_factory, "tenants"),
        # Overcommit 1: the worker holds only what it runs, so every wait is in the scheduler's fair
        # queue (a worker's own queue is in arrival order within a class).
        env={
            "KV_CACHE_BYTES": str(64 << 20),
            "MAX_NUM_SEQS": "4",
            "DISPATCH_OVERCOMMIT": "1",
            "TENANTS_FILE": str(tenants),
        },
    )
    target = f"127.0.0.1:{config.grpc_port}"
    params = dict(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    with (
        running_stack(config) as stack,
        ShardlineClient(target, api_key="k-heavy", timeout=300) as heavy,
        ShardlineClient(target, api_key="k-light", timeout=300) as light,
        grpc.insecure_channel(f"127.0.0.1:{config.scheduler_port}") as channel,
    ):
        scheduler = scheduler_pb2_grpc.SchedulerStub(channel)

        def light_run() -> tuple[str, float]:
            done = light.generate("Light: name a colour.", **params)
            info = light.get_request(done.request_id)
            return done.request_id, info.first_token_time - info.arrival_time

        alone = [light_run()[1] for _ in range(LIGHT_REQUESTS)]

        stop = threading.Event()
        heavy_ids: list[str] = []

        def flood(index: int) -> None:
            # Lengths spread out, so that the heavy requests end one by one rather than in step.
            flood_params = {**params, "max_tokens": 8 + (5 * index) % 17}
            while not stop.is_set():
                heavy_ids.append(heavy.generate(f"Heavy {index}: write a line.", **flood_params).request_id)

        threads = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(HEAVY_CLIENTS)]
        for thread in threads:
            thread.start()
        backlog, beside = [], []
        for _ in range(LIGHT_REQUESTS):
            backlog.append(_heavy_backlog(scheduler, at_least=3))
            beside.append(light_run())
        stop.set()
        for thread in threads:
            thread.join(timeout=300)
        records = asyncio.run(_records(stack.redis_url, heavy_ids + [rid for rid, _ in beside]))

    light_ttft = [ttft for _, ttft in beside]
    print(
        f"light TTFT p50 alone {statistics.median(alone):.2f}s, beside the flood {statistics.median(light_ttft):.2f}s"
    )
    print(f"heavy requests queued as each light one came: {backlog}")
    # Each light request waited for at most the one heavy request a tie sends first, and those the
    # worker's own queue held already, not for the heavy backlog queued before it (FIFO's order).
    heavy_dispatches = sorted(records[rid].dispatch_ts for rid in heavy_ids if records[rid].dispatch_ts)
    for (request_id, _), queued in zip(beside, backlog, strict=True):
        record = records[request_id]
        overtaken_by = sum(record.arrival_ts < ts < record.dispatch_ts for ts in heavy_dispatches)
        assert overtaken_by <= 1, (request_id, overtaken_by, queued)
    # And so its first token comes about as soon as alone, plus the wait for a slot to free up: at
    # most one heavy request's time on the worker, where arrival order would add the whole backlog's.
    heavy_service = statistics.median(
        records[rid].finish_ts - records[rid].dispatch_ts for rid in heavy_ids if records[rid].dispatch_ts
    )
    print(f"a heavy request's time on the worker: {heavy_service:.2f}s")
    assert statistics.median(light_ttft) <= statistics.median(alone) + heavy_service, (alone, light_ttft)


def _heavy_backlog(scheduler: scheduler_pb2_grpc.SchedulerStub, at_least: int) -> int:
    """Waits until the heavy tenant has `at_least` requests queued in the scheduler; how many."""
    for _ in range(600):
        queued = scheduler.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5).queue_depth_by_tenant.get("heavy", 0)
        if queued >= at_least:
            return queued
        threading.Event().wait(0.05)
    raise AssertionError(f"the heavy tenant never had {at_least} requests queued")


async def _records(redis_url: str, request_ids: list[str]):
    async with RequestStore(redis_url) as store:
        return {rid: await store.get(rid) for rid in request_ids}
