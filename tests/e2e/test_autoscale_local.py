"""The local autoscaling driver on the real stack: a load ramp takes one worker to three, and the end of
the load drains them back to one, with every request served once and exactly.

`shardline up --autoscale` in miniature: the scheduler decides and drains, a LocalWorkerScaler in
this thread (the one that started the stack, as `up`'s is) starts and stops the worker processes.
The workers run batch-invariant, so a request moved off a drained worker continues with bitwise
the tokens an unmoved run gives.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from shardline.cli import status_cmd
from shardline.client import ShardlineClient
from shardline.core.store.request_record import RequestStatus
from shardline.core.store.request_store import RequestStore
from shardline.proto import scheduler_pb2, scheduler_pb2_grpc
from shardline.stack.local_scaler import LocalWorkerScaler
from shardline.stack.local_stack import StackConfig
from tests.e2e.conftest import log_dir, running_stack

pytestmark = pytest.mark.slow

RAMP_CLIENTS = 10
RAMP_TOKENS = 24
# One per worker once the ramp is over (least-loaded routing, distinct prefixes), so that the two
# workers drained away each hold one when their drain begins.
LONG_PROMPTS = ["Write a story about a lighthouse.", "List facts about whales.", "Explain how bread rises."]
SCALE_DOWN_WINDOW_S = 8


def test_ramp_scales_out_and_drains_back(tmp_path_factory, capsys):
    config = StackConfig.on_free_ports(
        workers=1,
        autoscale="reactive",
        min_workers=1,
        max_workers=3,
        data_dir=tmp_path_factory.mktemp("autoscale-data"),
        log_dir=log_dir(tmp_path_factory, "autoscale"),
        env={
            "HEARTBEAT_INTERVAL_S": "0.5",
            "KV_CACHE_BYTES": str(64 << 20),
            "MAX_NUM_SEQS": "4",
            "BATCH_INVARIANT": "1",
            "AUTOSCALE_INTERVAL_S": "1",
            # Long enough for the long requests to start on the full pool before it shrinks; the
            # drain timeout short enough that the drained workers' requests move.
            "AUTOSCALE_SCALE_DOWN_WINDOW_S": str(SCALE_DOWN_WINDOW_S),
            "AUTOSCALE_DRAIN_TIMEOUT_S": "3",
        },
    )
    with running_stack(config) as stack, ShardlineClient(f"127.0.0.1:{config.grpc_port}", timeout=300) as client:
        scaler = LocalWorkerScaler(stack, report=lambda msg: print(msg, flush=True), poll_s=0.5)
        channel = grpc.insecure_channel(f"127.0.0.1:{config.scheduler_port}")
        follow = _Follower(scaler, scheduler_pb2_grpc.SchedulerStub(channel))

        stop = threading.Event()
        ramp_ids: list[str] = []
        ramp_s: list[float] = []
        errors: list[BaseException] = []

        def ramp(index: int) -> None:
            try:
                while not stop.is_set():
                    t0 = time.monotonic()
                    done = client.generate(f"Ramp {index}: tell me a fact.", max_tokens=RAMP_TOKENS, ignore_eos=True)
                    assert done.finish_reason == "length" and len(done.token_ids) == RAMP_TOKENS
                    ramp_ids.append(done.request_id)
                    ramp_s.append(time.monotonic() - t0)
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                errors.append(exc)

        clients = [threading.Thread(target=ramp, args=(i,), daemon=True) for i in range(RAMP_CLIENTS)]
        for thread in clients:
            thread.start()
        scaled_out_s = follow.until(lambda s: s.ready == 3, 240, "three ready workers")
        capsys.readouterr()
        status_cmd._print_scheduler(f"127.0.0.1:{config.scheduler_port}")  # what `shardline status` shows
        status = capsys.readouterr().out
        assert "autoscaler (reactive): " in status and "3 ready" in status and "forecast" in status, status
        stop.set()
        for thread in clients:
            thread.join(timeout=120)
        # Long enough to still run when the pool shrinks, on a quiet machine as on a loaded one: the
        # count falls a scale-down window (or a cold start, the longer) after the load's end.
        hold_s = max(SCALE_DOWN_WINDOW_S, follow.scale().cold_start_s) + 10
        token_s = sorted(ramp_s)[len(ramp_s) // 2] / RAMP_TOKENS  # per token at batch 4: an over-estimate
        params = dict(max_tokens=min(1500, math.ceil(hold_s / token_s)), temperature=0.0, ignore_eos=True)

        long_runs: dict[str, list[int]] = {}
        started_on: dict[str, str] = {}
        long_ids: list[str] = []

        def long_run(prompt: str) -> None:
            tokens: list[int] = []
            for chunk in client.stream(prompt, **params):
                if chunk.token_ids and not tokens:
                    started_on[prompt] = client.get_request(chunk.request_id).worker_id
                    long_ids.append(chunk.request_id)
                tokens += chunk.token_ids
            long_runs[prompt] = tokens

        longs = []
        for prompt in LONG_PROMPTS:  # one at a time, so that each goes to the least loaded worker
            longs.append(threading.Thread(target=long_run, args=(prompt,), daemon=True))
            longs[-1].start()
            follow.until(lambda s, prompt=prompt: prompt in started_on, 120, "a long request to start")
        assert len(set(started_on.values())) == 3, started_on
        drained_s = follow.until(
            lambda s: s.desired == 1 and s.ready == 1 and not (s.draining or s.retired) and len(scaler.workers()) == 1,
            240,
            "the pool to drain back to one worker",
        )
        for thread in longs:
            thread.join(timeout=300)
        # The unscaled run: the same requests together on the one worker left (batch invariance
        # makes that the same as one by one).
        with ThreadPoolExecutor(len(LONG_PROMPTS)) as pool:
            runs = pool.map(lambda prompt: client.generate(prompt, **params).token_ids, LONG_PROMPTS)
            reference = dict(zip(LONG_PROMPTS, runs))
        channel.close()
        print(f"scaled out in {scaled_out_s:.1f}s; drained back in {drained_s:.1f}s; long: {params}")
        records = asyncio.run(_records(stack.redis_url, ramp_ids + long_ids))

    assert not errors, errors
    assert ramp_ids and len(set(ramp_ids)) == len(ramp_ids)
    # Two long requests were on workers drained away while they ran: they moved, and every long
    # request has exactly the tokens of an unscaled run.
    survivors = set(scaler.workers())
    assert sum(worker not in survivors for worker in started_on.values()) == 2, (started_on, survivors)
    assert long_runs == reference
    # The scheduler's records: each request once, finished, with all its tokens; scaling failed none.
    for record, tokens in records:
        assert record.status == RequestStatus.FINISHED, record
        assert record.attempt == 1, record  # a drain's move is not a failed attempt
        assert len(tokens) == (params["max_tokens"] if record.request_id in long_ids else RAMP_TOKENS)


class _Follower:
    """Runs the local driver in this thread while waiting for the scheduler's scale to reach a state."""

    def __init__(self, scaler: LocalWorkerScaler, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        self._scaler = scaler
        self._stub = stub

    def scale(self) -> scheduler_pb2.ModelScale | None:
        stats = self._stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
        return stats.scale[0] if stats.scale else None

    def until(self, done: Callable[[scheduler_pb2.ModelScale], bool], timeout_s: float, what: str) -> float:
        start = time.monotonic()
        while True:
            self._scaler.check()
            scale = self.scale()
            if scale is not None and done(scale):
                return time.monotonic() - start
            assert time.monotonic() - start < timeout_s, f"no {what} after {timeout_s}s: {scale}"
            time.sleep(0.2)


async def _records(redis_url: str, request_ids: list[str]):
    async with RequestStore(redis_url) as store:
        return [(await store.get(rid), await store.get_tokens(rid)) for rid in request_ids]
