"""A batch as OpenAI's Batch API shows it, and the states it walks through.

validating -> in_progress -> finalizing -> completed; or failed (its input was refused), expired (its
window passed), cancelling -> cancelled. In Shardline "validating" means checked and waiting for a
batch worker: the gateway checks the input while it creates the batch, and a batch that fails the
checks is created `failed`.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

TERMINAL = ("completed", "failed", "expired", "cancelled")
STATUSES = ("validating", "in_progress", "finalizing", "cancelling", *TERMINAL)
# Timestamps kept, each set when the batch enters the state it is named for.
TIMESTAMPS = (
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)
COMPLETION_WINDOWS = {"24h": 24 * 3600}


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


@dataclass(slots=True)
class BatchRecord:
    """A batch's state, as kept in Redis (one hash) and shown by the API."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    owner: str = ""
    metadata: dict[str, str] | None = None
    errors: list[dict] = field(default_factory=list)  # the input's bad lines, when it failed
    total: int = 0
    completed: int = 0
    failed: int = 0
    chunks: list[dict] = field(default_factory=list)  # LineChunk fields: the work split for the batch workers
    output_file_id: str | None = None
    error_file_id: str | None = None
    timestamps: dict[str, int] = field(default_factory=dict)
    expired: bool = False  # a worker found it past its window: it ends expired, not completed

    def to_hash(self) -> dict[str, str]:
        fields = {
            "id": self.id,
            "endpoint": self.endpoint,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "owner": self.owner,
            "metadata": json.dumps(self.metadata),
            "errors": json.dumps(self.errors),
            "total": str(self.total),
            "completed": str(self.completed),
            "failed": str(self.failed),
            "chunks": json.dumps(self.chunks),
            "output_file_id": self.output_file_id or "",
            "error_file_id": self.error_file_id or "",
            "expired": "1" if self.expired else "",
        }
        fields.update({name: str(value) for name, value in self.timestamps.items()})
        return fields

    @classmethod
    def from_hash(cls, fields: dict[str, str]) -> BatchRecord:
        return cls(
            id=fields["id"],
            endpoint=fields["endpoint"],
            input_file_id=fields["input_file_id"],
            completion_window=fields["completion_window"],
            status=fields["status"],
            owner=fields.get("owner", ""),
            metadata=json.loads(fields.get("metadata", "null")),
            errors=json.loads(fields.get("errors", "[]")),
            total=int(fields.get("total", 0)),
            completed=int(fields.get("completed", 0)),
            failed=int(fields.get("failed", 0)),
            chunks=json.loads(fields.get("chunks", "[]")),
            output_file_id=fields.get("output_file_id") or None,
            error_file_id=fields.get("error_file_id") or None,
            timestamps={name: int(fields[name]) for name in TIMESTAMPS if fields.get(name)},
            expired=bool(fields.get("expired")),
        )

    def to_openai(self) -> dict:
        body: dict[str, object] = {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "metadata": self.metadata,
        }
        body.update({name: self.timestamps.get(name) for name in TIMESTAMPS})
        return body
