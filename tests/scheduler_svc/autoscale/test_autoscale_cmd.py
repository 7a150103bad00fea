"""`shardline autoscale trace` and `simulate` end to end on a small trace, and their one-line errors."""

import json
from pathlib import Path

from shardline.cli.main import main


def test_a_generated_trace_simulates_to_json_figures(tmp_path: Path, capsys):
    trace = tmp_path / "burst.jsonl"
    assert main(["autoscale", "trace", "--shape", "burst", "--hours", "1", "--rps", "1", "--out", str(trace)]) == 0
    assert "requests over 1.00 h" in capsys.readouterr().out
    argv = ["autoscale", "simulate", "--trace", str(trace), "--policy", "lt-ua", "--max-workers", "8"]
    assert main([*argv, "--cold-start-s", "30", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["policy"] == "lt-ua" and result["requests"] == sum(1 for _ in trace.open())
    assert 0.0 < result["slo_attainment"] <= 1.0 and result["worker_hours"] > 0
    assert main(argv) == 0
    assert "SLO attainment" in capsys.readouterr().out


def test_a_missing_trace_or_bad_bounds_is_one_line_on_stderr(tmp_path: Path, capsys):
    assert main(["autoscale", "simulate", "--trace", str(tmp_path / "none.csv"), "--policy", "naive"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardline autoscale simulate: ") and err.count("\n") == 1
    trace = tmp_path / "t.csv"
    trace.write_text("timestamp,input_tokens,output_tokens\n0,10,10\n")
    assert (
        main(
            [
                "autoscale",
                "simulate",
                "--trace",
                str(trace),
                "--policy",
                "naive",
                "--min-workers",
                "3",
                "--max-workers",
                "2",
            ]
        )
        == 2
    )
    assert "min (3)" in capsys.readouterr().err
