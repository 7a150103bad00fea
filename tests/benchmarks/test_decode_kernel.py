"""benchmarks.decode_kernel: the CPU decode kernel and the torch path, on the same prompts in one engine."""

from __future__ import annotations

import json

import pytest

from benchmarks.decode_kernel import main
from gpu_worker_svc.model.layers import attention
from gpu_worker_svc.model.layers.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(
    cpu_kernels.paged_decode_attention() is None, reason="the CPU kernels cannot be built on this machine"
)


def test_both_sides_run_every_round_and_the_kernel_is_restored(tmp_path, capsys, monkeypatch):
    calls = {"kernel": 0}
    kernel = cpu_kernels.paged_decode_attention

    def counted():
        calls["kernel"] += 1
        return kernel()

    monkeypatch.setattr(cpu_kernels, "paged_decode_attention", counted)
    out = tmp_path / "ab.json"
    assert (
        main(["--concurrency", "3", "--input-len", "16", "--output-len", "6", "--rounds", "2", "--out", str(out)]) == 0
    )
    result = json.loads(out.read_text())
    for side in ("kernel", "torch"):
        assert len(result["runs"][side]) == 2
        assert all(run["tokens"] == 3 * 6 and run["tok_s"] > 0 for run in result["runs"][side])
    assert result["ratio"]["min"] <= result["ratio"]["median"] <= result["ratio"]["max"]
    assert calls["kernel"] > 0  # the kernel side did take it, step after step
    assert attention.cpu_kernels.paged_decode_attention is counted  # restored after the run
    assert "kernel / torch:" in capsys.readouterr().out
