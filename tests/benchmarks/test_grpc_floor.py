"""The gRPC floor benchmark runs end to end and accounts for every call and stream it makes."""

from __future__ import annotations

import json

from benchmarks.grpc_floor import main


def test_grpc_floor_measures_both_hops(tmp_path, capsys):
    out = tmp_path / "floor.json"
    assert main(["--bursts", "3", "--concurrency", "4", "--input-len", "8", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    unary, streams = result["unary"], result["streams"]
    # CPU is read at nanosecond resolution on both sides: even 12 calls cost some.
    assert unary["server_cpu_ms_per_call"] > 0 and unary["client_cpu_ms_per_call"] > 0
    assert unary["burst_wall_ms_median"] > 0
    # Every stream of every burst reached the server (its arrival was read back), after the send.
    assert 0 < streams["last_arrival_ms_min"] <= streams["last_arrival_ms_median"]
    assert "3 bursts of 4" in capsys.readouterr().out
