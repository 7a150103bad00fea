"""`python -m build` at the root, as a release is made: an sdist with the sources and the contracts,
and a wheel built from that sdist (in an isolated build environment) that carries the stubs and
the kernels of every level, and installs and imports in a clean venv.

It compiles the kernels from scratch, so it runs after the suite (`.ci/run`:
`pytest -m packaging tests/test_release_build.py`); tests/e2e/test_installed_sdk.py checks the
wheel of the checkout's own build on every run.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

import shardline

pytestmark = [pytest.mark.packaging, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
KERNELS = "gpu_worker_svc/model/layers/kernels/lib"


def _run(*command: str | Path, cwd: Path, timeout: float = 1200) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, command))}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The sdist and the wheel of `python -m build`, run on a copy of the tree a commit would hold."""
    src = tmp_path_factory.mktemp("src")
    files = _run("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=REPO).stdout
    for name in filter(None, files.split("\0")):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "build", "--outdir", out, src, cwd=src)
    return out


def test_the_sdist_has_the_sources_and_the_contracts_and_nothing_generated(dist):
    (sdist,) = dist.glob("shardline-*.tar.gz")
    root = f"shardline-{shardline.__version__}"
    names = {name.removeprefix(f"{root}/") for name in tarfile.open(sdist).getnames()}
    assert {"setup.py", "pyproject.toml", "MANIFEST.in", "protos/shardline/v1/generation.proto"} <= names
    assert "gpu_worker_svc/model/layers/kernels/decode_attention.cpp" in names
    assert not [n for n in names if n.startswith(("shardline/v1/", KERNELS)) or n.endswith((".so", ".pyc"))]


def test_the_wheel_built_from_the_sdist_carries_stubs_and_kernels_and_installs(dist, tmp_path):
    (wheel,) = dist.glob("shardline-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"shardline/v1/generation.proto", "shardline/v1/generation_pb2.py", f"{KERNELS}/manifest.json"} <= names
    assert {f"{KERNELS}/{level}/libshardline_cpu.so" for level in ("avx512", "avx2", "scalar")} <= names
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    _run(env_dir / "bin" / "python", "-m", "pip", "install", "-q", wheel, cwd=tmp_path)
    version = _run(env_dir / "bin" / "shardline", "--version", cwd=tmp_path).stdout.strip()
    assert version == f"shardline {shardline.__version__}"
    _run(env_dir / "bin" / "python", "-c", "from shardline.client import ShardlineClient", cwd=tmp_path)
