"""`shardline top`: a live terminal view of a stack's load, latency and workers, from its trace dashboard.

It reads the tracing service's /api/series (docs/dashboard.md) over plain HTTP, so it runs from the
light SDK install, on hosts without a browser.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import sys
import termios
import time
import tty
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from shardline.cli.one_line_errors import one_line_errors
from shardline.cli.top_view import NAMES, WINDOWS_S, Window, render
from shardline.stack.state import StackNotRunning, StackState

TIMEOUT_S = 3.0
# Alternate screen and hidden cursor while it runs; both given back on the way out.
ENTER, LEAVE, HOME_AND_CLEAR = "\x1b[?1049h\x1b[?25l", "\x1b[?25h\x1b[?1049l", "\x1b[H\x1b[2J"


class DashboardUnreachable(OSError):
    """The tracing service did not answer, or answered with an error."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("top", help="a live view of a stack: throughput, TTFT, the queue, each worker's load and KV")
    p.add_argument(
        "--url", help="the trace dashboard, e.g. http://127.0.0.1:8080 (default: the `shardline up` stack's)"
    )
    p.add_argument(
        "--data-dir", type=Path, default=Path(".shardline"), help="the stack's folder, as given to `shardline up`"
    )
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--once", action="store_true", help="print one screen and exit (also when not on a terminal)")
    p.set_defaults(func=one_line_errors("top", run))


def dashboard_url(args: argparse.Namespace) -> str:
    """--url, else the dashboard of the stack `shardline up` runs from --data-dir."""
    if args.url:
        return args.url.rstrip("/")
    try:
        state = StackState.read(args.data_dir)
    except StackNotRunning as exc:
        raise ValueError(f"{exc}; or give --url of a trace dashboard") from None
    if not state.dashboard_url:
        raise ValueError(f"the stack on {args.data_dir} runs without tracing (started with --no-tracing)")
    return state.dashboard_url.rstrip("/")


def _window(url: str, seconds: int, now_s: float) -> Window:
    # One step over the whole window, so that its percentiles are the window's, not an average of steps.
    query = urllib.parse.urlencode(
        {"names": ",".join(NAMES), "from": f"{now_s - seconds + 1:.3f}", "to": f"{now_s:.3f}", "step": seconds}
    )
    try:
        with urllib.request.urlopen(f"{url}/api/series?{query}", timeout=TIMEOUT_S) as response:
            return Window(json.load(response)["series"])
    except urllib.error.HTTPError as exc:
        raise DashboardUnreachable(f"{url} answered {exc.code}: {exc.read().decode(errors='replace')}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        reason = getattr(exc, "reason", exc)
        raise DashboardUnreachable(f"the trace dashboard at {url} does not answer: {reason}") from None


def screen(url: str) -> str:
    """One screen of the view, read now."""
    now_s = time.time()
    return render(url, {seconds: _window(url, seconds, now_s) for seconds in WINDOWS_S}, now_s)


@contextlib.contextmanager
def _keys_without_echo(fd: int) -> Iterator[None]:
    """Keys arrive one at a time and unechoed; Ctrl-C still interrupts. The terminal is restored after."""
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    sys.stdout.write(ENTER)
    try:
        yield
    finally:
        sys.stdout.write(LEAVE)
        sys.stdout.flush()
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _quit_pressed(fd: int, wait_s: float) -> bool:
    """Waits up to ``wait_s`` for a key; True when it is q."""
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if ready and os.read(fd, 1) in (b"q", b"Q"):
            return True
    return False


def run(args: argparse.Namespace) -> int:
    """Refreshes until q or Ctrl-C (exit 0); with --once, or off a terminal, prints one screen."""
    if args.interval <= 0:
        raise ValueError(f"--interval must be above 0, got {args.interval}")
    url = dashboard_url(args)
    if args.once or not (sys.stdin.isatty() and sys.stdout.isatty()):
        print(screen(url))
        return 0
    fd = sys.stdin.fileno()
    # Ctrl-C quits even when a parent started us with SIGINT ignored, as a non-interactive shell
    # does for its background jobs: Python keeps an ignored SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with _keys_without_echo(fd):
            while True:
                try:
                    text = screen(url)
                except DashboardUnreachable as exc:  # live: say so and keep trying
                    text = f"shardline top  {url}\n\n{exc}\n\nretrying every {args.interval:g} s (q quits)"
                sys.stdout.write(HOME_AND_CLEAR + text.replace("\n", "\r\n") + "\r\n")
                sys.stdout.flush()
                if _quit_pressed(fd, args.interval):
                    return 0
    except KeyboardInterrupt:
        return 0
