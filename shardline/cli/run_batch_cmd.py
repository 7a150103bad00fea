"""`shardline run-batch -i in.jsonl -o out.jsonl`: a batch file run offline, like `vllm run-batch`.

No Celery, no Redis of yours and no running stack: the command starts a private stack (LocalStack on
free ports, a temporary data folder), sends each line to that stack's gateway over HTTP, with a
bounded number in flight, writes the output file, and stops the stack.

Why a private stack rather than the engine in this process: the output's bodies must be exactly what
the online endpoint answers (the Batch API's promise), and that answer is built by the gateway's
whole path: the tokenizer service's chat template, the parameter checks, stop strings, tool-call
parsing, usage and the response fields. Sending through the real gateway gives that by construction;
any in-process shortcut would be a second implementation that drifts from it. The cost is the
stack's start (seconds, mostly the model load), which a batch amortizes. The lines are sent the way
the batch workers send them (batch_svc/line_client.py: named X-Request-Id, 429s and 503s waited out).

The input has the Batch API's line format and checks (shardline/core/batch/input_lines.py), every line's
url one of the two endpoints; a bad line stops the command before anything starts, naming the line
and the field. The output has a line per input line, in input order (shardline/core/batch/output_lines.py):
its response (status_code, request_id, body) or, when no answer came, its error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import tempfile
from pathlib import Path

from shardline.cli.arg_types import at_least_one
from shardline.cli.one_line_errors import one_line_errors
from shardline.cli.serve_extra import require_serve
from shardline.core.batch.input_lines import ENDPOINTS, BatchLine, LineError, parse_line
from shardline.core.errors import InvalidArgument

STACK_START_TIMEOUT_S = 600.0
# The longest one request may take before it is sent again (it then attaches to the one running).
LINE_TIMEOUT_S = 3600.0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run-batch", help="run a batch file offline on a private stack (like vllm run-batch)")
    p.add_argument("-i", "--input", type=Path, required=True, help='JSONL: {"custom_id", "method", "url", "body"}')
    p.add_argument("-o", "--output", type=Path, required=True, help="JSONL: a result line per input line")
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the default model)")
    p.add_argument("--tp", type=at_least_one, default=1, help="tensor-parallel size")
    p.add_argument("--concurrency", type=at_least_one, default=16, help="requests in flight at most")
    p.add_argument(
        "--gateway-url",
        default=None,
        help="send the lines to this running gateway's HTTP root instead of a private stack",
    )
    p.add_argument("--api-key", default=None, help="with --gateway-url: its API key")
    p.add_argument("-v", "--verbose", action="store_true", help="say how the private stack starts")
    p.set_defaults(func=one_line_errors("run-batch", run))


def run(args: argparse.Namespace) -> int:
    """Exit 0 when every line was answered with status 200, 1 when some were not, 2 for bad input."""
    require_serve("run-batch")
    lines, errors = read_lines(args.input)
    if errors:
        for e in errors:
            print(f"shardline run-batch: {args.input}:{e.line}: {e.message}", file=sys.stderr)
        return 2
    if args.gateway_url:
        results = asyncio.run(_send_all(args.gateway_url, args.api_key or "", lines, args.concurrency))
    else:
        results = _on_private_stack(args, lines)
    failed = _write_output(args.output, lines, results)
    print(f"{len(lines) - failed}/{len(lines)} lines answered with 200; results in {args.output}", file=sys.stderr)
    return 1 if failed else 0


def read_lines(path: Path) -> tuple[list[tuple[str, BatchLine]], list[LineError]]:
    """The input's (url, line) pairs, checked as a batch's input is (the online parser for each body)."""
    from gateway.http_api.openai_request import parse_request

    checks = {url: (lambda body, chat=url == "/v1/chat/completions": parse_request(body, chat)) for url in ENDPOINTS}
    lines: list[tuple[str, BatchLine]] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    with open(path, "rb") as source:
        for raw in source:
            if not raw.strip():
                continue
            index = len(lines) + len(errors)
            try:
                url = _url_of(raw)
                line = parse_line(raw, index, url, checks[url])
                if line.custom_id in seen:
                    raise InvalidArgument("custom_id", f"{line.custom_id!r} is used by an earlier line")
                seen.add(line.custom_id)
                lines.append((url, line))
            except InvalidArgument as exc:
                errors.append(LineError(index + 1, exc.field, str(exc)))
    if not lines and not errors:
        errors.append(LineError(0, "input", "the file has no requests"))
    return lines, errors


def _url_of(raw: bytes) -> str:
    try:
        url = json.loads(raw).get("url")
    except (ValueError, AttributeError):
        return ENDPOINTS[0]  # parse_line names the line's own problem
    if url not in ENDPOINTS:
        raise InvalidArgument("url", f"must be one of {list(ENDPOINTS)}, got {url!r}")
    return url


def _on_private_stack(args: argparse.Namespace, lines: list[tuple[str, BatchLine]]) -> list:
    from shardline.stack.local_stack import LocalStack, StackConfig

    say = (lambda msg: print(msg, file=sys.stderr)) if args.verbose else (lambda msg: None)
    with tempfile.TemporaryDirectory(prefix="shardline-run-batch-") as tmp:
        log_dir = Path(tmp) / "logs"
        config = StackConfig.on_free_ports(model=args.model, tp_size=args.tp, data_dir=Path(tmp), log_dir=log_dir)
        stack = LocalStack(config)
        try:
            stack.start(progress=say, timeout_s=STACK_START_TIMEOUT_S)
        except Exception:  # start() has stopped what it started; its logs say why
            for log in sorted(log_dir.glob("*.log")):
                print(f"----- {log.name}\n{log.read_text(errors='replace')[-2000:]}", file=sys.stderr)
            raise
        try:
            return asyncio.run(_send_all(f"http://127.0.0.1:{config.http_port}", "", lines, args.concurrency))
        finally:
            stack.stop()


async def _send_all(gateway_url: str, api_key: str, lines: list[tuple[str, BatchLine]], concurrency: int) -> list:
    import aiohttp
    from tqdm import tqdm

    from batch_svc.aimd import AimdLimit
    from batch_svc.line_client import LineClient

    run_id = f"run-batch-{secrets.token_hex(6)}"
    limit = AimdLimit(concurrency, start=concurrency)
    timeout = aiohttp.ClientTimeout(total=LINE_TIMEOUT_S)
    with tqdm(total=len(lines), unit="line", file=sys.stderr, disable=None) as bar:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            client = LineClient(gateway_url, api_key, 0, session)

            async def send(url: str, line: BatchLine):
                try:
                    return await client.send(line, url, f"{run_id}-{line.index}", limit, lambda: False)
                finally:
                    bar.update(1)

            return await asyncio.gather(*(send(url, line) for url, line in lines))


def _write_output(path: Path, lines: list[tuple[str, BatchLine]], results: list) -> int:
    """Writes a line per input line, in order; returns how many were not answered with 200."""
    from shardline.core.batch.output_lines import error_line, output_line

    batch_id = f"batch_offline_{secrets.token_hex(8)}"
    failed = 0
    with open(path, "w") as out:
        for (_, line), result in zip(lines, results, strict=True):
            if result.status is None:
                out.write(error_line(batch_id, line.index, line.custom_id, "no_response", result.error) + "\n")
            else:
                out.write(
                    output_line(batch_id, line.index, line.custom_id, result.status, result.request_id, result.body)
                    + "\n"
                )
            failed += result.status != 200
    return failed
