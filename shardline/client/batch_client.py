"""The SDK's Batch API calls (the gateway's gRPC Batches service): `ShardlineClient.batches`.

Reads, lists, cancels and downloads are retried on UNAVAILABLE as every other call of the client
(a download until its first piece). An upload and a create are not: neither is idempotent, and a
retry after an answer lost on the way back would store the file, or start the batch, twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc

from shardline.client.batch_types import BatchInfo, FileInfo
from shardline.client.call_policy import RETRYABLE, CallPolicy
from shardline.proto import batches_pb2, batches_pb2_grpc

# Bytes sent per message of an upload.
UPLOAD_PIECE_BYTES = 1 << 20


class BatchClient:
    """Files and batches through a ShardlineClient's channel, its API key and its retries.

    >>> with ShardlineClient("localhost:50051") as client:
    ...     batch = client.batches.submit("requests.jsonl", endpoint="/v1/chat/completions")
    ...     batch = client.batches.wait(batch.id, progress=lambda b: print(b.completed, "/", b.total))
    ...     client.batches.download(batch.output_file_id, "results.jsonl")
    """

    def __init__(self, policy: CallPolicy, channel: grpc.Channel) -> None:
        self._policy = policy  # the client's: its API key, its timeout, its retries
        self._stub = batches_pb2_grpc.BatchesStub(channel)

    # -- files ----------------------------------------------------------------
    def upload_file(
        self, source: str | Path | bytes, *, purpose: str = "batch", filename: str | None = None
    ) -> FileInfo:
        """Upload a file (a path, or the bytes themselves) and return it; a batch's input has purpose
        "batch", one JSON request line per line. Not retried: see the module's docstring."""
        if isinstance(source, bytes):
            name = filename or "upload.jsonl"
        else:
            name = filename or Path(source).name
        header = batches_pb2.FileHeader(filename=name, purpose=purpose)
        return FileInfo.from_proto(self._policy.once(self._stub.UploadFile, _upload_parts(header, source), None))

    def get_file(self, file_id: str) -> FileInfo:
        """A file's metadata; NOT_FOUND for an unknown id or another API key's file."""
        return FileInfo.from_proto(
            self._policy.call(self._stub.GetFile, batches_pb2.GetFileRequest(file_id=file_id), None)
        )

    def list_files(self, purpose: str | None = None) -> list[FileInfo]:
        """Your files, newest first; only those of `purpose` when given."""
        resp = self._policy.call(self._stub.ListFiles, batches_pb2.ListFilesRequest(purpose=purpose or ""), None)
        return [FileInfo.from_proto(f) for f in resp.files]

    def delete_file(self, file_id: str) -> None:
        """Delete a file."""
        self._policy.call(self._stub.DeleteFile, batches_pb2.DeleteFileRequest(file_id=file_id), None)

    def read_file(self, file_id: str) -> bytes:
        """A file's bytes, whole (a batch's output: one JSON result line per input line)."""
        return b"".join(piece for _, piece in self._download(file_id))

    def download(self, file_id: str, path: str | Path) -> FileInfo:
        """Write a file's bytes to `path` (replaced when there), in pieces; returns its metadata."""
        meta: FileInfo | None = None
        with open(path, "wb") as out:
            for info, piece in self._download(file_id):
                meta = meta or info
                out.write(piece)
        assert meta is not None  # the first message carries it
        return meta

    def _download(self, file_id: str) -> Iterator[tuple[FileInfo | None, bytes]]:
        request = batches_pb2.DownloadFileRequest(file_id=file_id)
        retries = self._policy.retries
        for attempt in range(retries + 1):
            started = False
            try:
                for msg in self._policy.once(self._stub.DownloadFile, request, None):
                    info = FileInfo.from_proto(msg.file) if msg.HasField("file") else None
                    started = True
                    yield info, msg.data
                return
            except grpc.RpcError as exc:
                if started or exc.code() not in RETRYABLE or attempt == retries:
                    raise
                self._policy.back_off(attempt)

    # -- batches --------------------------------------------------------------
    def create(
        self,
        input_file_id: str,
        *,
        endpoint: str = "/v1/chat/completions",
        metadata: dict[str, str] | None = None,
        completion_window: str = "24h",
    ) -> BatchInfo:
        """Start a batch over an uploaded file. Its every line is checked first: a bad one makes the
        batch "failed" at once, with `errors` naming the line and the field, and nothing runs. A bad
        argument is INVALID_ARGUMENT naming it. Not retried: see the module's docstring."""
        request = batches_pb2.CreateBatchRequest(
            input_file_id=input_file_id, endpoint=endpoint, completion_window=completion_window, metadata=metadata
        )
        return BatchInfo.from_proto(self._policy.once(self._stub.CreateBatch, request, None))

    def submit(
        self,
        source: str | Path | bytes,
        *,
        endpoint: str = "/v1/chat/completions",
        metadata: dict[str, str] | None = None,
    ) -> BatchInfo:
        """Upload a JSONL file of request lines and start a batch over it (upload_file, then create)."""
        upload = self.upload_file(source, purpose="batch")
        return self.create(upload.id, endpoint=endpoint, metadata=metadata)

    def get(self, batch_id: str) -> BatchInfo:
        """A batch's status and progress; NOT_FOUND for an unknown id or another API key's batch."""
        return BatchInfo.from_proto(
            self._policy.call(self._stub.GetBatch, batches_pb2.GetBatchRequest(batch_id=batch_id), None)
        )

    def list(self, *, limit: int = 20, after: str | None = None) -> tuple[list[BatchInfo], bool]:
        """A page of your batches, newest first, and whether older ones follow (pass the page's last
        id as `after` for them); `limit` is 1 to 100."""
        request = batches_pb2.ListBatchesRequest(limit=limit, after=after or "")
        resp = self._policy.call(self._stub.ListBatches, request, None)
        return [BatchInfo.from_proto(b) for b in resp.batches], resp.has_more

    def cancel(self, batch_id: str) -> BatchInfo:
        """Ask a running batch to stop: "cancelling", then "cancelled" within seconds, with the
        results so far in its output. FAILED_PRECONDITION once it has ended otherwise."""
        return BatchInfo.from_proto(
            self._policy.call(self._stub.CancelBatch, batches_pb2.CancelBatchRequest(batch_id=batch_id), None)
        )

    def wait(
        self,
        batch_id: str,
        *,
        progress: Callable[[BatchInfo], None] | None = None,
        poll_s: float = 1.0,
        timeout: float | None = None,
    ) -> BatchInfo:
        """Poll a batch every `poll_s` until it ends, and return it; `progress` is called with the
        batch on each poll whose status or counts changed (the first included). TimeoutError past
        `timeout` seconds, the batch running on."""
        deadline = None if timeout is None else time.monotonic() + timeout
        seen: tuple | None = None
        while True:
            batch = self.get(batch_id)
            state = (batch.status, batch.completed, batch.failed)
            if progress is not None and state != seen:
                progress(batch)
            seen = state
            if batch.done:
                return batch
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"batch {batch_id} still {batch.status} after {timeout} s")
            time.sleep(poll_s)


def _upload_parts(
    header: batches_pb2.FileHeader, source: str | Path | bytes
) -> Iterator[batches_pb2.UploadFileRequest]:
    yield batches_pb2.UploadFileRequest(header=header)
    if isinstance(source, bytes):
        for start in range(0, len(source), UPLOAD_PIECE_BYTES):
            yield batches_pb2.UploadFileRequest(data=source[start : start + UPLOAD_PIECE_BYTES])
        return
    with open(source, "rb") as f:
        while piece := f.read(UPLOAD_PIECE_BYTES):
            yield batches_pb2.UploadFileRequest(data=piece)
