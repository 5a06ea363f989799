"""A real headless Chromium driven over the DevTools protocol (aiohttp's websocket client: no
extra test dependency). `make test` installs Debian's `chromium` where it is missing."""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

START_TIMEOUT_S = 30.0


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """`async with Browser() as browser: page = await browser.page()`."""

    def __init__(self, executable: str, nice: int = 0) -> None:
        """`nice`: the browser's CPU priority below this process's (benchmarks)."""
        self.executable, self.nice = executable, nice
        # NOTE: a helper process may still write there as the profile is removed
        self.profile = tempfile.TemporaryDirectory(prefix="minisgl-chromium-",
                                                   ignore_cleanup_errors=True)
        self.proc: subprocess.Popen | None = None
        self.session: aiohttp.ClientSession | None = None
        self.port = 0

    async def __aenter__(self) -> Browser:
        # NOTE: --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
        self.proc = subprocess.Popen(
            [self.executable, "--headless=new", "--no-sandbox", "--disable-gpu",
             "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
             "--remote-debugging-port=0", f"--user-data-dir={self.profile.name}",
             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,  # its helper processes share a group: stopped together
            preexec_fn=(lambda: os.nice(self.nice)) if self.nice else None)
        active = Path(self.profile.name) / "DevToolsActivePort"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (active.exists() and active.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start (exit code {self.proc.poll()})")
            await asyncio.sleep(0.1)
        self.port = int(active.read_text().split()[0])
        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.session is not None:
            await self.session.close()
        if self.proc is not None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            self._signal_group(signal.SIGKILL)  # the helpers the browser left, if any
            self.proc.wait()
        self.profile.cleanup()

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    async def page(self) -> Page:
        async with self.session.put(f"http://127.0.0.1:{self.port}/json/new?about:blank") as r:
            target = await r.json()
        page = Page(await self.session.ws_connect(target["webSocketDebuggerUrl"],
                                                  max_msg_size=0))
        for domain in ("Page", "Runtime", "Log"):
            await page.send(f"{domain}.enable")
        return page


class Page:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws, self.next_id = ws, 0
        self.events: list[dict[str, Any]] = []

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        while True:
            message = await self.ws.receive_json()
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression,
                                 returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            await asyncio.sleep(0.25)

    async def set_viewport(self, width: int, height: int, mobile: bool = False) -> None:
        await self.send("Emulation.setDeviceMetricsOverride", width=width, height=height,
                        deviceScaleFactor=2 if mobile else 1, mobile=mobile)

    async def screenshot(self, path: Path) -> None:
        result = await self.send("Page.captureScreenshot", format="png",
                                 captureBeyondViewport=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(result["data"]))

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and error log entries seen so far."""
        found = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(str(params["exceptionDetails"]))
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error",
                                                                                "assert"):
                found.append(str(params.get("args")))
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                found.append(str(params["entry"]))
        return found
