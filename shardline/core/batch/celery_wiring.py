"""The Celery wiring both sides share: the gateway enqueues a batch's chunks by task name, the batch
workers (batch_svc) define the task and consume them.

Settings follow Celery's advice for long tasks that must not be lost: a chunk is acknowledged only
once it is done (`task_acks_late`), a worker killed mid-chunk has it redelivered
(`task_reject_on_worker_lost`, and Redis' `visibility_timeout`, which must exceed a chunk's run),
and a worker holds one chunk at a time (`worker_prefetch_multiplier=1`), so chunks spread over the
workers instead of queueing behind one.
"""

from __future__ import annotations

from celery import Celery

QUEUE = "shardline-batch"
RUN_CHUNK_TASK = "shardline.core.batch.run_chunk"
# An hour, as Celery's docs suggest for Redis: far above a chunk's run (256 lines take about a minute
# on the CPU default model), so a chunk is redelivered only when its worker died.
DEFAULT_VISIBILITY_TIMEOUT_S = 3600.0


def celery_app(redis_url: str, visibility_timeout_s: float = DEFAULT_VISIBILITY_TIMEOUT_S) -> Celery:
    """A Celery app with Redis as broker and result backend, configured for batch chunks."""
    app = Celery("shardline-batch", broker=redis_url, backend=redis_url)
    app.conf.update(
        task_default_queue=QUEUE,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options={
            "visibility_timeout": visibility_timeout_s,
            # kombu looks for chunks past their visibility timeout on every tenth sweep of ten
            # seconds by default: a dead worker's chunk then waited up to 100 s more. A sweep is one
            # small Redis query; run every one, a tenth of the timeout apart (1 to 10 s).
            "unacked_restore_interval": max(1, min(10, round(visibility_timeout_s / 10))),
            "unacked_restore_throttle": 1,
        },
        result_backend_transport_options={"visibility_timeout": visibility_timeout_s},
        result_expires=24 * 3600,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        # A chunk's progress is in Redis; Celery's own states only tell a chunk taken from one queued.
        task_track_started=True,
    )
    return app


def enqueue_chunks(app: Celery, batch_id: str, chunks: int) -> None:
    """Queues every chunk of a batch (a blocking call: run it off the event loop)."""
    for chunk in range(chunks):
        app.send_task(RUN_CHUNK_TASK, args=[batch_id, chunk], queue=QUEUE)
