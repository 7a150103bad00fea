"""The layering rules of docs/development.md hold: the import-linter contracts in pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_import_contracts_are_kept() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    # --no-cache: the check takes about a second, and leaves nothing behind in the tree.
    result = subprocess.run([str(lint_imports), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
