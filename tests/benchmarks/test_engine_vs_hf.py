"""The engine-vs-HF benchmark script runs end to end, and its engine side never hits the prefix cache."""

from __future__ import annotations

import json

import pytest

from benchmarks.engine_vs_hf import main

pytestmark = pytest.mark.slow


def test_engine_vs_hf_alternates_rounds_and_reports_medians(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "--model",
                "dummy:smollm2-135m",
                "--concurrency",
                "1",
                "2",
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
    assert [r["concurrency"] for r in rows] == [1, 2]
    for row in rows:
        assert len(row["rounds"]) == 2
        for r in row["rounds"]:
            # Every round prefilled all its prompts: nothing came from the prefix cache.
            assert r["shardline"]["prefix_cache_hit_tokens"] == 0
            assert r["shardline"]["tokens"] == 3 * row["concurrency"] == r["hf"]["tokens"]
        low, high = row["ratio_range"]
        assert low <= row["ratio"] <= high
    assert "medians of 2 alternating rounds" in capsys.readouterr().out


def test_speculation_settings_each_get_a_row_on_the_same_prompts(tmp_path):
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "--model",
                "dummy:smollm2-135m",
                "--concurrency",
                "2",
                "--input-len",
                "24",
                "--output-len",
                "6",
                "--rounds",
                "2",
                "--num-speculative-tokens",
                "0",
                "3",
                "--no-hf",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["concurrency"], r["num_speculative_tokens"]) for r in rows] == [(2, 0), (2, 3)]
    assert rows[0]["acceptance"] is None
    for off, on in zip(rows[0]["rounds"], rows[1]["rounds"]):  # the same prompts, run twice: no cache hits
        assert off["shardline"]["prefix_cache_hit_tokens"] == on["shardline"]["prefix_cache_hit_tokens"] == 0
        assert off["shardline"]["tokens"] == on["shardline"]["tokens"] == 12
        assert off["shardline"]["draft_tokens"] == 0
