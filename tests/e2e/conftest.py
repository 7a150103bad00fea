"""One real stack for the e2e tests: embedded Redis, tokenizer, scheduler, a worker and the gateway,
all as processes, with the real default model."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardline.stack.local_stack import LocalStack, StackConfig


def log_dir(tmp_path_factory, name: str) -> Path:
    """Where a test stack's services log: SHARDLINE_TEST_LOG_DIR/<name> if set, else a temporary folder."""
    base = os.environ.get("SHARDLINE_TEST_LOG_DIR")
    return Path(base) / name if base else tmp_path_factory.mktemp(f"{name}-logs")


@contextlib.contextmanager
def running_stack(config: StackConfig) -> Iterator[LocalStack]:
    """A started stack, stopped afterwards; if it fails to start, its services' log tails are printed."""
    s = LocalStack(config)
    try:
        s.start(timeout_s=240)
    except Exception:  # start() has stopped what it started
        for log in sorted(config.log_dir.glob("*.log")) if config.log_dir else []:
            print(f"----- {log.name}\n{log.read_text()[-3000:]}")
        raise
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    # With n-gram speculation on, every e2e test also checks that deltas of several tokens a step
    # (drafts kept) go through the stack as one token a step would; its tokens are the same.
    config = StackConfig.on_free_ports(
        data_dir=tmp_path_factory.mktemp("stack-data"),
        log_dir=log_dir(tmp_path_factory, "stack"),
        env={"HEARTBEAT_INTERVAL_S": "0.5", "KV_CACHE_BYTES": str(64 << 20), "NUM_SPECULATIVE_TOKENS": "4"},
        batch_workers=1,  # the Batch API's tests (test_batch_api.py) run on it
    )
    with running_stack(config) as s:
        yield s


@pytest.fixture(scope="session")
def http_url(stack) -> str:
    return f"http://127.0.0.1:{stack.config.http_port}"


@pytest.fixture(scope="session")
def grpc_target(stack) -> str:
    return f"127.0.0.1:{stack.config.grpc_port}"
