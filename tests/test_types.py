"""mypy finds nothing in the packages pyproject.toml's [tool.mypy] names, beyond the errors listed in
tests/mypy_baseline.txt, and every listed error is still there (a fixed one leaves the list)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASELINE = REPO / "tests" / "mypy_baseline.txt"
_ERROR = re.compile(r"^(?P<path>[^:]+):\d+: error: (?P<message>.*?)\s+\[(?P<code>[\w-]+)\]$")


def errors(output: str) -> list[str]:
    """mypy's errors as `path: [code] message`, without line numbers, which move with every edit."""
    found = []
    for line in output.splitlines():
        if match := _ERROR.match(line):
            found.append(f"{match['path']}: [{match['code']}] {match['message']}")
    return sorted(found)


def baseline() -> list[str]:
    lines = BASELINE.read_text().splitlines()
    return sorted(line for line in lines if line.strip() and not line.startswith("#"))


def test_mypy_finds_only_the_baselines_errors(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "--no-error-summary"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    found, known = errors(done.stdout), baseline()
    new = sorted(set(found) - set(known))
    fixed = sorted(set(known) - set(found))
    assert not new, "mypy errors not in tests/mypy_baseline.txt:\n" + "\n".join(new)
    assert not fixed, "fixed, so remove them from tests/mypy_baseline.txt:\n" + "\n".join(fixed)
    # Anything mypy said that is neither an error nor a note on one (a crash, a bad config) fails too.
    said = [line for line in done.stdout.splitlines() if ": note: " not in line]
    assert done.returncode in (0, 1) and len(found) == len(said), done.stdout + done.stderr
