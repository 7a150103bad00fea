"""Shardline as an application installs it: the wheel, without extras, in a venv of its own.

The wheel is built from this checkout's tracked files, installed offline from a local wheelhouse
into a fresh venv, and then used as a user would: the SDK streams from the running stack, and the
client commands run. Nothing of the checkout is importable there.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

import shardline

REPO = Path(__file__).resolve().parents[2]
KERNELS = Path("gpu_worker_svc", "model", "layers", "kernels", "lib")
# An application that only calls Shardline takes this much: grpcio is most of it.
MAX_INSTALLED_MB = 100


def _run(*command: str | Path, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, command))}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _size_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink()) / 1e6


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the tracked files (the kernels already built by setup are reused)."""
    src = tmp_path_factory.mktemp("src")
    # Tracked files and new ones not yet committed: what a commit of this tree would hold.
    tracked = _run("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=REPO).stdout.split("\0")
    for name in filter(None, tracked):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / KERNELS, src / KERNELS)
    dist = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist, src, timeout=600)
    (built,) = dist.glob("shardline-*.whl")
    return built


@pytest.fixture(scope="module")
def sdk_venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with `pip install shardline`, offline, from a wheelhouse of the wheel and its dependencies."""
    house = tmp_path_factory.mktemp("wheelhouse")
    shutil.copy(wheel, house)
    # The dependencies' wheels, as a mirror or an air-gapped site would hold them.
    _run(sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--dest", house, wheel)
    env_dir = tmp_path_factory.mktemp("sdk") / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    before = _size_mb(env_dir)
    _run(python, "-m", "pip", "install", "-q", "--no-index", "--find-links", house, "shardline")
    installed = _size_mb(env_dir) - before
    print(f"pip install shardline: {installed:.1f} MB installed")
    assert installed < MAX_INSTALLED_MB, f"the SDK install is {installed:.0f} MB"
    return env_dir


def test_the_wheel_carries_the_stubs_the_protos_and_the_built_kernels(wheel):
    assert wheel.name.endswith("-py3-none-linux_x86_64.whl") or "-py3-none-" in wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    for stem in ("common", "generation", "sampling", "scheduler", "tokenizer", "worker", "batches"):
        assert {f"shardline/v1/{stem}.proto", f"shardline/v1/{stem}_pb2.py", f"shardline/v1/{stem}_pb2.pyi"} <= names
    assert "shardline/v1/generation_pb2_grpc.py" in names
    libs = {n for n in names if n.startswith(str(KERNELS))}
    assert {f"{KERNELS}/{level}/libshardline_cpu.so" for level in ("avx512", "avx2", "scalar")} <= libs
    assert f"{KERNELS}/manifest.json" in libs
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "protos/"))]
    assert f"shardline-{shardline.__version__}.dist-info/METADATA" in names


def test_the_sdk_streams_from_a_live_stack_without_torch(sdk_venv, grpc_target, tmp_path):
    python = sdk_venv / "bin" / "python"
    script = tmp_path / "app.py"
    script.write_text(
        "import sys\n"
        "from shardline.client import ShardlineClient\n"
        f"with ShardlineClient({grpc_target!r}) as client:\n"
        "    text = ''.join(c.text for c in client.stream('The capital of France is', max_tokens=8, temperature=0))\n"
        "    done = client.generate('The capital of France is', max_tokens=8, temperature=0)\n"
        "assert text and text == done.text, (text, done.text)\n"
        "heavy = sorted({'torch', 'numpy', 'grpc_tools', 'shardline.protogen', 'shardline.core'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
        "print(text)\n"
    )
    # From a folder outside the checkout: only the installed package can be imported.
    streamed = _run(python, script, cwd=tmp_path).stdout.strip()
    assert streamed
    probe = _run(python, "-c", "import importlib.util as u; print(u.find_spec('torch'))", cwd=tmp_path)
    assert probe.stdout.strip() == "None"
    where = _run(python, "-c", "import shardline; print(shardline.__file__)", cwd=tmp_path).stdout
    assert str(sdk_venv) in where and str(REPO) not in where


def test_the_client_commands_run_and_the_serving_ones_say_what_to_install(sdk_venv, grpc_target, tmp_path):
    cli = sdk_venv / "bin" / "shardline"
    assert _run(cli, "--version", cwd=tmp_path).stdout.strip() == f"shardline {shardline.__version__}"
    out = _run(cli, "generate", "--url", grpc_target, "--max-tokens", "4", "Hello", cwd=tmp_path).stdout
    assert out.strip()
    bench = _run(
        cli,
        "bench",
        "--url",
        grpc_target,
        "--num-prompts",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--out",
        tmp_path / "bench.json",
        cwd=tmp_path,
    )
    assert (tmp_path / "bench.json").is_file(), bench.stdout
    # status reads a `shardline up` stack's folder: none here, said in one line.
    status = subprocess.run(
        [str(cli), "status", "--data-dir", str(tmp_path / "none")], cwd=tmp_path, capture_output=True, text=True
    )
    assert status.returncode == 1 and "shardline status:" in status.stderr and "Traceback" not in status.stderr
    # top is a client command too: it reads a trace dashboard over HTTP; none listens on port 9.
    top = subprocess.run(
        [str(cli), "top", "--once", "--url", "http://127.0.0.1:9"], cwd=tmp_path, capture_output=True, text=True
    )
    assert top.returncode == 1 and top.stderr.startswith("shardline top: the trace dashboard at"), top.stderr
    assert "Traceback" not in top.stderr
    for command in (["up"], ["serve", "worker"], ["generate", "hi"]):
        done = subprocess.run([str(cli), *command], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert "pip install 'shardline[serve]'" in done.stderr and "Traceback" not in done.stderr
