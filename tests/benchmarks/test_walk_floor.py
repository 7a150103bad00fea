"""benchmarks.walk_floor: the request's walk through bare services, on real processes, gRPC and Redis."""

from __future__ import annotations

import json

from benchmarks.walk_floor import main


def test_walk_floor_times_both_hops_of_every_burst(tmp_path, capsys):
    out = tmp_path / "walk.json"
    assert main(["--bursts", "3", "--concurrency", "4", "--input-len", "8", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["bursts"]) == 3
    for burst in result["bursts"]:
        # Each burst's step left the worker after its first send, and reached the client after that;
        # a request's timer starts at its own send, no sooner than the burst's first.
        assert burst["last_dispatch_ms"] > 0 and burst["relay_ms"] > 0
        assert 0 < burst["ttft_p50_ms"] <= burst["last_dispatch_ms"] + burst["relay_ms"] + 1e-6
    # Every request went through the scheduler's Redis write: the warm-up burst's and the timed ones.
    assert result["requests_persisted"] == 4 * 4
    summary = result["summary"]["ttft_p50_ms"]
    assert summary["min"] <= summary["median"] <= summary["max"]
    assert "3 bursts of 4 streams" in capsys.readouterr().out


def test_walk_floor_streamed_submit_without_redis(tmp_path):
    """The variant that bounds any design: one submit stream from the gateway, and no Redis write."""
    out = tmp_path / "walk.json"
    assert (
        main(
            [
                "--bursts",
                "2",
                "--concurrency",
                "3",
                "--input-len",
                "8",
                "--streamed-submit",
                "--no-redis",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["requests_persisted"] == 0
    assert [b["relay_ms"] > 0 and b["last_dispatch_ms"] > 0 for b in result["bursts"]] == [True, True]
