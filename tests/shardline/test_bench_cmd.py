"""`shardline bench`: rounds alternate the backends, and the figures are the rounds' medians."""

from __future__ import annotations

import json

import pytest

from shardline.bench.metrics import RequestTiming, median_of_rounds, summarize
from shardline.cli.main import main


def _round(ttfts: list[float], wall_s: float, errors: int = 0) -> dict:
    timings = [RequestTiming(input_len=8, output_len=2, chunk_times=[t, t + 0.1]) for t in ttfts]
    timings += [RequestTiming(input_len=8, ok=False, error="boom") for _ in range(errors)]
    return summarize(timings, wall_s)


def test_median_of_rounds_takes_each_figures_median_and_totals_the_counts():
    rounds = [_round([0.1, 0.2], 1.0), _round([0.3, 0.4], 4.0, errors=1), _round([0.5, 0.6], 2.0)]
    out = median_of_rounds(rounds)
    assert out["output_throughput"] == pytest.approx(2.0)  # 4 tokens over 1, 4 and 2 s: median 2 tok/s
    assert out["ttft_ms"]["median"] == pytest.approx(350.0)  # round medians 150, 350, 550
    assert out["wall_s"] == 2.0
    assert (out["completed"], out["failed"], out["errors"]) == (6, 1, {"boom": 1})
    assert "detail" not in out


@pytest.mark.slow
def test_bench_runs_rounds_on_the_engine_and_writes_them(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--engine", "--model", "dummy:smollm2-135m", "--num-prompts", "2", "--input-len", "8",
                 "--output-len", "3", "--rounds", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["completed"] for r in report["rounds"]["engine"]] == [2, 2]
    assert report["results"]["engine"]["completed"] == 4
    assert report["comparison"] is None  # no stack to compare with
    assert "medians of 2 alternating rounds" in capsys.readouterr().out
