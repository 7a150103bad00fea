"""The gRPC Batches service (protos/shardline/v1/batches.proto): the Batch API's files and batches, on the
gateway's public gRPC port next to Generation.

Its rules are the BatchService's, the same as the HTTP routes'; this module only turns messages into
calls and records into messages. Without Redis every rpc is UNAVAILABLE, naming the setting.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from gateway.batches.batch_front import OFF_MESSAGE
from gateway.batches.batch_service import LIST_LIMIT, BatchService, UploadSpool, parse_batch_create
from gateway.batches.files_http import READ_BYTES
from gateway.tenancy.auth import ApiKeys
from shardline.core.batch.batch_record import STATUSES, TIMESTAMPS, BatchRecord
from shardline.core.batch.file_store import FileObject
from shardline.core.errors import InvalidArgument, Unavailable
from shardline.proto import batches_pb2, batches_pb2_grpc

SERVICE_NAME = batches_pb2.DESCRIPTOR.services_by_name["Batches"].full_name
_STATUS = {name: batches_pb2.BatchStatus.Value(f"BATCH_STATUS_{name.upper()}") for name in STATUSES}


class BatchesServicer(batches_pb2_grpc.BatchesServicer):
    """Batches rpcs over a BatchService; `service` None: the Batch API is off."""

    def __init__(self, service: BatchService | None, keys: ApiKeys) -> None:
        self._service = service
        self._keys = keys

    def _on(self) -> BatchService:
        if self._service is None:
            raise Unavailable(OFF_MESSAGE)
        return self._service

    async def UploadFile(self, requests: AsyncIterator[batches_pb2.UploadFileRequest], context) -> batches_pb2.File:
        service = self._on()
        header: batches_pb2.FileHeader | None = None
        with UploadSpool() as spool:
            async for part in requests:
                kind = part.WhichOneof("part")
                if kind == "header":
                    if header is not None:
                        raise InvalidArgument("header", "comes once, in the first message")
                    header = part.header
                elif kind == "data":
                    if header is None:
                        raise InvalidArgument("header", "is required: the first message names the file and purpose")
                    spool.write(part.data)
            if header is None:
                raise InvalidArgument("header", "is required: the first message names the file and purpose")
            meta = await service.save_file(self._keys.grpc_owner(context), header.filename, header.purpose, spool)
        return file_message(meta)

    async def GetFile(self, request: batches_pb2.GetFileRequest, context) -> batches_pb2.File:
        return file_message(await self._on().owned_file(request.file_id, self._keys.grpc_owner(context)))

    async def ListFiles(self, request: batches_pb2.ListFilesRequest, context) -> batches_pb2.ListFilesResponse:
        files = await self._on().list_files(self._keys.grpc_owner(context), request.purpose or None)
        return batches_pb2.ListFilesResponse(files=[file_message(f) for f in files])

    async def DeleteFile(self, request: batches_pb2.DeleteFileRequest, context) -> batches_pb2.DeleteFileResponse:
        meta = await self._on().delete_file(request.file_id, self._keys.grpc_owner(context))
        return batches_pb2.DeleteFileResponse(file_id=meta.id)

    async def DownloadFile(
        self, request: batches_pb2.DownloadFileRequest, context
    ) -> AsyncIterator[batches_pb2.DownloadFileResponse]:
        meta, source = await self._on().open_file(request.file_id, self._keys.grpc_owner(context))
        try:
            chunk = await asyncio.to_thread(source.read, READ_BYTES)
            yield batches_pb2.DownloadFileResponse(file=file_message(meta), data=chunk)
            while chunk := await asyncio.to_thread(source.read, READ_BYTES):
                yield batches_pb2.DownloadFileResponse(data=chunk)
        finally:
            source.close()

    async def CreateBatch(self, request: batches_pb2.CreateBatchRequest, context) -> batches_pb2.Batch:
        # Unset fields are left out, so the checks name them as the HTTP API's do; the window defaults.
        body: dict = {"completion_window": request.completion_window or "24h"}
        if request.input_file_id:
            body["input_file_id"] = request.input_file_id
        if request.endpoint:
            body["endpoint"] = request.endpoint
        if request.metadata:
            body["metadata"] = dict(request.metadata)
        service = self._on()
        return batch_message(await service.create_batch(self._keys.grpc_owner(context), parse_batch_create(body)))

    async def GetBatch(self, request: batches_pb2.GetBatchRequest, context) -> batches_pb2.Batch:
        return batch_message(await self._on().owned_batch(request.batch_id, self._keys.grpc_owner(context)))

    async def ListBatches(self, request: batches_pb2.ListBatchesRequest, context) -> batches_pb2.ListBatchesResponse:
        limit = request.limit or LIST_LIMIT[2]
        records, more = await self._on().list_batches(self._keys.grpc_owner(context), request.after or None, limit)
        return batches_pb2.ListBatchesResponse(batches=[batch_message(r) for r in records], has_more=more)

    async def CancelBatch(self, request: batches_pb2.CancelBatchRequest, context) -> batches_pb2.Batch:
        return batch_message(await self._on().cancel_batch(request.batch_id, self._keys.grpc_owner(context)))


def file_message(meta: FileObject) -> batches_pb2.File:
    return batches_pb2.File(
        id=meta.id, size_bytes=meta.bytes, created_at=meta.created_at, filename=meta.filename, purpose=meta.purpose
    )


def batch_message(record: BatchRecord) -> batches_pb2.Batch:
    return batches_pb2.Batch(
        id=record.id,
        endpoint=record.endpoint,
        input_file_id=record.input_file_id,
        completion_window=record.completion_window,
        status=_STATUS[record.status],
        output_file_id=record.output_file_id or "",
        error_file_id=record.error_file_id or "",
        request_counts=batches_pb2.RequestCounts(total=record.total, completed=record.completed, failed=record.failed),
        metadata=record.metadata or {},
        errors=[
            batches_pb2.BatchError(code=e["code"], message=e["message"], param=e["param"], line=e["line"])
            for e in record.errors
        ],
        **{name: record.timestamps.get(name, 0) for name in TIMESTAMPS},
    )
