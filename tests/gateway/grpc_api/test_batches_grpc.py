"""The gRPC Batches service on a real gateway, with a real Redis and file store (no batch worker: a
batch stays validating): files up and down, batches created, listed and cancelled, each bad request
INVALID_ARGUMENT naming its field, another key's ids NOT_FOUND, and UNAVAILABLE without Redis."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from shardline.client import ShardlineClient
from shardline.proto import batches_pb2, batches_pb2_grpc
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.scripted_scheduler import Script

OWNER = [("authorization", "Bearer k1")]
OTHER = [("authorization", "Bearer k2")]


def _line(custom_id: str, **body: object) -> bytes:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}).encode()


GOOD = b"\n".join([_line("a"), _line("b")]) + b"\n"


def _stub(stack: Stack) -> batches_pb2_grpc.BatchesStub:
    return batches_pb2_grpc.BatchesStub(stack.channel)


async def _upload(stub, data: bytes, purpose: str = "batch", metadata=None, pieces: int = 3) -> batches_pb2.File:
    size = max(1, len(data) // pieces)
    parts = [batches_pb2.UploadFileRequest(header=batches_pb2.FileHeader(filename="in.jsonl", purpose=purpose))]
    parts += [batches_pb2.UploadFileRequest(data=data[i : i + size]) for i in range(0, len(data), size)]
    return await stub.UploadFile(iter(parts), metadata=metadata)


async def _refused(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code, caught.value.details()
    return caught.value.details()


def _run(tokenizer_address, text_ids, body, **settings) -> None:
    run_on_stack(tokenizer_address, Script(text_ids), body, **settings)


def test_files_go_up_and_down_and_batches_are_created_listed_and_cancelled(
    tokenizer_address, text_ids, redis_url, tmp_path
) -> None:
    async def body(stack: Stack) -> None:
        stub = _stub(stack)
        upload = await _upload(stub, GOOD)
        assert upload.id.startswith("file-") and upload.size_bytes == len(GOOD) and upload.purpose == "batch"
        assert (await stub.GetFile(batches_pb2.GetFileRequest(file_id=upload.id))).filename == "in.jsonl"
        pieces = [p async for p in stub.DownloadFile(batches_pb2.DownloadFileRequest(file_id=upload.id))]
        assert pieces[0].file.id == upload.id and b"".join(p.data for p in pieces) == GOOD
        listed = await stub.ListFiles(batches_pb2.ListFilesRequest(purpose="batch"))
        assert [f.id for f in listed.files] == [upload.id]

        create = batches_pb2.CreateBatchRequest(
            input_file_id=upload.id, endpoint="/v1/chat/completions", metadata={"job": "t"}
        )
        batch = await stub.CreateBatch(create)
        assert batch.status == batches_pb2.BATCH_STATUS_VALIDATING and batch.completion_window == "24h"
        assert batch.request_counts.total == 2 and dict(batch.metadata) == {"job": "t"}
        assert batch.created_at and batch.expires_at - batch.created_at == 24 * 3600 and not batch.completed_at
        again = await stub.GetBatch(batches_pb2.GetBatchRequest(batch_id=batch.id))
        assert again.id == batch.id and again.input_file_id == upload.id
        second = await stub.CreateBatch(create)
        page = await stub.ListBatches(batches_pb2.ListBatchesRequest(limit=1))
        assert len(page.batches) == 1 and page.has_more
        rest = await stub.ListBatches(batches_pb2.ListBatchesRequest(after=page.batches[0].id))
        assert {page.batches[0].id, *(b.id for b in rest.batches)} == {batch.id, second.id} and not rest.has_more

        cancelled = await stub.CancelBatch(batches_pb2.CancelBatchRequest(batch_id=batch.id))
        assert cancelled.status == batches_pb2.BATCH_STATUS_CANCELLING and cancelled.cancelling_at
        await stub.DeleteFile(batches_pb2.DeleteFileRequest(file_id=upload.id))
        await _refused(stub.GetFile(batches_pb2.GetFileRequest(file_id=upload.id)), grpc.StatusCode.NOT_FOUND)

    _run(tokenizer_address, text_ids, body, redis_url=redis_url, files_dir=str(tmp_path))


def test_bad_requests_are_invalid_argument_naming_the_field(tokenizer_address, text_ids, redis_url, tmp_path) -> None:
    async def body(stack: Stack) -> None:
        stub = _stub(stack)
        bad = grpc.StatusCode.INVALID_ARGUMENT
        assert (await _refused(_upload(stub, GOOD, purpose="nonsense"), bad)).startswith("purpose:")
        headless = iter([batches_pb2.UploadFileRequest(data=GOOD)])
        assert (await _refused(stub.UploadFile(headless), bad)).startswith("header:")
        upload = await _upload(stub, GOOD)
        ask = {"input_file_id": upload.id, "endpoint": "/v1/chat/completions"}
        for field, change in [
            ("endpoint", {"endpoint": "/v1/embeddings"}),
            ("endpoint", {"endpoint": ""}),
            ("completion_window", {"completion_window": "1h"}),
            ("input_file_id", {"input_file_id": ""}),
            ("input_file_id", {"input_file_id": "file-0000"}),
            ("metadata", {"metadata": {f"k{i}": "v" for i in range(17)}}),
        ]:
            details = await _refused(stub.CreateBatch(batches_pb2.CreateBatchRequest(**{**ask, **change})), bad)
            assert details.startswith(f"{field}:"), details
        limit = await _refused(stub.ListBatches(batches_pb2.ListBatchesRequest(limit=101)), bad)
        assert limit.startswith("limit:")

        # A bad line fails the batch at once, naming the line and the field; a failed batch cannot be cancelled.
        lines = await _upload(stub, b"\n".join([_line("a"), _line("b", temperature="hot"), _line("a")]))
        failed = await stub.CreateBatch(batches_pb2.CreateBatchRequest(**{**ask, "input_file_id": lines.id}))
        assert failed.status == batches_pb2.BATCH_STATUS_FAILED and failed.failed_at
        assert [(e.line, e.param) for e in failed.errors] == [(2, "body.temperature"), (3, "custom_id")]
        cancel = stub.CancelBatch(batches_pb2.CancelBatchRequest(batch_id=failed.id))
        assert "failed" in await _refused(cancel, grpc.StatusCode.FAILED_PRECONDITION)

    _run(tokenizer_address, text_ids, body, redis_url=redis_url, files_dir=str(tmp_path))


def test_another_keys_files_and_batches_are_not_found(tokenizer_address, text_ids, redis_url, tmp_path) -> None:
    async def body(stack: Stack) -> None:
        stub = _stub(stack)
        upload = await _upload(stub, GOOD, metadata=OWNER)
        create = batches_pb2.CreateBatchRequest(input_file_id=upload.id, endpoint="/v1/chat/completions")
        batch = await stub.CreateBatch(create, metadata=OWNER)
        missing = grpc.StatusCode.NOT_FOUND
        for call in [
            stub.GetFile(batches_pb2.GetFileRequest(file_id=upload.id), metadata=OTHER),
            stub.DeleteFile(batches_pb2.DeleteFileRequest(file_id=upload.id), metadata=OTHER),
            _drain(stub.DownloadFile(batches_pb2.DownloadFileRequest(file_id=upload.id), metadata=OTHER)),
            stub.GetBatch(batches_pb2.GetBatchRequest(batch_id=batch.id), metadata=OTHER),
            stub.CancelBatch(batches_pb2.CancelBatchRequest(batch_id=batch.id), metadata=OTHER),
            stub.GetBatch(batches_pb2.GetBatchRequest(batch_id="batch_0000"), metadata=OWNER),
        ]:
            await _refused(call, missing)
        # The other key uses it as an input: to it, no such file.
        stolen = stub.CreateBatch(create, metadata=OTHER)
        assert (await _refused(stolen, grpc.StatusCode.INVALID_ARGUMENT)).startswith("input_file_id:")
        assert not (await stub.ListBatches(batches_pb2.ListBatchesRequest(), metadata=OTHER)).batches
        assert not (await stub.ListFiles(batches_pb2.ListFilesRequest(), metadata=OTHER)).files
        await _refused(_upload(stub, GOOD), grpc.StatusCode.UNAUTHENTICATED)
        await _refused(stub.GetBatch(batches_pb2.GetBatchRequest(batch_id=batch.id)), grpc.StatusCode.UNAUTHENTICATED)

    _run(tokenizer_address, text_ids, body, redis_url=redis_url, files_dir=str(tmp_path), api_keys="k1, k2")


def test_without_redis_every_rpc_is_unavailable_naming_the_setting(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        stub = _stub(stack)
        for call in [_upload(stub, GOOD), stub.GetBatch(batches_pb2.GetBatchRequest(batch_id="batch_1"))]:
            assert "SHARDLINE_REDIS_URL" in await _refused(call, grpc.StatusCode.UNAVAILABLE)

    _run(tokenizer_address, text_ids, body)


def test_the_sdk_uploads_creates_lists_cancels_and_reads(tokenizer_address, text_ids, redis_url, tmp_path) -> None:
    async def body(stack: Stack) -> None:
        def calls() -> None:
            with ShardlineClient(f"127.0.0.1:{stack.gateway.grpc.port}", api_key="k1", retries=0) as client:
                batches = client.batches
                source = tmp_path / "requests.jsonl"
                source.write_bytes(GOOD)
                batch = batches.submit(source, metadata={"job": "sdk"})
                assert batch.status == "validating" and batch.total == 2 and not batch.done
                assert batch.metadata == {"job": "sdk"} and "created_at" in batch.timestamps
                [upload] = batches.list_files(purpose="batch")
                assert upload.filename == "requests.jsonl" and batches.read_file(upload.id) == GOOD
                out = tmp_path / "copy.jsonl"
                assert batches.download(upload.id, out).size_bytes == len(GOOD) and out.read_bytes() == GOOD
                assert batches.get(batch.id).input_file_id == upload.id
                page, more = batches.list(limit=5)
                assert [b.id for b in page] == [batch.id] and not more
                assert batches.cancel(batch.id).status == "cancelling"
                with pytest.raises(grpc.RpcError) as caught:
                    batches.create(upload.id, endpoint="/v1/embeddings")
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert caught.value.details().startswith("endpoint:")
                failed = batches.submit(b"not json\n", metadata=None)
                assert failed.status == "failed" and failed.done
                assert [(e.line, e.param) for e in failed.errors] == [(1, "line")]
                with pytest.raises(TimeoutError):
                    batches.wait(batch.id, poll_s=0.05, timeout=0.2)

        await asyncio.to_thread(calls)

    _run(tokenizer_address, text_ids, body, redis_url=redis_url, files_dir=str(tmp_path), api_keys="k1")


async def _drain(stream) -> None:
    async for _ in stream:
        pass
