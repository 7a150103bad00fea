"""Batches in a real Redis: a line's result is kept once, state changes check the state they leave."""

from __future__ import annotations

import asyncio

from shardline.core.batch.batch_record import BatchRecord
from shardline.core.batch.batch_store import BatchStore


def _record(batch_id: str, owner: str = "", created: int = 100) -> BatchRecord:
    return BatchRecord(
        batch_id, "/v1/completions", "file-x", "24h", "validating", owner, total=4, timestamps={"created_at": created}
    )


def test_a_line_result_is_kept_once_and_counted_once(redis_url):
    async def run() -> None:
        store = BatchStore(redis_url)
        try:
            await store.create(_record("batch_a"))
            assert await store.record_line("batch_a", 0, True, '{"n": 0}')
            assert not await store.record_line("batch_a", 0, True, '{"n": "again"}')
            assert not await store.record_line("batch_a", 0, False, '{"n": "as an error"}')
            assert await store.record_line("batch_a", 2, False, '{"n": 2}')
            assert await store.done_lines("batch_a", 0, 4) == {0, 2}
            record = await store.get("batch_a")
            assert (record.completed, record.failed) == (1, 1)
            assert await store.results("batch_a", True) == ['{"n": 0}']
            assert await store.chunk_done("batch_a", 0) == 1
            assert await store.chunk_done("batch_a", 0) == 1  # a redelivered chunk counts once
            assert await store.chunk_done("batch_a", 1) == 2
        finally:
            await store.close()

    asyncio.run(run())


def test_transitions_only_leave_the_states_named(redis_url):
    async def run() -> None:
        store = BatchStore(redis_url)
        try:
            await store.create(_record("batch_b"))
            assert await store.transition("batch_b", "in_progress", ("validating",)) == "in_progress"
            assert await store.transition("batch_b", "cancelling", ("validating", "in_progress")) == "cancelling"
            # A worker that would finalize a batch being cancelled finds it elsewhere: nothing changes.
            assert await store.transition("batch_b", "finalizing", ("in_progress",)) == "cancelling"
            record = await store.get("batch_b")
            assert record.status == "cancelling" and "cancelling_at" in record.timestamps
            await store.create(_record("batch_c"))
            counts = await store.status_counts()
            assert counts == {"validating": 1, "in_progress": 0, "cancelling": 1}
            assert await store.transition("batch_missing", "cancelling", ("validating",)) is None
        finally:
            await store.close()

    asyncio.run(run())


def test_listing_is_per_owner_newest_first_with_pages(redis_url):
    async def run() -> None:
        store = BatchStore(redis_url)
        try:
            for i in range(5):
                await store.create(_record(f"batch_{i}", owner="k1", created=100 + i))
            await store.create(_record("batch_other", owner="k2"))
            page, more = await store.page("k1", None, 2)
            assert [r.id for r in page] == ["batch_4", "batch_3"] and more
            page, more = await store.page("k1", "batch_3", 10)
            assert [r.id for r in page] == ["batch_2", "batch_1", "batch_0"] and not more
            assert [r.id for r in (await store.page("k2", None, 10))[0]] == ["batch_other"]
        finally:
            await store.close()

    asyncio.run(run())
