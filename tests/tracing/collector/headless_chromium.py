"""A headless Chromium driven over the DevTools protocol, for tests of pages that render with JavaScript.

`--screenshot` and `--dump-dom` capture a page as soon as it has loaded, before
its scripts have fetched anything; driving the browser lets a test wait for
what the page should show, then capture it.
"""

import asyncio
import base64
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Self

import aiohttp

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking")


def find_chromium() -> str | None:
    """The Chromium binary on PATH, if any."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    return None


class HeadlessChromium:
    """One browser with one page. Use as an async context manager."""

    def __init__(self, binary: str, window: tuple[int, int] = (1500, 900), start_timeout_s: float = 30.0) -> None:
        self._binary = binary
        self._window = window
        self._start_timeout_s = start_timeout_s
        self._ids = itertools.count(1)
        # Chromium's helper processes may still be flushing the profile as it is removed: a leftover
        # temporary folder is harmless, a failed test is not.
        self._profile = tempfile.TemporaryDirectory(prefix="chromium-", ignore_cleanup_errors=True)
        self._proc: subprocess.Popen[bytes] | None = None
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None

    async def __aenter__(self) -> Self:
        width, height = self._window
        # Port 0: Chromium picks a free one and writes it to DevToolsActivePort in the profile.
        self._proc = subprocess.Popen(
            [
                self._binary,
                *FLAGS,
                "--remote-debugging-port=0",
                f"--user-data-dir={self._profile.name}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._http = aiohttp.ClientSession()
        port_file = Path(self._profile.name) / "DevToolsActivePort"
        deadline = time.monotonic() + self._start_timeout_s
        while not port_file.is_file() or not port_file.read_text().strip():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start (exit code {self._proc.poll()})")
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        async with self._http.get(f"http://127.0.0.1:{port}/json/list") as response:
            page = next(target for target in await response.json() if target["type"] == "page")
        self._ws = await self._http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._http is not None:
            await self._http.close()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            try:  # the whole group: the renderer and helper processes outlive the browser process
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait()
        self._profile.cleanup()

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Sends one DevTools command and returns its result; events in between are ignored."""
        assert self._ws is not None, "use HeadlessChromium as an async context manager"
        message_id = next(self._ids)
        await self._ws.send_json({"id": message_id, "method": method, "params": params})
        while True:
            message = await self._ws.receive_json()
            if message.get("id") == message_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    async def navigate(self, url: str) -> None:
        await self.call("Page.navigate", url=url)

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page."""
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 30.0) -> None:
        """Polls until ``expression`` is truthy in the page; raises TimeoutError otherwise."""
        deadline = time.monotonic() + timeout_s
        while not await self.evaluate(expression):
            if time.monotonic() > deadline:
                raise TimeoutError(f"still false after {timeout_s:.0f}s: {expression}")
            await asyncio.sleep(0.25)

    async def dom(self) -> str:
        """The page's current DOM as HTML."""
        return await self.evaluate("document.documentElement.outerHTML")

    async def screenshot(self, path: Path) -> None:
        """A PNG of the viewport."""
        result = await self.call("Page.captureScreenshot", format="png")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(result["data"]))
