import importlib.machinery
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from gpu_worker_svc.server import settings
from gpu_worker_svc.server.main import parse_args
from gpu_worker_svc.server.serving import engine_config


def test_flags_override_the_environment_and_unset_flags_leave_it(monkeypatch):
    monkeypatch.setenv("SHARDLINE_PORT", "50070")
    monkeypatch.setenv("SHARDLINE_TP_SIZE", "2")
    s = parse_args(
        [
            "--tp",
            "3",
            "--scheduler",
            "sched:1",
            "--no-tracing",
            "--no-prefix-caching",
            "--device",
            "cpu",
            "--max-num-seqs",
            "4",
        ]
    )
    assert (s.port, s.tp_size, s.scheduler_address, s.max_num_seqs) == (50070, 3, "sched:1", 4)
    assert not s.tracing and not s.enable_prefix_caching
    assert s.onednn_weights and not parse_args(["--no-onednn-weights"]).onednn_weights
    assert not s.batch_invariant and parse_args(["--batch-invariant"]).batch_invariant
    monkeypatch.setenv("SHARDLINE_BATCH_INVARIANT", "1")
    assert engine_config(parse_args([])).runner.batch_invariant
    assert not engine_config(s).speculative.enabled
    assert engine_config(parse_args(["--num-speculative-tokens", "4"])).speculative.num_speculative_tokens == 4
    monkeypatch.setenv("SHARDLINE_NUM_SPECULATIVE_TOKENS", "3")
    assert engine_config(parse_args([])).speculative.num_speculative_tokens == 3


def test_defaults_resolve_from_the_port_and_device(monkeypatch):
    monkeypatch.delenv("SHARDLINE_WORKER_ID", raising=False)
    s = parse_args(["--port", "50061", "--device", "cpu"])
    assert s.resolved_worker_id.startswith("worker-") and s.resolved_worker_id.endswith("-50061")
    assert (s.resolved_device, s.resolved_dtype, s.resolved_admission_gap_s) == ("cpu", "float32", 0.020)
    assert s.address(50061) == "127.0.0.1:50061"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = parse_args(["--device", "cuda"])
    assert (cuda.resolved_dtype, cuda.resolved_admission_gap_s) == ("bfloat16", 0.0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValidationError, match="torch sees no CUDA device"):
        parse_args(["--device", "cuda"])
    monkeypatch.setenv("SHARDLINE_DEVICE", "gpu")  # the flag's choices refuse it before the settings see it
    with pytest.raises(ValidationError, match='must be "auto", "cpu" or "cuda"'):
        parse_args([])
    monkeypatch.delenv("SHARDLINE_DEVICE")
    assert parse_args(["--advertise-address", "w0:1"]).address(50061) == "w0:1"
    assert s.quantization == "auto"
    monkeypatch.setenv("SHARDLINE_QUANTIZATION", "q4")
    with pytest.raises(ValidationError, match="must be one of auto, none, fp16, gguf, int4, int8"):
        parse_args([])


def test_out_of_range_settings_are_refused():
    with pytest.raises(ValidationError, match="tp_size"):
        parse_args(["--tp", "0"])


def test_the_worker_restarts_for_its_malloc_settings_before_importing_torch():
    """main.py parses the settings and may restart the process (same pid) before torch and the engine
    load: importing it, and deciding, costs no torch import, so the restart does not pay for one twice."""
    script = (
        "import sys; from gpu_worker_svc.server import main, settings; "
        "s = main.parse_args(['--device', 'auto']); "
        "print(settings.cuda_installed(), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == [str(torch.cuda.is_available()), "False"], out.stderr


def test_cuda_installed_reads_torchs_build_and_the_driver(monkeypatch, tmp_path):
    torch_dir = tmp_path / "torch"
    torch_dir.mkdir()
    spec = importlib.machinery.ModuleSpec("torch", None, is_package=True)
    spec.submodule_search_locations = [str(torch_dir)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    driver = tmp_path / "nvidia-version"
    real_path = settings.Path

    def path(p: str) -> Path:
        return driver if p == "/proc/driver/nvidia/version" else real_path(p)

    monkeypatch.setattr(settings, "Path", path)
    (torch_dir / "version.py").write_text("cuda: Optional[str] = None\nhip: Optional[str] = None\n")
    assert not settings.cuda_installed()
    (torch_dir / "version.py").write_text("cuda: Optional[str] = '12.8'\nhip: Optional[str] = None\n")
    assert not settings.cuda_installed()  # a CUDA build, but no driver
    driver.write_text("NVRM version: 570\n")
    assert settings.cuda_installed()


def test_lora_adapters_come_from_repeated_flags_or_the_environment(monkeypatch):
    s = parse_args(["--lora", "support=/models/a", "--lora", "legal = /models/b", "--max-loras-per-batch", "2"])
    assert s.resolved_lora_adapters == {"support": "/models/a", "legal": "/models/b"}
    assert engine_config(s).scheduler.max_loras_per_batch == 2 and engine_config(s).max_lora_rank == 64
    monkeypatch.setenv("SHARDLINE_LORA_ADAPTERS", "x=/a,y=/b")
    assert parse_args([]).resolved_lora_adapters == {"x": "/a", "y": "/b"}
    for bad, problem in (("x", "each adapter is NAME=PATH"), ("x=/a,x=/b", "'x' is named twice"), ("=/a", "NAME=PATH")):
        monkeypatch.setenv("SHARDLINE_LORA_ADAPTERS", bad)
        with pytest.raises(ValidationError, match=problem):
            parse_args([])
