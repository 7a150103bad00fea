"""The KV transfer benchmark runs end to end between two real workers and moves every block."""

from __future__ import annotations

import json

import pytest

from benchmarks.kv_transfer import main

pytestmark = pytest.mark.slow


def test_kv_transfer_moves_each_rounds_blocks_and_times_both_sides(tmp_path, capsys):
    out = tmp_path / "kv.json"
    assert main(["--prompt-len", "64", "--rounds", "2", "--out", str(out)]) == 0
    rounds = json.loads(out.read_text())["rounds"]
    # 64 tokens are four full blocks; each round's prompt is new to B, so all four are imported.
    assert [r["blocks"] for r in rounds] == [4, 4]
    assert all(r["rpc_mb_s"] > 0 and r["bare_copy_mb_s"] > 0 and r["prefill_s"] > 0 for r in rounds)
    assert "64-token prompt" in capsys.readouterr().out
