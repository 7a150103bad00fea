"""Typed results of the SDK's Batch API calls: files and batches, as OpenAI's objects show them."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardline.proto import batches_pb2

TERMINAL = ("completed", "failed", "expired", "cancelled")
_TIMESTAMPS = (
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


@dataclass(slots=True)
class FileInfo:
    """A stored file: a batch's input (purpose "batch") or its output or errors ("batch_output")."""

    id: str
    size_bytes: int
    created_at: int  # Unix seconds
    filename: str
    purpose: str

    @classmethod
    def from_proto(cls, f: batches_pb2.File) -> FileInfo:
        return cls(f.id, f.size_bytes, f.created_at, f.filename, f.purpose)


@dataclass(slots=True)
class BatchLineError:
    """A bad input line, why a batch failed: its 1-based line and the field at fault."""

    line: int
    param: str
    message: str
    code: str


@dataclass(slots=True)
class BatchInfo:
    """A batch: its status ("validating", "in_progress", "finalizing", "completed", "failed",
    "expired", "cancelling" or "cancelled"), progress, result files and timestamps."""

    id: str
    status: str
    endpoint: str
    input_file_id: str
    completion_window: str
    total: int  # lines in the input
    completed: int  # lines answered with status 200
    failed: int  # lines that ended in an error
    output_file_id: str | None = None  # once it has ended, with at least one answered line
    error_file_id: str | None = None  # once it has ended, with at least one failed line
    metadata: dict[str, str] = field(default_factory=dict)
    errors: list[BatchLineError] = field(default_factory=list)  # with "failed": the bad input lines
    timestamps: dict[str, int] = field(default_factory=dict)  # "created_at", "completed_at", ...: those reached

    @property
    def done(self) -> bool:
        """Whether it has ended (completed, failed, expired or cancelled): it changes no more."""
        return self.status in TERMINAL

    @classmethod
    def from_proto(cls, b: batches_pb2.Batch) -> BatchInfo:
        counts = b.request_counts
        return cls(
            b.id,
            batches_pb2.BatchStatus.Name(b.status).removeprefix("BATCH_STATUS_").lower(),
            b.endpoint,
            b.input_file_id,
            b.completion_window,
            counts.total,
            counts.completed,
            counts.failed,
            b.output_file_id or None,
            b.error_file_id or None,
            dict(b.metadata),
            [BatchLineError(e.line, e.param, e.message, e.code) for e in b.errors],
            {name: getattr(b, name) for name in _TIMESTAMPS if getattr(b, name)},
        )
