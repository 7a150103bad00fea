#!/bin/sh
# Builds the base images Shardline's compose file needs from Debian packages, for a host that
# cannot pull from Docker Hub (an air-gapped site, a CI machine behind a registry allow-list):
#
#   docker/base-images.sh            # all of them, tagged shardline-base/<name>:bookworm
#   docker/base-images.sh python redis
#
# then point compose at them (.env, or the environment):
#
#   PYTHON_IMAGE=shardline-base/python:bookworm
#   REDIS_IMAGE=shardline-base/redis:bookworm
#   PROMETHEUS_IMAGE=shardline-base/prometheus:bookworm
#
# The root is made once with debootstrap (a minimal Debian, imported with `docker import`); each
# image adds its packages to it with apt, inside `docker build`. DEBIAN_MIRROR picks the mirror,
# SUITE the release. Needs root (debootstrap), debootstrap and a Docker engine.
set -eu

SUITE=${SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PREFIX=${BASE_IMAGE_PREFIX:-shardline-base}
ROOT_IMAGE="$PREFIX/debian:$SUITE"

root_image() {
    if docker image inspect "$ROOT_IMAGE" >/dev/null 2>&1; then
        return
    fi
    dir=$(mktemp -d)
    trap 'rm -rf "$dir"' EXIT
    debootstrap --variant=minbase "$SUITE" "$dir/root" "$MIRROR" >"$dir/debootstrap.log" 2>&1 \
        || { tail -20 "$dir/debootstrap.log" >&2; exit 1; }
    # apt inside the builds below: no recommends, no caches left in the layers.
    printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' >"$dir/root/etc/apt/apt.conf.d/90shardline"
    rm -rf "$dir/root/var/cache/apt/archives/"*.deb "$dir/root/var/lib/apt/lists/"*
    tar -C "$dir/root" -c . | docker import --change 'CMD ["/bin/bash"]' - "$ROOT_IMAGE" >/dev/null
    rm -rf "$dir"
    trap - EXIT
    echo "built $ROOT_IMAGE"
}

# build NAME PACKAGES DOCKERFILE-LINES: the root image plus PACKAGES, then the lines.
build() {
    name=$1
    packages=$2
    shift 2
    {
        echo "FROM $ROOT_IMAGE"
        echo "RUN apt-get update && apt-get install -y $packages && rm -rf /var/lib/apt/lists/*"
        for line in "$@"; do echo "$line"; done
    } | docker build -q -t "$PREFIX/$name:$SUITE" - >/dev/null
    echo "built $PREFIX/$name:$SUITE"
}

python_image() {
    # What python:3.11-slim gives the Dockerfile: python (Debian's 3.11), venv, and CA certificates.
    build python "python3 python3-venv python-is-python3 ca-certificates"
}

redis_image() {
    # Debian's redis-server, run as its own user. /data is owned by it, so that a new named volume
    # mounted there (compose's redis-data) is too.
    build redis "redis-server" \
        "RUN mkdir -p /data && chown redis:redis /data" \
        "WORKDIR /data" \
        "USER redis" \
        "EXPOSE 6379" \
        'CMD ["redis-server"]'
}

prometheus_image() {
    # Debian's prometheus, as prom/prometheus runs it: the binary as the entrypoint, as its own user,
    # with wget for the healthcheck.
    build prometheus "prometheus wget" \
        "RUN mkdir -p /prometheus && chown prometheus:prometheus /prometheus" \
        "WORKDIR /prometheus" \
        "USER prometheus" \
        "EXPOSE 9090" \
        'ENTRYPOINT ["/usr/bin/prometheus"]' \
        'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]'
}

[ $# -gt 0 ] || set -- python redis prometheus
root_image
for image in "$@"; do
    case "$image" in
    python) python_image ;;
    redis) redis_image ;;
    prometheus) prometheus_image ;;
    *) echo "unknown image $image: python, redis or prometheus" >&2; exit 2 ;;
    esac
done
