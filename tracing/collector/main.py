"""`shardline serve tracing`: the OTLP receiver and the trace dashboard, in one process.

Services export spans over OTLP/gRPC to ``--otlp-port``; they are stored in
Redis (bounded by ``SHARDLINE_TRACE_MAX_SPANS`` and ``SHARDLINE_TRACE_MAX_AGE_S``)
and the dashboard on ``--http-port`` reads them back. The OTLP port also
answers the standard gRPC health check, so a supervisor can wait for it.
"""

import argparse
import asyncio
import logging
import signal

from aiohttp import web

from shardline.core.service_main import run_service, started
from tracing.collector.dashboard_app import build_app
from tracing.collector.otlp_receiver import serve_receiver
from tracing.settings import TracingSettings

logger = logging.getLogger(__name__)
STOP_GRACE_S = 5.0


def parse_args(argv: list[str] | None) -> tuple[TracingSettings, str]:
    """Settings from the environment, overridden by the flags that were given."""
    parser = argparse.ArgumentParser(prog="shardline serve tracing", description=__doc__)
    parser.add_argument("--host", help="interface to listen on (default 0.0.0.0)")
    parser.add_argument("--otlp-port", type=int, help="OTLP/gRPC receiver port (default 4317; 0 picks one)")
    parser.add_argument("--http-port", type=int, help="dashboard HTTP port (default 8080; 0 picks one)")
    parser.add_argument("--redis-url", help="Redis to store spans in, e.g. redis://127.0.0.1:6379/0")
    parser.add_argument("--trace-max-spans", type=int, help="keep at most this many spans")
    parser.add_argument("--trace-max-age-s", type=float, help="drop spans older than this")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    args = vars(parser.parse_args(argv))
    log_level = args.pop("log_level")
    overrides = {name: value for name, value in args.items() if value is not None}
    return TracingSettings(**overrides), log_level


async def serve(settings: TracingSettings, stop: asyncio.Event | None = None) -> None:
    """Runs the receiver and the dashboard until SIGTERM/SIGINT (or ``stop`` is set)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    receiver = await serve_receiver(settings.otlp_port, settings.redis_url, host=settings.host, settings=settings)
    runner = web.AppRunner(build_app(receiver.store), access_log=None)
    try:
        await runner.setup()
        site = web.TCPSite(runner, settings.host, settings.http_port)
        await site.start()
        logger.info(
            "tracing: OTLP on :%d, dashboard on %s",
            receiver.port,
            ", ".join(f"http://{host}:{port}/" for host, port, *_ in runner.addresses),
        )
        started()
        await stop.wait()
        logger.info("stopping: finishing in-flight exports")
    finally:
        # The dashboard first: the receiver's stop closes the store they share.
        await runner.cleanup()
        await receiver.stop(STOP_GRACE_S)


def main(argv: list[str] | None = None) -> int:
    """Runs the tracing service until SIGTERM or SIGINT; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def run() -> None:
        settings, log_level = parse_args(argv)
        logging.getLogger().setLevel(log_level.upper())
        asyncio.run(serve(settings))

    # grpc reports a taken OTLP port as a RuntimeError.
    return run_service("tracing", run, startup_errors=(RuntimeError,))


if __name__ == "__main__":
    raise SystemExit(main())
