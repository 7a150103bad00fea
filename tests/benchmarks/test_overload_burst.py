"""The overload benchmark's raw-socket burst and its summary, against its own bare refuser."""

from __future__ import annotations

import multiprocessing
import socket
import time

from benchmarks.overload_burst import _bare_refuser, http_burst, summarise
from shardline.core.ports import free_port


def test_a_burst_reads_every_answer_and_splits_refusals_from_the_rest():
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(target=_bare_refuser, args=(port,), daemon=True)
    server.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port)).close()
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "the bare refuser never listened"
                time.sleep(0.1)
        results = http_burst(f"127.0.0.1:{port}", "", 200, timeout_s=60)
    finally:
        server.kill()
    assert [status for status, _ in results] == [429] * 200
    assert all(0 < seconds < 60 for _, seconds in results)
    summary = summarise(results, 429)
    assert summary["counts"] == {"429": 200} and "admitted" not in summary
    assert summary["refused"]["p50_ms"] <= summary["refused"]["p99_ms"] <= summary["refused"]["max_ms"]
