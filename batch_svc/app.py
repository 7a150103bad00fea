"""The Celery app of the batch workers and its one task, a batch chunk.

`shardline serve batch` runs a worker of it; `celery -A batch_svc.app worker` does too, with the
settings from the environment.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from celery import Celery, Task
from opentelemetry import trace
from redis.exceptions import RedisError

from batch_svc.chunk_runner import ChunkRunner
from batch_svc.settings import BatchSettings
from shardline.core.batch.batch_store import BatchStore
from shardline.core.batch.celery_wiring import RUN_CHUNK_TASK, celery_app
from shardline.core.batch.file_store import LocalFileStore
from shardline.core.errors import Unavailable

logger = logging.getLogger(__name__)

# A chunk that fails with an error other than Redis or the file store away fails its batch at the last try.
MAX_FAILURES = 5
# A chunk that failed for want of Redis or the file store is queued again, after up to this long.
RETRY_BACKOFF_MAX_S = 30


def build_app(settings: BatchSettings) -> Celery:
    app = celery_app(settings.redis_url, settings.batch_visibility_timeout_s)
    files = LocalFileStore(Path(settings.files_dir))

    @app.task(
        name=RUN_CHUNK_TASK,
        bind=True,
        autoretry_for=(Exception,),
        retry_backoff=True,
        retry_backoff_max=RETRY_BACKOFF_MAX_S,
        max_retries=None,
    )
    def run_chunk(task: Task, batch_id: str, chunk: int) -> int:
        """Runs one chunk of a batch; returns the lines it kept a result for. Redis or the file store
        away is waited out; any other failure is retried MAX_FAILURES times, then fails the batch."""
        try:
            return asyncio.run(_run(batch_id, chunk))
        except (Unavailable, RedisError, OSError):
            raise
        except Exception as exc:
            logger.exception("%s: chunk %d failed (try %d)", batch_id, chunk, task.request.retries + 1)
            if task.request.retries + 1 >= MAX_FAILURES:
                asyncio.run(_fail(batch_id, f"chunk {chunk} failed {MAX_FAILURES} times: {exc!r}"))
                return 0
            raise

    async def _fail(batch_id: str, message: str) -> None:
        store = BatchStore(settings.redis_url)
        try:
            await store.set_fields(batch_id, errors=json.dumps([{"code": "internal_error", "message": message}]))
            await store.transition(batch_id, "failed", ("validating", "in_progress", "finalizing", "cancelling"))
        finally:
            await store.close()

    async def _run(batch_id: str, chunk: int) -> int:
        # A store per run: its connections belong to this run's event loop.
        store = BatchStore(settings.redis_url)
        try:
            runner = ChunkRunner(settings, store, files, trace.get_tracer("shardline.core.batch"))
            return await runner.run(batch_id, chunk)
        finally:
            await store.close()

    return app


app = build_app(BatchSettings())
