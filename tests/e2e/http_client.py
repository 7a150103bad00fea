"""Minimal HTTP helpers for the e2e tests (standard library only, so they test the wire format)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator


def post(url: str, body: dict, headers: dict[str, str] | None = None, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def get(url: str, timeout: float = 30) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def sse(url: str, body: dict, timeout: float = 120) -> Iterator[dict | str]:
    """Yield each `data:` event of a streamed response, parsed (or the literal "[DONE]")."""
    req = urllib.request.Request(
        url, json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            yield data if data == "[DONE]" else json.loads(data)
