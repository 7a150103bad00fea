"""kernels/kernel_build.py and cpu_kernels.py: the CPU kernels ship built for every instruction-set
level, a worker loads the best its CPU runs without a compiler, and a build that does not fit is
never loaded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_worker_svc.model.layers.kernels import kernel_build
from gpu_worker_svc.model.layers.kernels.kernel_build import X86_VARIANTS, best_variant

REPO = Path(__file__).resolve().parents[3]
PREBUILT = kernel_build.PREBUILT_DIR
V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


def _python(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs code in a fresh interpreter: a library loads into a process once, and its ops register once."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_cpu_gets_the_best_level_it_runs():
    assert best_variant(frozenset(V4 | {"avx512_vnni"}), X86_VARIANTS).name == "avx512"
    assert best_variant(frozenset(V4), X86_VARIANTS).name == "avx512"
    assert best_variant(frozenset(V3 | {"avx512f"}), X86_VARIANTS).name == "avx2"
    # AVX2 without the rest of x86-64-v3 (an old CPU, or a VM that hides BMI2) is not enough.
    assert best_variant(frozenset(V3 - {"bmi2"}), X86_VARIANTS).name == "scalar"
    assert best_variant(frozenset(), X86_VARIANTS).name == "scalar"


def test_setup_built_every_level_for_this_torch_and_these_sources():
    manifest = kernel_build.read_manifest(PREBUILT)
    assert manifest is not None, f"no manifest in {PREBUILT}: scripts/setup.sh builds the kernels"
    assert manifest["variants"] == [v.name for v in kernel_build.variants()]
    assert manifest["torch"] == kernel_build.torch_release()
    assert manifest["sources"] == kernel_build.sources_digest()
    for name in manifest["variants"]:
        assert (PREBUILT / name / kernel_build.LIBRARY).is_file()


def test_the_shipped_kernels_load_on_a_machine_without_a_compiler(tmp_path):
    done = _python(
        "from gpu_worker_svc.model.layers.kernels import cpu_kernels, kernel_build\n"
        "print(cpu_kernels.library())\n"
        "print(kernel_build.best_variant(kernel_build.cpu_flags()).name)",
        # No compiler to be found, and an empty cache: only the shipped build can load.
        env={"CXX": "/nonexistent/c++", "PATH": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    where, variant = done.stdout.split()
    assert Path(where) == PREBUILT / variant / kernel_build.LIBRARY
    assert "compiling" not in done.stderr


def test_a_build_for_another_torch_or_other_sources_is_not_loaded(tmp_path):
    variant = best_variant(kernel_build.cpu_flags())
    copy = tmp_path / "lib"
    shutil.copytree(PREBUILT, copy)
    assert kernel_build.unusable_reason(copy, variant) is None
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "torch": "2.0.0"}))
    assert "built for torch 2.0.0" in kernel_build.unusable_reason(copy, variant)
    (copy / "manifest.json").write_text(json.dumps({**manifest, "sources": "0" * 16}))
    assert "other sources" in kernel_build.unusable_reason(copy, variant)
    assert "no kernels are built" in kernel_build.unusable_reason(tmp_path / "absent", variant)


def test_kernels_that_do_not_fit_are_compiled_once_into_the_cache(tmp_path):
    """Where the shipped build does not fit (here: none is shipped), a worker compiles its own level
    into the cache, and the next process loads that build without compiling again."""
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
        "from pathlib import Path\n"
        "from gpu_worker_svc.model.layers.kernels import cpu_kernels\n"
        f"print(cpu_kernels.find_library(Path({str(tmp_path / 'none')!r})))"
    )
    first = _python(code, env={"XDG_CACHE_HOME": str(tmp_path)}, timeout=300)  # one level: ~15 s on two cores
    assert first.returncode == 0, first.stderr
    built = Path(first.stdout.strip())
    assert built.is_file() and built.is_relative_to(tmp_path)
    assert "compiling the" in first.stderr
    second = _python(code, env={"XDG_CACHE_HOME": str(tmp_path)})
    assert second.returncode == 0 and Path(second.stdout.strip()) == built
    assert "compiling" not in second.stderr
    # The build left no scratch folders or objects behind.
    kernels_dir = built.parent.parent.parent
    assert not [p for p in kernels_dir.iterdir() if p.is_dir() and p.name.startswith(".")]
    assert not list(built.parent.glob("*.o"))


@pytest.mark.parametrize("variant", [v.name for v in kernel_build.variants()])
def test_each_level_this_cpu_runs_computes_what_torch_does(variant):
    if not next(v for v in kernel_build.variants() if v.name == variant).needs <= kernel_build.cpu_flags():
        pytest.skip(f"this CPU cannot run the {variant} build")
    done = _python(
        "import torch\n"
        f"torch.ops.load_library({str(PREBUILT / variant / kernel_build.LIBRARY)!r})\n"
        "ops = torch.ops.shardline_cpu\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x, w = torch.randn(5, 576, generator=g), torch.randn(576, generator=g)\n"
        "ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w\n"
        "torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), ref, rtol=1e-5, atol=1e-5)\n"
        "gate_up = torch.randn(5, 2 * 1536, generator=g)\n"
        "gate, up = gate_up.chunk(2, -1)\n"
        "torch.testing.assert_close(ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)\n"
        "print('ok')"
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
