"""RequestStore against a real embedded Redis."""

import asyncio
import functools
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import redis
from redis.asyncio.connection import AbstractConnection

from shardline.core.ports import free_port
from shardline.core.store.request_record import FinishReason, RequestRecord, RequestStatus
from shardline.core.store.request_store import RequestStore, StoreUnavailable, pack_token_ids, unpack_token_ids
from shardline.proto import sampling_pb2

PARAMS = {"temperature": 0.7, "seed": 1234, "max_tokens": 16, "stop": ["\n\n"]}


def run_async(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Runs an async test in a fresh event loop (keeps the suite free of async plugins)."""

    @functools.wraps(test)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return wrapper


def record(request_id: str, arrival_ts: float | None = None) -> RequestRecord:
    return RequestRecord(
        request_id=request_id,
        model="smollm2-135m",
        params=PARAMS,
        gateway_id="gw-1",
        priority=2,
        arrival_ts=arrival_ts if arrival_ts is not None else time.time(),
    )


def test_enums_match_the_proto() -> None:
    for status in RequestStatus:
        assert sampling_pb2.RequestStatus.Value(f"REQUEST_STATUS_{status.name}") == status
    for reason in FinishReason:
        assert sampling_pb2.FinishReason.Value(f"FINISH_REASON_{reason.name}") == reason
    assert len(sampling_pb2.RequestStatus.keys()) == len(RequestStatus) + 1  # + UNSPECIFIED
    # + UNSPECIFIED, and TOOL_CALLS: the gateway's reading of a STOP, never recorded.
    assert len(sampling_pb2.FinishReason.keys()) == len(FinishReason) + 2


def test_token_packing_round_trips() -> None:
    ids = [0, 1, 128_000, 2**32 - 1]
    assert len(pack_token_ids(ids)) == 16
    assert unpack_token_ids(pack_token_ids(ids)) == ids
    assert unpack_token_ids(pack_token_ids([])) == []


@run_async
async def test_lifecycle(redis_url: str) -> None:
    async with RequestStore(redis_url) as store:
        assert await store.create(record("r1"), [1, 2, 3, 4, 5])
        got = await store.get("r1")
        assert got is not None
        assert (got.status, got.model, got.params) == (RequestStatus.QUEUED, "smollm2-135m", PARAMS)
        assert got.gateway_id == "gw-1"
        assert (got.priority, got.prompt_len, got.attempt, got.worker_id, got.dispatch_ts) == (2, 5, 0, None, None)
        assert await store.get_prompt("r1") == [1, 2, 3, 4, 5]

        assert await store.mark_dispatched("r1", "worker-a", attempt=1)
        await store.append_step({"r1": (0, [10])}, first_token_ts={"r1": 1234.5})
        await store.append_step({"r1": (1, [11, 12])})
        got = await store.get("r1")
        assert got is not None
        assert (got.status, got.worker_id, got.attempt) == (RequestStatus.RUNNING, "worker-a", 1)
        assert got.dispatch_ts is not None and got.first_token_ts == 1234.5
        assert got.num_output_tokens == 3
        first_dispatch = got.dispatch_ts

        # A worker failure: back to the queue, then a second attempt elsewhere.
        assert await store.set_status("r1", RequestStatus.QUEUED)
        assert await store.mark_dispatched("r1", "worker-b", attempt=2)
        # The first dispatch's time stays, as the first token's does: arrival <= dispatch <= first token.
        assert (await store.get("r1")).dispatch_ts == first_dispatch
        assert await store.finish("r1", RequestStatus.FINISHED, FinishReason.LENGTH)
        got = await store.get("r1")
        assert got is not None
        assert (got.status, got.finish_reason, got.worker_id, got.attempt) == (
            RequestStatus.FINISHED,
            FinishReason.LENGTH,
            "worker-b",
            2,
        )
        assert got.finish_ts is not None and got.finish_ts >= got.arrival_ts
        assert await store.get_tokens("r1") == [10, 11, 12]

        # Terminal is final: a racing cancel or status change is refused.
        assert not await store.finish("r1", RequestStatus.CANCELLED, FinishReason.ABORT)
        assert not await store.set_status("r1", RequestStatus.RUNNING)
        got = await store.get("r1")
        assert got is not None and got.status == RequestStatus.FINISHED


@run_async
async def test_failure_keeps_the_error(redis_url: str) -> None:
    async with RequestStore(redis_url) as store:
        await store.create(record("r1"), [1])
        assert await store.finish("r1", RequestStatus.FAILED, FinishReason.ERROR, error="CUDA out of memory")
        got = await store.get("r1")
        assert got is not None
        assert (got.status, got.finish_reason) == (RequestStatus.FAILED, FinishReason.ERROR)
        assert got.error == "CUDA out of memory"


@run_async
async def test_duplicates_unknown_ids_and_bad_statuses(redis_url: str) -> None:
    async with RequestStore(redis_url) as store:
        assert await store.create(record("r1"), [1, 2])
        clash = record("r1")
        clash.model = "other"
        assert not await store.create(clash, [9])
        got = await store.get("r1")
        assert got is not None and got.model == "smollm2-135m"
        assert await store.get_prompt("r1") == [1, 2]

        # Updates to an unknown request change nothing and create no stray keys.
        assert not await store.mark_dispatched("ghost", "worker-a", attempt=1)
        assert not await store.finish("ghost", RequestStatus.CANCELLED, FinishReason.ABORT)
        assert await store.get("ghost") is None
        assert await store.get_prompt("ghost") is None
        assert await store.get_tokens("ghost") == []
        raw = redis.Redis.from_url(redis_url)
        assert raw.keys("shardline:req:ghost*") == []
        raw.close()

        with pytest.raises(ValueError):
            await store.set_status("r1", RequestStatus.FINISHED)
        with pytest.raises(ValueError):
            await store.finish("r1", RequestStatus.RUNNING, FinishReason.STOP)


def _count_round_trips(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one for every command batch sent to Redis (until monkeypatch.undo())."""
    sends: list[int] = []
    original = AbstractConnection.send_packed_command

    async def counting_send(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
        sends.append(1)
        await original(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counting_send)
    return sends


@run_async
async def test_append_step_is_one_round_trip_per_step(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = [f"r{i}" for i in range(64)]
    async with RequestStore(redis_url) as store:
        for request_id in ids:
            await store.create(record(request_id), [1])
        sends = _count_round_trips(monkeypatch)
        for step in range(3):
            first = {rid: 100.0 + step for rid in ids} if step == 0 else None
            await store.append_step({rid: (2 * step, [step, i]) for i, rid in enumerate(ids)}, first_token_ts=first)
        assert len(sends) == 3
        monkeypatch.undo()

        for i, request_id in enumerate(ids[:5]):
            assert await store.get_tokens(request_id) == [0, i, 1, i, 2, i]
        got = await store.get("r7")
        assert got is not None and got.first_token_ts == 100.0 and got.num_output_tokens == 6


@run_async
async def test_a_steps_tokens_and_finishes_land_together(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A crash between a request's last tokens and its finish would leave a complete output RUNNING,
    # and recovery would run it past its end: one MULTI/EXEC writes both.
    async with RequestStore(redis_url) as store:
        for request_id in ("r1", "r2"):
            await store.create(record(request_id), [1])
        sends = _count_round_trips(monkeypatch)
        done = await store.append_step(
            {"r1": (0, [5]), "r2": (0, [6, 2])}, finishes=[("r2", RequestStatus.FINISHED, FinishReason.STOP, None)]
        )
        assert done == [True] and len(sends) == 1
        monkeypatch.undo()
        r1, r2 = await store.get("r1"), await store.get("r2")
        assert (r1.status, r2.status, r2.finish_reason) == (
            RequestStatus.QUEUED,
            RequestStatus.FINISHED,
            FinishReason.STOP,
        )
        assert await store.get_tokens("r2") == [6, 2]
        assert await store.list_active() == ["r1"]
        # A bad finish is refused before anything of the step is written.
        with pytest.raises(ValueError):
            await store.append_step({"r1": (1, [7])}, finishes=[("r1", RequestStatus.RUNNING, FinishReason.STOP, None)])
        assert await store.get_tokens("r1") == [5]


@run_async
async def test_a_steps_dispatches_and_finishes_are_one_round_trip_each(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = [f"f{i}" for i in range(16)]
    async with RequestStore(redis_url) as store:
        for request_id in ids:
            await store.create(record(request_id), [1])
        sends = _count_round_trips(monkeypatch)
        assert await store.mark_dispatched_many([(rid, "worker-a", 1) for rid in ids]) == [True] * 16
        done = await store.finish_many(
            [(rid, RequestStatus.FINISHED, FinishReason.LENGTH, None) for rid in ids[:15]]
            + [("ghost", RequestStatus.CANCELLED, FinishReason.ABORT, None)]
        )
        assert done == [True] * 15 + [False]
        assert len(sends) == 2
        monkeypatch.undo()
        got = await store.get("f3")
        assert got is not None and got.status == RequestStatus.FINISHED and got.finish_reason == FinishReason.LENGTH
        assert got.worker_id == "worker-a" and got.dispatch_ts is not None and got.finish_ts is not None
        assert await store.list_active() == ["f15"]
        with pytest.raises(ValueError):
            await store.finish_many([("f15", RequestStatus.RUNNING, FinishReason.STOP, None)])


@run_async
async def test_tokens_by_offset(redis_url: str) -> None:
    async with RequestStore(redis_url) as store:
        await store.create(record("r1"), [1])
        assert await store.get_tokens("r1") == []
        for token in range(10):
            await store.append_step({"r1": (token, [1000 + token])})
        assert await store.get_tokens("r1", 0) == [1000 + t for t in range(10)]
        assert await store.get_tokens("r1", 7) == [1007, 1008, 1009]
        assert await store.get_tokens("r1", 10) == []
        assert await store.get_tokens("r1", 50) == []
        with pytest.raises(ValueError):
            await store.get_tokens("r1", -1)


@run_async
async def test_logprobs_are_kept_token_for_token(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def lp(token_id: int) -> bytes:
        top = [sampling_pb2.TopLogprob(token_id=token_id + 1, logprob=-0.5)]
        return sampling_pb2.TokenLogprob(token_id=token_id, logprob=-0.25, top=top).SerializeToString()

    async with RequestStore(redis_url) as store:
        for request_id in ("with", "without"):
            await store.create(record(request_id), [1, 2, 3])
        sends = _count_round_trips(monkeypatch)
        await store.append_step(
            {"with": (0, [7]), "without": (0, [8])},
            logprobs={"with": [lp(7)]},
            prompt_logprobs={"with": [lp(2), lp(3)]},
        )
        await store.append_step({"with": (1, [9, 10]), "without": (1, [11])}, logprobs={"with": [lp(9), lp(10)]})
        assert len(sends) == 2  # still one round trip a step
        monkeypatch.undo()
        output, prompt = await store.get_logprobs("with")
        assert output == [lp(7), lp(9), lp(10)] and prompt == [lp(2), lp(3)]
        assert sampling_pb2.TokenLogprob.FromString(output[1]).top[0].token_id == 10
        assert await store.get_logprobs("with", offset=2) == ([lp(10)], [lp(2), lp(3)])
        assert await store.get_logprobs("without") == ([], [])
        # One script keeps a step's tokens and logprobs together: only a step that carries prompt
        # logprobs (or finishes a request) pays for MULTI/EXEC.
        pipeline = store._redis.pipeline
        transactions: list[bool] = []

        def spy(transaction: bool = True, **kwargs: Any):
            transactions.append(transaction)
            return pipeline(transaction=transaction, **kwargs)

        monkeypatch.setattr(store._redis, "pipeline", spy)
        await store.append_step({"without": (2, [12])}, logprobs={"without": []}, prompt_logprobs={})
        await store.append_step({"with": (3, [13])}, logprobs={"with": [lp(13)]})
        await store.append_step({"without": (3, [14])}, prompt_logprobs={"without": [lp(2), lp(3)]})
        assert transactions == [False, False, True]
        monkeypatch.undo()
        with pytest.raises(ValueError):
            await store.get_logprobs("with", -1)


@run_async
async def test_active_set_and_recent_listing(redis_url: str) -> None:
    now = time.time()
    async with RequestStore(redis_url) as store:
        for i, request_id in enumerate(["a", "b", "c"]):
            await store.create(record(request_id, arrival_ts=now + i), [i])
        assert await store.list_active() == ["a", "b", "c"]
        await store.finish("b", RequestStatus.CANCELLED, FinishReason.ABORT)
        assert await store.list_active() == ["a", "c"]
        assert [r.request_id for r in await store.list_recent(10)] == ["c", "b", "a"]
        assert [r.request_id for r in await store.list_recent(2)] == ["c", "b"]
        assert await store.list_recent(0) == []


@run_async
async def test_finish_sets_ttl_and_keys_expire(redis_url: str) -> None:
    raw = redis.Redis.from_url(redis_url)
    async with RequestStore(redis_url, retention_s=3600) as store:
        await store.create(record("r1"), [1, 2])
        await store.append_step({"r1": (0, [3])})
        await store.append_step({"r1": (1, [4])}, logprobs={"r1": [b"lp"]}, prompt_logprobs={"r1": [b"p"]})
        keys = [
            "shardline:req:r1",
            "shardline:req:r1:prompt",
            "shardline:req:r1:tokens",
            "shardline:req:r1:logprobs",
            "shardline:req:r1:prompt_logprobs",
        ]
        assert [raw.ttl(k) for k in keys] == [-1] * 5  # live requests never expire
        await store.finish("r1", RequestStatus.FINISHED, FinishReason.STOP)
        assert all(3590 <= raw.ttl(k) <= 3600 for k in keys)
    async with RequestStore(redis_url, retention_s=0.2) as store:
        await store.create(record("r2"), [1])
        await store.append_step({"r2": (0, [5])}, logprobs={"r2": [b"lp"]}, prompt_logprobs={"r2": [b"p"]})
        await store.finish("r2", RequestStatus.FINISHED, FinishReason.STOP)
        await asyncio.sleep(0.4)
        assert await store.get("r2") is None
        assert await store.get_prompt("r2") is None
        assert await store.get_tokens("r2") == []
        assert await store.get_logprobs("r2") == ([], [])
        assert [r.request_id for r in await store.list_recent(10)] == ["r1"]
    raw.close()


@run_async
async def test_a_step_written_twice_appends_once(redis_url: str) -> None:
    # A retry after a reply lost to a broken connection sends the same step again: appends go by
    # offset, so the tokens and logprobs already there are skipped, and only the rest lands.
    async with RequestStore(redis_url) as store:
        await store.create(record("r1"), [1, 2])
        step = {"r1": (0, [5, 6])}
        for _ in range(2):
            await store.append_step(step, logprobs={"r1": [b"lp5", b"lp6"]}, prompt_logprobs={"r1": [b"p"]})
        await store.append_step({"r1": (1, [6, 7])}, logprobs={"r1": [b"lp6", b"lp7"]})  # overlaps by one
        assert await store.get_tokens("r1") == [5, 6, 7]
        assert await store.get_logprobs("r1") == ([b"lp5", b"lp6", b"lp7"], [b"p"])


@run_async
async def test_a_step_that_would_leave_a_gap_writes_nothing(redis_url: str) -> None:
    async with RequestStore(redis_url) as store:
        for request_id in ("r1", "r2"):
            await store.create(record(request_id), [1])
        await store.append_step({"r1": (0, [5])})
        with pytest.raises(redis.exceptions.ResponseError, match="GAP"):
            await store.append_step({"r1": (1, [6]), "r2": (3, [9])})
        assert await store.get_tokens("r1") == [5] and await store.get_tokens("r2") == []


@run_async
async def test_a_redis_that_is_down_is_unavailable_not_internal() -> None:
    async with RequestStore(f"redis://127.0.0.1:{free_port()}/0") as store:
        for call in (store.ping(), store.get("r1"), store.append_step({"r1": (0, [1])})):
            with pytest.raises(StoreUnavailable, match="redis unavailable"):
                await call


@run_async
async def test_the_owner_is_kept_and_none_is_empty(redis_url: str) -> None:
    async with RequestStore(redis_url) as store:
        owned = record("owned")
        owned.owner = "key-digest"
        await store.create(owned, [1])
        await store.create(record("open"), [1])
        assert (await store.get("owned")).owner == "key-digest"
        assert (await store.get("open")).owner == ""


@run_async
async def test_the_tenant_and_its_weight_are_kept(redis_url: str) -> None:
    async with RequestStore(redis_url) as store:
        heavy = record("heavy")
        heavy.tenant, heavy.tenant_weight = "acme", 2.5
        await store.create(heavy, [1])
        await store.create(record("plain"), [1])
        stored = await store.get("heavy")
        assert (stored.tenant, stored.tenant_weight) == ("acme", 2.5)
        plain = await store.get("plain")
        assert (plain.tenant, plain.tenant_weight) == ("", 1.0)


@run_async
async def test_a_burst_past_the_pool_waits_for_connections_rather_than_failing(redis_url: str) -> None:
    # 500 creates at once, far past the pool's 64 connections (and redis-py's default pool's 100,
    # which failed the rest at once with "Too many connections": UNAVAILABLE from a Redis that was up).
    admin = redis.Redis.from_url(redis_url)
    before = len(admin.client_list())  # other tests' clients on the shared server, and this one
    async with RequestStore(redis_url) as store:
        created = await asyncio.gather(*(store.create(record(f"burst-{i}"), [1, 2, 3]) for i in range(500)))
        assert all(created)
        assert all(r is not None for r in await asyncio.gather(*(store.get(f"burst-{i}") for i in range(500))))
        assert len(admin.client_list()) <= before + 64  # bounded by the pool
    admin.close()
