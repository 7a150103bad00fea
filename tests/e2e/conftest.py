"""One real stack for the e2e tests: embedded Redis, tokenizer, scheduler, a worker and the gateway,
all as processes, with the real default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardline.stack import LocalStack, StackConfig


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    logs = Path(os.environ.get("SHARDLINE_TEST_LOG_DIR", tmp_path_factory.mktemp("stack-logs")))
    config = StackConfig.on_free_ports(data_dir=tmp_path_factory.mktemp("stack-data"), log_dir=logs,
                                       env={"HEARTBEAT_INTERVAL_S": "0.5", "KV_CACHE_BYTES": str(64 << 20)})
    s = LocalStack(config)
    try:
        s.start(timeout_s=240)
    except Exception:
        for log in sorted(logs.glob("*.log")):
            print(f"----- {log.name}\n{log.read_text()[-3000:]}")
        s.stop()
        raise
    yield s
    s.stop()


@pytest.fixture(scope="session")
def http_url(stack) -> str:
    return f"http://127.0.0.1:{stack.config.http_port}"


@pytest.fixture(scope="session")
def grpc_target(stack) -> str:
    return f"127.0.0.1:{stack.config.grpc_port}"
