"""Arrival traces for the simulator: one request per row (timestamp, input_tokens, output_tokens), CSV or JSONL."""

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

COLUMNS = ("timestamp", "input_tokens", "output_tokens")


@dataclass(frozen=True, slots=True)
class Trace:
    """Requests in arrival order; times in seconds from the first arrival."""

    timestamps: np.ndarray  # float64, non-decreasing, the first is 0
    input_tokens: np.ndarray  # int64, prompt tokens of each request
    output_tokens: np.ndarray  # int64, tokens each request generates (at least 1)

    def __len__(self) -> int:
        return len(self.timestamps)

    @property
    def duration_s(self) -> float:
        return float(self.timestamps[-1]) if len(self) else 0.0

    @classmethod
    def of(cls, timestamps, input_tokens, output_tokens) -> "Trace":
        """A trace from three columns, sorted by time and shifted to start at 0; raises ValueError."""
        ts = np.asarray(timestamps, dtype=np.float64)
        inp = np.asarray(input_tokens, dtype=np.int64)
        out = np.asarray(output_tokens, dtype=np.int64)
        if not len(ts) == len(inp) == len(out):
            raise ValueError("a trace's columns differ in length")
        if len(ts) == 0:
            raise ValueError("the trace has no requests")
        if not np.all(np.isfinite(ts)):
            raise ValueError("a timestamp is not a finite number")
        if inp.min() < 0 or out.min() < 1:
            raise ValueError("input_tokens must be >= 0 and output_tokens >= 1")
        order = np.argsort(ts, kind="stable")
        return cls(ts[order] - ts[order[0]], inp[order], out[order])


def read_trace(path: Path) -> Trace:
    """Reads a .csv (a header naming the columns) or a .jsonl (one object a line); raises ValueError
    naming the file and line of a bad row, FileNotFoundError for a missing file."""
    if path.suffix.lower() == ".csv":
        rows = _csv_rows(path)
    elif path.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        rows = _jsonl_rows(path)
    else:
        raise ValueError(f"{path}: a trace is a .csv or a .jsonl file")
    if not rows:
        raise ValueError(f"{path}: the trace has no requests")
    ts, inp, out = zip(*rows)
    try:
        return Trace.of(ts, inp, out)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def write_trace(trace: Trace, path: Path) -> None:
    """Writes the trace as CSV or JSONL, by the file's suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = zip(trace.timestamps.tolist(), trace.input_tokens.tolist(), trace.output_tokens.tolist())
    with path.open("w", newline="") as f:
        if path.suffix.lower() == ".csv":
            f.write(",".join(COLUMNS) + "\n")
            f.writelines(f"{t:.3f},{i},{o}\n" for t, i, o in rows)
        else:
            f.writelines(
                json.dumps({"timestamp": round(t, 3), "input_tokens": i, "output_tokens": o}) + "\n" for t, i, o in rows
            )


def _row(path: Path, line: int, values: dict) -> tuple[float, int, int]:
    try:
        return float(values["timestamp"]), int(values["input_tokens"]), int(values["output_tokens"])
    except KeyError as exc:
        raise ValueError(f"{path}:{line}: no {exc.args[0]!r} (a row needs {', '.join(COLUMNS)})") from None
    except (TypeError, ValueError):
        raise ValueError(f"{path}:{line}: timestamp must be a number and the token counts integers") from None


def _csv_rows(path: Path) -> list[tuple[float, int, int]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: the CSV header lacks {', '.join(missing)}")
        return [_row(path, n, values) for n, values in enumerate(reader, start=2)]


def _jsonl_rows(path: Path) -> list[tuple[float, int, int]]:
    rows = []
    with path.open() as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                values = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON: {exc.msg}") from None
            if not isinstance(values, dict):
                raise ValueError(f"{path}:{n}: a line must be a JSON object")
            rows.append(_row(path, n, values))
    return rows
