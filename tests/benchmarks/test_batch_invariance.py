"""The batch-invariance cost benchmark runs both engines on the same prompts and reports their ratio."""

from __future__ import annotations

import json

import pytest

from benchmarks.batch_invariance import main

pytestmark = pytest.mark.slow


def test_both_engines_run_every_round(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "--model",
                "dummy:smollm2-135m",
                "--concurrency",
                "1",
                "3",
                "--input-len",
                "20",
                "--output-len",
                "3",
                "--rounds",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["concurrency"] for r in rows] == [1, 3]
    for row in rows:
        assert len(row["rounds"]) == 2 and all(r["fused"] > 0 and r["invariant"] > 0 for r in row["rounds"])
        assert row["ratio_range"][0] <= row["ratio"] <= row["ratio_range"][1]
    assert "medians of 2 alternating rounds" in capsys.readouterr().out
