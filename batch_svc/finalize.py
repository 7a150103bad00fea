"""The end of a batch: its output and error files written from the kept results, then its last status.

Run by whichever chunk finished last, and again by any chunk that runs after (a redelivered one), as
long as the batch is not terminal: writing the files again gives the same files, so a worker killed
while finalizing leaves nothing half done.
"""

from __future__ import annotations

import asyncio
import logging

from batch_svc.metrics import BATCHES
from shardline.core.batch.batch_record import TERMINAL, BatchRecord
from shardline.core.batch.batch_store import BatchStore
from shardline.core.batch.file_store import FileObject, FileStore, now_s

logger = logging.getLogger(__name__)


async def finalize(store: BatchStore, files: FileStore, record: BatchRecord) -> None:
    if record.status in TERMINAL:
        return
    if record.status == "cancelling":
        final = "cancelled"
    elif record.expired:
        final = "expired"
    else:
        final = "completed"
        await store.transition(record.id, "finalizing", ("validating", "in_progress"))
    fields = {}
    for ok, kind in ((True, "output"), (False, "error")):
        lines = await store.results(record.id, ok)
        if not lines:
            continue
        meta = FileObject(
            f"file-{record.id.removeprefix('batch_')}-{kind}",
            0,
            now_s(),
            f"{record.id}_{kind}.jsonl",
            "batch_output",
            record.owner,
        )
        await asyncio.to_thread(files.write, meta, [("\n".join(lines) + "\n").encode()])
        fields[f"{kind}_file_id"] = meta.id
    if fields:
        await store.set_fields(record.id, **fields)
    status = await store.transition(record.id, final, ("validating", "in_progress", "finalizing", "cancelling"))
    if status == final:
        BATCHES.labels(status=final).inc()
        logger.info("%s %s: %d completed, %d failed", record.id, final, record.completed, record.failed)
