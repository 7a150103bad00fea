"""`shardline bench --backend openai` against a real stack's HTTP API, alone and side by side with itself."""

from __future__ import annotations

import json

import pytest

from shardline.cli.main import main

pytestmark = pytest.mark.slow

LOAD = ["--num-prompts", "4", "--input-len", "16", "--output-len", "8", "--max-concurrency", "4"]


def _bench(tmp_path, *flags: str) -> dict:
    out = tmp_path / "bench.json"
    assert main(["bench", "--backend", "openai", *LOAD, *flags, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def _check_round(summary: dict) -> None:
    assert (summary["completed"], summary["failed"]) == (4, 0), summary["errors"]
    for d in summary["detail"]:
        # ignore_eos: every request made its 8 tokens, as the usage chunk counts them; the chunks
        # with text are at most that many (a chunk holds several when drafts are kept).
        assert (d["input_len"], d["output_len"]) == (16, 8)
        assert 1 <= len(d["itl_ms"]) + 1 <= 8
        assert 0 < d["ttft_ms"] <= d["e2el_ms"] < 60_000
    assert summary["output_throughput"] == pytest.approx(32 / summary["wall_s"])
    ttft, tpot, e2el = summary["ttft_ms"], summary["tpot_ms"], summary["e2el_ms"]
    assert 0 < ttft["median"] < e2el["median"]
    # TPOT is the decode's pace: below the whole request's time and the same order as its gaps.
    assert 0 < tpot["median"] < e2el["median"]
    assert tpot["mean"] == pytest.approx((e2el["mean"] - ttft["mean"]) / 7, rel=1e-6)


def test_bench_streams_completions_from_a_stack_and_counts_its_tokens(tmp_path, http_url, capsys):
    report = _bench(tmp_path, "--base-url", http_url + "/v1")
    [summary] = report["rounds"]["base"]
    _check_round(summary)
    assert report["comparison"] is None
    assert report["targets"]["base"].startswith(f"{http_url}, model ")  # the first of GET /v1/models
    assert "output throughput (tok/s)" in capsys.readouterr().out


def test_side_by_side_alternates_two_targets_and_reports_each_rounds_ratio(tmp_path, http_url, capsys):
    report = _bench(tmp_path, "--base-url", http_url, "--compare-base-url", http_url, "--rounds", "2")
    for side in ("base", "compare"):
        assert len(report["rounds"][side]) == 2
        for summary in report["rounds"][side]:
            _check_round(summary)
        assert report["results"][side]["completed"] == 4
    assert report["targets"]["base"] == report["targets"]["compare"]
    comparison = report["comparison"]
    assert comparison["sides"] == ["base", "compare"]
    assert len(comparison["ratios"]) == len(comparison["tpot_p50_ratios"]) == 2
    # The same server on both sides: the ratios are near 1 (within a shared machine's drift).
    assert all(0.2 < r < 5 for r in comparison["ratios"])
    out = capsys.readouterr().out
    assert "round 2: base/compare output throughput" in out
    assert "base/compare TPOT p50" in out
