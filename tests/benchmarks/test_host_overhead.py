"""The host-overhead benchmark times every phase of real decode steps, both ways of scheduling."""

from __future__ import annotations

import json

import pytest

from benchmarks import host_overhead
from gpu_worker_svc.engine import model_runner

pytestmark = pytest.mark.slow


def test_phases_add_up_to_the_step_for_sync_and_async(tmp_path, monkeypatch):
    monkeypatch.setattr(model_runner, "build_step", model_runner.build_step)  # the benchmark wraps it
    out = tmp_path / "h.json"
    argv = ["--batch", "1", "4", "--steps", "8", "--rounds", "1", "--scheduling", "sync", "async"]
    assert host_overhead.main([*argv, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["scheduling"], r["batch"]) for r in rows) == [("async", 1), ("async", 4), ("sync", 1), ("sync", 4)]
    for row in rows:
        phases = sum(row[p] for p in host_overhead.PHASES) + row["other"]
        assert row["step"] > 0 and row["forward"] > 0 and row["metadata"] > 0
        # Medians of each phase need not add up to the median step, but the phases never overlap.
        assert phases == pytest.approx(row["step"], rel=0.25) and row["other"] > -0.05 * row["step"]
        assert 0 < row["host"] < row["step"]
