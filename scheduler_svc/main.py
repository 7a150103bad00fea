"""`python -m scheduler_svc.main` (or `shardline serve scheduler`): runs the central scheduler."""

import argparse
import asyncio
import logging

from scheduler_svc.server import serve
from scheduler_svc.settings import SchedulerSettings
from shardline.core.service_main import run_service


def parse_args(argv: list[str] | None) -> tuple[SchedulerSettings, str]:
    """Settings from the environment, overridden by the flags that were given."""
    parser = argparse.ArgumentParser(prog="shardline serve scheduler", description=__doc__)
    parser.add_argument("--host", help="interface to listen on")
    parser.add_argument("--port", type=int, help="gRPC port (0 picks a free one)")
    parser.add_argument("--redis-url", help="Redis holding request state, e.g. redis://127.0.0.1:6379/0")
    parser.add_argument("--queue-capacity", type=int, help="queued requests before RESOURCE_EXHAUSTED")
    parser.add_argument("--heartbeat-interval-s", type=float, help="how often workers heartbeat")
    parser.add_argument("--heartbeat-timeout-s", type=float, help="silence after which a worker is dead")
    parser.add_argument("--max-attempts", type=int, help="dispatches per request before it fails")
    parser.add_argument("--request-retention-s", type=float, help="how long finished requests stay in Redis")
    parser.add_argument("--metrics-port", type=int, help="Prometheus /metrics port; 0 turns it off")
    parser.add_argument("--tracing", action=argparse.BooleanOptionalAction, default=None, help="export spans over OTLP")
    parser.add_argument("--instance-id", help="service.instance.id of this scheduler's spans")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    args = vars(parser.parse_args(argv))
    log_level = args.pop("log_level")
    overrides = {name: value for name, value in args.items() if value is not None}
    return SchedulerSettings(**overrides), log_level


def main(argv: list[str] | None = None) -> int:
    """Runs the scheduler until SIGTERM or SIGINT; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def run() -> None:
        settings, log_level = parse_args(argv)
        logging.getLogger().setLevel(log_level.upper())
        asyncio.run(serve(settings))

    return run_service("scheduler", run)


if __name__ == "__main__":
    raise SystemExit(main())
