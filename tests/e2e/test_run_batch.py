"""`shardline run-batch`: a batch file run offline on a private stack of its own, a line out per
custom_id, each body what the online endpoint answers (the session stack's, same model, greedy)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.batch_worker import chat_line, jsonl
from tests.e2e.http_client import post

pytestmark = pytest.mark.slow


def _comparable(body: dict) -> dict:
    """A completion without what differs per call: its id, its creation time, its prefix-cache hits."""
    usage = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    return {**{k: v for k, v in body.items() if k not in ("id", "created")}, "usage": usage}


def test_run_batch_writes_the_online_answer_for_each_line(http_url, tmp_path):
    completion = {"prompt": "The sky is", "max_tokens": 6, "temperature": 0}
    lines = [
        chat_line("chat-0", "Name a colour.", max_tokens=6),
        chat_line("chat-stop", "Say hello.", max_tokens=8, stop=["l"]),
        {"custom_id": "text-0", "method": "POST", "url": "/v1/completions", "body": completion},
    ]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(jsonl(lines))
    command = [sys.executable, "-m", "shardline.cli.main", "run-batch", "-i", str(source), "-o", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    results = [json.loads(row) for row in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [line["custom_id"] for line in lines]  # each once, in order
    for line, result in zip(lines, results, strict=True):
        assert result["error"] is None and result["response"]["status_code"] == 200
        status, online = post(f"{http_url}{line['url']}", line["body"])
        assert status == 200 and _comparable(result["response"]["body"]) == _comparable(online)


def test_run_batch_refuses_a_bad_file_naming_line_and_field(tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_bytes(jsonl([chat_line("a", "hi"), chat_line("a", "again"), chat_line("b", "hi", temperature="hot")]))
    command = [sys.executable, "-m", "shardline.cli.main", "run-batch", "-i", str(source), "-o", str(tmp_path / "o")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and not (tmp_path / "o").exists()
    assert f"{source}:2: custom_id:" in done.stderr and f"{source}:3: body.temperature:" in done.stderr
