"""model/weight_format.py: which weights "auto", the default, loads."""

from __future__ import annotations

import pytest
import torch

from gpu_worker_svc.model import weight_format
from gpu_worker_svc.model.layers.kernels import cpu_kernels
from gpu_worker_svc.model.weight_format import resolve_weight_format


@pytest.mark.skipif(cpu_kernels.gguf_linear() is None, reason="the CPU kernels cannot be built here")
def test_a_gguf_model_on_cpu_keeps_its_blocks_by_default():
    assert resolve_weight_format("auto", None, "cpu", torch.float32) == "gguf"  # the default model's .gguf


def test_auto_keeps_the_dtype_where_the_blocks_cannot_run(tmp_path, monkeypatch):
    folder = tmp_path / "hf"
    folder.mkdir()
    assert resolve_weight_format("auto", str(folder), "cpu", torch.float32) is None  # not a .gguf
    assert resolve_weight_format("auto", None, "cuda", torch.bfloat16) is None  # CPU kernels
    assert resolve_weight_format("auto", None, "cpu", torch.bfloat16) is None
    assert resolve_weight_format("auto", "dummy:llama-3.2-1b", "cpu", torch.float32) is None
    monkeypatch.setattr(weight_format.cpu_kernels, "gguf_linear", lambda: None)
    assert resolve_weight_format("auto", None, "cpu", torch.float32) is None


def test_an_explicit_format_is_taken_as_given():
    assert resolve_weight_format("none", None, "cpu", torch.float32) is None
    assert resolve_weight_format(None, None, "cpu", torch.float32) is None
    assert resolve_weight_format("int8", None, "cpu", torch.float32) == "int8"
