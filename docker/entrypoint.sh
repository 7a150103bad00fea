#!/bin/sh
# Entrypoint of both Shardline images: runs its arguments (`shardline serve <service>`).
# A worker without SHARDLINE_ADVERTISE_ADDRESS advertises its container's IP itself
# (gpu_worker_svc/server/settings.py), so scaled replicas need no per-replica setting.
set -eu
exec "$@"
