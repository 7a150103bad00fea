"""The services' log files as `shardline up` echoes them: their errors only, or every line with --verbose."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# A logging record's first line, in any of the services' formats: "<asctime> [name] LEVEL ...".
_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (?:\S+ )?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")
_ERROR_LEVELS = ("ERROR", "CRITICAL")


@dataclass(slots=True)
class LogErrorFilter:
    """Which lines of one log reach the console: error records, with the traceback lines after them."""

    in_error: bool = False  # the lines since the last record belong to an error

    def shown(self, line: str) -> bool:
        record = _RECORD.match(line)
        if record:
            self.in_error = record.group(1) in _ERROR_LEVELS
        elif line.startswith("Traceback (most recent call last)"):  # an exception no logger caught
            self.in_error = True
        return self.in_error


@dataclass(slots=True)
class _FollowedFile:
    offset: int  # bytes read so far
    partial: bytes = b""  # the start of a line not yet ended
    errors: LogErrorFilter = field(default_factory=LogErrorFilter)


@dataclass(slots=True)
class ServiceLogFollower:
    """Follows every `<service>.log` in `log_dir`, from its end as it was when made, like `tail -F`.

    poll() hands each new line, prefixed by its service's name as compose does, to `echo`: every
    line with `verbose`, else the error records and their tracebacks only. The files stay the
    whole record; a service never waits on the console.
    """

    log_dir: Path
    echo: Callable[[str], None]
    verbose: bool = False
    _files: dict[Path, _FollowedFile] = field(default_factory=dict)
    _stopped: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        for path in self.log_dir.glob("*.log"):  # what an earlier run wrote is not news
            self._files[path] = _FollowedFile(offset=path.stat().st_size)

    def poll(self) -> None:
        for path in sorted(self.log_dir.glob("*.log")):
            followed = self._files.setdefault(path, _FollowedFile(offset=0))
            try:
                with open(path, "rb") as f:
                    f.seek(followed.offset)
                    data = f.read()
            except OSError:
                continue
            followed.offset += len(data)
            *lines, followed.partial = (followed.partial + data).split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace").rstrip("\r")
                if followed.errors.shown(line) or self.verbose:
                    self.echo(f"{path.stem:<10} | {line}")

    def start(self, period_s: float = 0.2) -> ServiceLogFollower:
        """Polls from a daemon thread until stop()."""
        self._stopped.clear()
        self._thread = threading.Thread(target=self._loop, args=(period_s,), name="service-logs", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ends the polling thread, then polls a last time: what a service said as it stopped is shown too."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.poll()

    def _loop(self, period_s: float) -> None:
        while not self._stopped.wait(period_s):
            self.poll()
