"""The Batch API through the SDK's gRPC calls and the `shardline batch` commands, on a real stack with a
real Celery worker and the real model: a batch submitted, followed to completion with its progress,
its output downloaded (each body the online answer), listed, and a running one cancelled."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import openai
import pytest

from shardline.client import ShardlineClient
from tests.e2e.batch_worker import BatchWorker, chat_line, jsonl

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def batch_worker(stack, tmp_path_factory):
    worker = BatchWorker(stack, tmp_path_factory.mktemp("batch-cli") / "batch.log").start()
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def client(grpc_target, batch_worker):
    with ShardlineClient(grpc_target) as c:
        yield c


def _cli(grpc_target: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "shardline.cli.main", "batch", *args, "--url", grpc_target]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def _comparable(body: dict) -> dict:
    """A completion without what differs per call: its id, its creation time, its prefix-cache hits."""
    usage = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    return {**{k: v for k, v in body.items() if k not in ("id", "created")}, "usage": usage}


def test_the_sdk_follows_a_batch_to_completion_and_reads_its_output(client, http_url):
    lines = [chat_line(f"s-{i}", f"Count to {i}.", max_tokens=6) for i in range(3)]
    batch = client.batches.submit(jsonl(lines), metadata={"via": "sdk"})
    seen = []
    batch = client.batches.wait(batch.id, progress=seen.append, poll_s=0.2, timeout=120)
    assert batch.status == "completed" and (batch.completed, batch.failed, batch.total) == (3, 0, 3), batch
    assert seen[-1].status == "completed" and [b.completed for b in seen] == sorted(b.completed for b in seen)
    assert batch.metadata == {"via": "sdk"} and {"in_progress_at", "completed_at"} <= set(batch.timestamps)
    assert client.batches.get_file(batch.output_file_id).purpose == "batch_output"
    out = [json.loads(row) for row in client.batches.read_file(batch.output_file_id).splitlines()]
    assert sorted(o["custom_id"] for o in out) == [f"s-{i}" for i in range(3)]
    online = openai.OpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0)
    model = online.models.list().data[0].id
    for o in out:
        body = next(line["body"] for line in lines if line["custom_id"] == o["custom_id"])
        answer = online.chat.completions.create(model=model, **body).model_dump(exclude_unset=True)
        assert o["response"]["status_code"] == 200 and _comparable(o["response"]["body"]) == _comparable(answer)
    assert batch.id in [b.id for b in client.batches.list(limit=100)[0]]


def test_the_cli_submits_waits_lists_downloads_and_cancels(client, grpc_target, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl([chat_line(f"c-{i}", f"Say {i}.", max_tokens=4) for i in range(2)]))
    out = tmp_path / "out.jsonl"
    submitted = _cli(grpc_target, "submit", str(source), "--wait", "-o", str(out), "--metadata", "job=cli")
    assert submitted.returncode == 0, submitted.stderr
    batch_id, status = submitted.stdout.splitlines()[:2]
    assert status.startswith(f"{batch_id}  completed  2/2 completed, 0 failed")
    assert sorted(json.loads(row)["custom_id"] for row in out.read_text().splitlines()) == ["c-0", "c-1"]
    assert "line" in submitted.stderr  # the progress bar
    assert "completed" in _cli(grpc_target, "status", batch_id).stdout
    assert batch_id in _cli(grpc_target, "list", "--limit", "100").stdout
    copy = tmp_path / "copy.jsonl"
    assert _cli(grpc_target, "download", batch_id, "-o", str(copy)).returncode == 0
    assert copy.read_bytes() == out.read_bytes()
    done = _cli(grpc_target, "cancel", batch_id)
    assert done.returncode == 1 and "FAILED_PRECONDITION" in done.stderr
    missing = _cli(grpc_target, "status", "batch_nope")
    assert missing.returncode == 2 and "NOT_FOUND" in missing.stderr

    # A running batch cancelled from the command line keeps the results so far.
    long = [chat_line(f"l-{i}", f"Tell a long story about {i}.", max_tokens=48) for i in range(24)]
    source.write_bytes(jsonl(long))
    started = _cli(grpc_target, "submit", str(source))
    assert started.returncode == 0, started.stderr
    running = started.stdout.strip()
    _wait_until(client, running, lambda b: b.completed >= 1)
    assert _cli(grpc_target, "cancel", running).returncode == 0
    cancelled = client.batches.wait(running, poll_s=0.2, timeout=30)
    assert cancelled.status == "cancelled" and 1 <= cancelled.completed < len(long)
    partial = _cli(grpc_target, "download", running)
    assert len(partial.stdout.splitlines()) == cancelled.completed


def _wait_until(client, batch_id: str, until, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not until(batch := client.batches.get(batch_id)):
        assert time.monotonic() < deadline and not batch.done, batch
        time.sleep(0.2)
    return batch
