"""`shardline batch submit|status|list|cancel|download`: the Batch API of a running stack, through the SDK."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardline.cli.arg_types import at_least_one
from shardline.cli.one_line_errors import one_line_errors
from shardline.client.batch_types import BatchInfo
from shardline.stack.state import StackNotRunning, StackState

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batch", help="submit and follow batches on a running stack (OpenAI's Batch API)")
    actions = p.add_subparsers(metavar="action", required=True)
    submit = actions.add_parser("submit", help="upload a JSONL file of requests and start a batch over it")
    submit.add_argument("file", type=Path, help='one request a line: {"custom_id", "method", "url", "body"}')
    submit.add_argument("--endpoint", choices=ENDPOINTS, default="/v1/chat/completions")
    submit.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE", help="a label (repeatable)")
    submit.add_argument("--wait", action="store_true", help="follow it with a progress bar until it ends")
    submit.add_argument("-o", "--output", type=Path, default=None, help="with --wait: write its results here")
    submit.set_defaults(func=one_line_errors("batch submit", run_submit))
    status = actions.add_parser("status", help="a batch's status, progress and files")
    status.add_argument("batch_id")
    status.set_defaults(func=one_line_errors("batch status", run_status))
    listing = actions.add_parser("list", help="your batches, newest first")
    listing.add_argument("--limit", type=at_least_one, default=20, help="at most this many (1 to 100)")
    listing.add_argument("--after", default=None, help="start after this batch id (the next page)")
    listing.set_defaults(func=one_line_errors("batch list", run_list))
    cancel = actions.add_parser("cancel", help="stop a running batch; its results so far are kept")
    cancel.add_argument("batch_id")
    cancel.set_defaults(func=one_line_errors("batch cancel", run_cancel))
    download = actions.add_parser("download", help="a batch's output (or error) lines, or any file by its id")
    download.add_argument("batch_id", help="a batch id (batch_...) or a file id (file-...)")
    download.add_argument("-o", "--output", type=Path, default=None, help="file to write (default: stdout)")
    download.add_argument("--errors", action="store_true", help="the batch's error file instead of its output")
    download.set_defaults(func=one_line_errors("batch download", run_download))
    for action in (submit, status, listing, cancel, download):
        action.add_argument(
            "--url",
            default=None,
            help="the gateway's gRPC address (default: the stack `shardline up` runs on --data-dir, else "
            "localhost:50051)",
        )
        action.add_argument("--data-dir", type=Path, default=Path(".shardline"), help="the stack's folder")
        action.add_argument("--api-key", default=None)


def _client(args: argparse.Namespace):
    from shardline.client import ShardlineClient

    return ShardlineClient(args.url or _stack_address(args.data_dir), api_key=args.api_key)


def _stack_address(data_dir: Path) -> str:
    """The gateway of the stack `shardline up` runs on `data_dir`; the default port when none runs."""
    try:
        return StackState.read(data_dir).grpc_address
    except StackNotRunning:
        return "localhost:50051"


def run_submit(args: argparse.Namespace) -> int:
    """Prints the batch's id; with --wait, a progress bar on stderr, then its status (exit 1 unless completed)."""
    metadata = dict(_pair(item) for item in args.metadata) or None
    with _client(args) as client:
        batch = client.batches.submit(args.file, endpoint=args.endpoint, metadata=metadata)
        print(batch.id, flush=True)
        if not args.wait:
            if batch.status == "failed":
                _print_status(batch)
                return 1
            return 0
        batch = _follow(client, batch)
        _print_status(batch)
        if args.output is not None and batch.output_file_id:
            client.batches.download(batch.output_file_id, args.output)
    return 0 if batch.status == "completed" else 1


def _follow(client, batch: BatchInfo) -> BatchInfo:
    from tqdm import tqdm

    with tqdm(total=batch.total, unit="line", desc=batch.id, file=sys.stderr, dynamic_ncols=True) as bar:

        def progress(b: BatchInfo) -> None:
            bar.update(b.completed + b.failed - bar.n)
            bar.set_postfix_str(b.status if not b.failed else f"{b.status}, {b.failed} failed")

        return client.batches.wait(batch.id, progress=progress, poll_s=0.5)


def _pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--metadata: expected KEY=VALUE, got {text!r}")
    return key, value


def run_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        _print_status(client.batches.get(args.batch_id))
    return 0


def _print_status(b: BatchInfo) -> None:
    print(f"{b.id}  {b.status}  {b.completed}/{b.total} completed, {b.failed} failed  ({b.endpoint})")
    for name, value in (("output", b.output_file_id), ("errors", b.error_file_id)):
        if value:
            print(f"  {name}: {value}")
    for e in b.errors:
        print(f"  line {e.line}: {e.param}: {e.message}")
    if b.metadata:
        print("  metadata: " + ", ".join(f"{k}={v}" for k, v in sorted(b.metadata.items())))


def run_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        batches, more = client.batches.list(limit=args.limit, after=args.after)
    for b in batches:
        print(f"{b.id}  {b.status:<11} {b.completed + b.failed:>6}/{b.total:<6} {b.endpoint}")
    if more:
        print(f"(more: --after {batches[-1].id})")
    return 0


def run_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        _print_status(client.batches.cancel(args.batch_id))
    return 0


def run_download(args: argparse.Namespace) -> int:
    with _client(args) as client:
        file_id = args.batch_id
        if not file_id.startswith("file-"):
            batch = client.batches.get(args.batch_id)
            file_id = batch.error_file_id if args.errors else batch.output_file_id
            if not file_id:
                kind = "error" if args.errors else "output"
                print(f"shardline batch download: {batch.id} is {batch.status} and has no {kind} file", file=sys.stderr)
                return 1
        if args.output is None:
            sys.stdout.buffer.write(client.batches.read_file(file_id))
            sys.stdout.flush()
        else:
            client.batches.download(file_id, args.output)
    return 0
