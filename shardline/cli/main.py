"""`shardline`: run the stack or one service, see its status, or generate from the command line."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

import shardline
from shardline.cli.serve_extra import ServeExtraMissing, require_serve

SERVICES = {
    "gateway": "gateway.main",
    "tokenizer": "tokenizer_svc.main",
    "scheduler": "scheduler_svc.main",
    "worker": "gpu_worker_svc.server.main",
    "tracing": "tracing.collector.main",
    "batch": "batch_svc.main",
}


def main(argv: list[str] | None = None) -> int:
    own_process = argv is None  # run as the program, not called from Python: a command may restart it
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _main(argv, own_process)
    except ServeExtraMissing as exc:
        print(exc, file=sys.stderr)
        return 2


def _main(argv: list[str], own_process: bool) -> int:
    if argv[:1] == ["serve"]:
        # Flags after the service name belong to that service's own parser.
        if len(argv) < 2 or argv[1] not in SERVICES:
            print(f"usage: shardline serve {{{','.join(SERVICES)}}} [service flags]", file=sys.stderr)
            return 2
        require_serve(f"serve {argv[1]}")
        service = importlib.import_module(SERVICES[argv[1]])
        if argv[1] == "worker":  # a CPU worker restarts itself (malloc settings), only as its own process
            return service.main(argv[2:], own_process=own_process)
        return service.main(argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    args.own_process = own_process
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    return args.func(args)


def build_parser() -> argparse.ArgumentParser:
    from shardline.cli import (
        autoscale_cmd,
        batch_cmd,
        bench_cmd,
        generate_cmd,
        run_batch_cmd,
        status_cmd,
        top_cmd,
        trace_cmd,
        up_cmd,
    )

    parser = argparse.ArgumentParser(prog="shardline", description="Shardline: LLM serving in Python")
    parser.add_argument("--version", action="version", version=f"shardline {shardline.__version__}")
    sub = parser.add_subparsers(metavar="command")
    sub.add_parser("serve", help="start one service: " + ", ".join(SERVICES))
    up_cmd.add_parser(sub)
    status_cmd.add_parser(sub)
    top_cmd.add_parser(sub)
    generate_cmd.add_parsers(sub)
    bench_cmd.add_parser(sub)
    trace_cmd.add_parser(sub)
    batch_cmd.add_parser(sub)
    run_batch_cmd.add_parser(sub)
    autoscale_cmd.add_parser(sub)
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
