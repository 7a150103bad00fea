"""The real tokenizer service (one process for the session) and the known text the scripts play."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardline.core.model_path import default_model_path
from shardline.core.ports import free_port
from shardline.core.text.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[2]
# Prose, then characters the default model splits over several tokens, so the gateway must hold
# partial characters back between steps.
TEXT = " The quick brown fox jumps over the lazy dog. Zürich 😀 中文!"


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    """The tokenizer core, for expected ids and texts."""
    return Tokenizer.from_model_path(default_model_path())


@pytest.fixture(scope="session")
def text_ids(tokenizer: Tokenizer) -> list[int]:
    ids = tokenizer.encode_batch([TEXT], add_special_tokens=False)[0]
    assert tokenizer.decode(ids) == TEXT
    return ids


@pytest.fixture(scope="session")
def tokenizer_address() -> Iterator[str]:
    """host:port of a real `python -m tokenizer_svc.main` serving the default model."""
    port = free_port()
    process = start_tokenizer(port)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=30)


def start_tokenizer(port: int) -> subprocess.Popen:
    """A real tokenizer service on `port`, returned once it serves."""
    env = {**os.environ, "SHARDLINE_TRACING": "0"}
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenizer_svc.main", "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        _wait_serving(f"127.0.0.1:{port}", process)
    except BaseException:
        process.kill()
        raise
    return process


def _wait_serving(address: str, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"tokenizer service exited: {process.stderr.read().decode()}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.1)
    raise TimeoutError(f"tokenizer service at {address} did not start")
