"""Whether this install has the services (the serve extra), and a clear refusal where it does not.

`pip install shardline` is the SDK and the client commands; the commands that run a service, a
stack or the engine need `pip install 'shardline[serve]'`. They say so in one line, rather than
failing on the first missing import.
"""

from __future__ import annotations

import importlib.metadata
import re

EXTRA = "serve"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_EXTRA_MARKER = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


class ServeExtraMissing(Exception):
    """A command that runs the services, in an install without them."""


def missing_serve_requirements() -> list[str]:
    """The serve extra's packages that are not installed; empty where all are, or where Shardline
    runs from a checkout without package metadata."""
    try:
        requirements = importlib.metadata.requires("shardline") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    missing = []
    for requirement in requirements:
        spec, _, marker = requirement.partition(";")
        if EXTRA not in _EXTRA_MARKER.findall(marker):
            continue
        name = _NAME.match(spec.strip())
        if name is None:  # not a requirement line: nothing to look up
            continue
        try:
            importlib.metadata.version(name.group(0))
        except importlib.metadata.PackageNotFoundError:
            missing.append(name.group(0))
    return missing


def require_serve(command: str) -> None:
    """Raises ServeExtraMissing, naming the command and what to install, where the services are absent."""
    missing = missing_serve_requirements()
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ServeExtraMissing(
            f"shardline {command} runs Shardline's services, which this install does not have ({shown} "
            f"missing): pip install 'shardline[serve]'"
        )
