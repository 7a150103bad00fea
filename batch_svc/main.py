"""`shardline serve batch`: a Celery worker that runs batch chunks, until SIGTERM.

Chunks run on threads (one event loop each), `--concurrency` of them at once; a warm shutdown
(SIGTERM) lets the running chunks finish, and a chunk cut short by SIGKILL is redelivered by Redis
after the visibility timeout and goes on where its done-set ends.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from celery import signals

from batch_svc.app import build_app
from batch_svc.health import HealthServer
from batch_svc.settings import BatchSettings
from shardline.core.service_main import run_service, started
from tracing.otel_setup import setup_tracing


def parse_settings(argv: list[str] | None) -> BatchSettings:
    parser = argparse.ArgumentParser(prog="shardline serve batch", description=__doc__)
    parser.add_argument("--redis-url", help="Celery broker, result backend and batch store")
    parser.add_argument("--gateway-url", help="the gateway's HTTP API (default http://localhost:8000)")
    parser.add_argument("--gateway-grpc-address", help="the gateway's gRPC API (default localhost:50051)")
    parser.add_argument("--files-dir", help="the file store's folder, shared with the gateway")
    parser.add_argument("--batch-concurrency", type=int, help="chunks run at once (default 2)")
    parser.add_argument("--batch-max-in-flight", type=int, help="requests in flight per chunk at most (default 16)")
    parser.add_argument("--batch-health-port", type=int, help="/health and /metrics port (default 8090)")
    args = parser.parse_args(argv)
    return BatchSettings(**{key: value for key, value in vars(args).items() if value is not None})


def serve(settings: BatchSettings) -> int:
    tracing = setup_tracing("batch", settings.instance_id, enabled=settings.tracing)
    app = build_app(settings)
    health = HealthServer(settings.batch_health_port, settings.redis_url)
    signals.worker_ready.connect(lambda **_: health.ready.set(), weak=False)
    logging.getLogger("shardline.core.batch").info("batch worker: /health and /metrics on %d", health.port)
    started()
    try:
        app.worker_main(
            [
                "worker",
                "--pool=threads",
                f"--concurrency={settings.batch_concurrency}",
                "--loglevel=INFO",
                "--without-gossip",
                "--without-mingle",
                f"--hostname=batch@{socket.gethostname()}",
            ]
        )
    finally:
        health.stop()
        tracing.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_service("batch", lambda: serve(parse_settings(argv)))


if __name__ == "__main__":
    sys.exit(main())
