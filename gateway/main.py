"""`shardline serve gateway`: run the OpenAI HTTP API and the Generation gRPC API until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from gateway.server import serve
from gateway.settings import GatewaySettings
from shardline.core.service_main import run_service


def parse_settings(argv: list[str] | None) -> GatewaySettings:
    """Settings from the environment, with the command-line flags that were given on top."""
    parser = argparse.ArgumentParser(prog="shardline serve gateway", description=__doc__)
    parser.add_argument("--host", help="interface to listen on (default 0.0.0.0)")
    parser.add_argument("--http-port", type=int, help="OpenAI HTTP port (default 8000)")
    parser.add_argument("--grpc-port", type=int, help="Generation gRPC port (default 50051)")
    parser.add_argument("--tokenizer-address", help="host:port of the tokenizer service (default localhost:50052)")
    parser.add_argument("--scheduler-address", help="host:port of the scheduler (default localhost:50053)")
    parser.add_argument("--gateway-id", help="this gateway's Subscribe identity (default: random)")
    parser.add_argument("--api-keys", help="comma-separated accepted API keys (default: no authentication)")
    parser.add_argument("--max-prompt-tokens", type=int, help="longest prompt accepted, in tokens")
    parser.add_argument("--max-tokens-limit", type=int, help="largest max_tokens accepted")
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        help="cap on max_tokens of chat and gRPC requests that give none (default: the rest of the context)",
    )
    parser.add_argument("--request-timeout-s", type=float, help="per-request wall-clock budget (default 600)")
    args = parser.parse_args(argv)
    return GatewaySettings(**{key: value for key, value in vars(args).items() if value is not None})


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_service("gateway", lambda: asyncio.run(serve(parse_settings(argv))))


if __name__ == "__main__":
    sys.exit(main())
