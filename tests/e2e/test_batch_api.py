"""The Batch API through the official `openai` client, with a real Celery worker and the real model:
each line's body is the online endpoint's answer; bad input fails the batch before anything runs;
cancel and expiry end it with the results so far."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import openai
import pytest

from shardline.core.ports import free_port
from tests.e2e.batch_worker import chat_line, jsonl, output_lines, wait_batch
from tests.e2e.http_client import get

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(http_url) -> openai.OpenAI:
    """The session stack runs a batch worker (`batch_workers=1`), as `shardline up` does."""
    return openai.OpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0)


def _comparable(body: dict) -> dict:
    """A chat completion without what differs per call: its id, its creation time, and how much of
    its prompt the prefix cache served (the batch ran the same prompt first)."""
    usage = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    return {**{k: v for k, v in body.items() if k not in ("id", "created")}, "usage": usage}


def test_batch_bodies_equal_the_online_answers(client, http_url):
    lines = [chat_line(f"q-{i}", f"Name a colour, then the number {i}.", max_tokens=12) for i in range(6)]
    lines.append(chat_line("q-stop", "Say hello.", max_tokens=16, stop=["l"]))
    upload = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    assert upload.purpose == "batch" and upload.bytes == len(jsonl(lines))
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"job": "colours"}
    )
    assert batch.status == "validating" and batch.request_counts.total == len(lines)
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.completed == len(lines) and batch.request_counts.failed == 0
    assert batch.metadata == {"job": "colours"}
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    assert batch.error_file_id is None
    out = output_lines(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(line["custom_id"] for line in lines)  # each once
    by_id = {o["custom_id"]: o for o in out}
    for line in lines:
        result = by_id[line["custom_id"]]
        assert result["error"] is None and result["response"]["status_code"] == 200
        model = client.models.list().data[0].id
        online = client.chat.completions.create(model=model, **line["body"]).model_dump(exclude_unset=True)
        assert _comparable(result["response"]["body"]) == _comparable(online)
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    status, page = get(f"{http_url}/metrics")
    completed = re.search(r'^shardline_batches\{status="completed"\} (\S+)$', page.decode(), re.MULTILINE)
    assert status == 200 and completed and float(completed[1]) >= 1
    assert batch.id in [b.id for b in client.batches.list(limit=100).data]


def test_bad_lines_fail_the_batch_naming_line_and_field(client):
    good = chat_line("a", "hi")
    raw = b"\n".join(
        [
            json.dumps(good).encode(),
            b"{not json",
            json.dumps({**chat_line("c", "hi"), "url": "/v1/embeddings"}).encode(),
            json.dumps(chat_line("d", "hi", temperature="hot")).encode(),
            json.dumps(chat_line("a", "again")).encode(),
        ]
    )
    upload = client.files.create(file=("bad.jsonl", raw), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed" and batch.failed_at
    errors = [(e.line, e.param) for e in batch.errors.data]
    assert errors == [(2, "line"), (3, "url"), (4, "body.temperature"), (5, "custom_id")]
    assert "earlier line" in batch.errors.data[3].message
    assert batch.request_counts.total == 0 and batch.output_file_id is None


def test_create_refuses_bad_fields(client):
    upload = client.files.create(file=("in.jsonl", jsonl([chat_line("a", "hi")])), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="1h")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="input_file_id"):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("in.jsonl", b"{}"), purpose="nonsense")


def test_unknown_ids_are_404(client):
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_0000")
    with pytest.raises(openai.NotFoundError):
        client.batches.cancel("batch_0000")
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve("file-0000")
    with pytest.raises(openai.NotFoundError):
        client.files.content("file-0000")


def test_files_list_and_delete(client):
    upload = client.files.create(file=("del.jsonl", jsonl([chat_line("a", "hi")])), purpose="batch")
    assert upload.id in [f.id for f in client.files.list(purpose="batch").data]
    assert client.files.content(upload.id).content == jsonl([chat_line("a", "hi")])
    assert client.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(upload.id)


def test_cancel_mid_run_keeps_the_results_so_far(client):
    lines = [chat_line(f"c-{i}", f"Write a long story about the number {i}.", max_tokens=48) for i in range(48)]
    upload = client.files.create(file=("cancel.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_batch(client, batch.id, until=lambda b: b.request_counts.completed >= 2)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = wait_batch(client, batch.id, timeout_s=20)
    assert batch.status == "cancelled" and batch.cancelled_at
    done = batch.request_counts.completed
    assert 2 <= done < len(lines)
    out = output_lines(client, batch.output_file_id)
    assert len(out) == done == len({o["custom_id"] for o in out})
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(wait_batch(client, _tiny_batch(client)).id)


def _tiny_batch(client) -> str:
    upload = client.files.create(file=("tiny.jsonl", jsonl([chat_line("t", "hi", max_tokens=2)])), purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h").id


def test_a_batch_past_its_window_expires_with_its_partial_results(stack, client, tmp_path):
    """A second gateway whose batches have a 4 s window, on the same stack."""
    http_port, grpc_port = free_port(), free_port()
    env = {
        **os.environ,
        "SHARDLINE_HTTP_PORT": str(http_port),
        "SHARDLINE_GRPC_PORT": str(grpc_port),
        "SHARDLINE_TOKENIZER_ADDRESS": f"127.0.0.1:{stack.config.tokenizer_port}",
        "SHARDLINE_SCHEDULER_ADDRESS": f"127.0.0.1:{stack.config.scheduler_port}",
        "SHARDLINE_REDIS_URL": stack.redis_url,
        "SHARDLINE_FILES_DIR": stack.files_dir,
        "SHARDLINE_BATCH_WINDOW_S": "4",
        "SHARDLINE_TRACING": "0",
    }
    gateway = subprocess.Popen(
        [sys.executable, "-m", "shardline.cli.main", "serve", "gateway"],
        env=env,
        stdout=open(tmp_path / "gateway.log", "w"),
        stderr=subprocess.STDOUT,
    )
    try:
        short = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=5)
        lines = [chat_line(f"e-{i}", f"Tell a long tale about {i}.", max_tokens=64) for i in range(40)]
        upload = short.files.create(file=("expire.jsonl", jsonl(lines)), purpose="batch")
        batch = short.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert batch.expires_at - batch.created_at == 4
        batch = wait_batch(short, batch.id, timeout_s=30)
        assert batch.status == "expired" and batch.expired_at, batch
        assert batch.request_counts.completed < len(lines)
        out = output_lines(short, batch.output_file_id)
        assert len(out) == batch.request_counts.completed
    finally:
        gateway.terminate()
        gateway.wait(15)
