"""Headless Chromium driven over the DevTools protocol (a websocket), for the live page's
browser tests and screenshots: no selenium, no playwright, no download. The browser is
Debian's `chromium` (.ci/run installs it); without it the tests that need it skip."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """One headless Chromium with one page; `evaluate` runs JavaScript in it."""

    def __init__(self, url: str, *, width: int = 1440, height: int = 1000, timeout: float = 90.0):
        from websockets.sync.client import connect

        binary = chromium()
        if binary is None:
            raise RuntimeError("no chromium on PATH")
        self.profile = tempfile.mkdtemp(prefix="autoloop-chromium-")
        args = [binary, "--headless=new", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
                "--disable-extensions", "--disable-background-networking", "--disable-dev-shm-usage",
                "--hide-scrollbars", "--mute-audio", f"--user-data-dir={self.profile}", "--remote-debugging-port=0",
                f"--window-size={width},{height}", "about:blank"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses its own sandbox as root (a CI container)
        # Its stderr goes to a file in the profile: the one line to show if it never starts.
        self._log = open(Path(self.profile) / "chromium.log", "wb")
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=self._log)
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline or self.process.poll() is not None:
                why = (f"it exited with code {self.process.returncode}" if self.process.poll() is not None
                       else f"none after {timeout:.0f} s")
                tail = (Path(self.profile) / "chromium.log").read_bytes()[-600:].decode(errors="replace").strip()
                self.close()
                raise RuntimeError(f"chromium did not start its DevTools endpoint ({why}): {tail}")
            time.sleep(0.05)
        port = int(port_file.read_text().splitlines()[0])
        targets = []
        while not targets:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as reply:
                targets = [t for t in json.load(reply) if t.get("type") == "page"]
            if not targets:
                time.sleep(0.05)
        # Entered as a context manager: what every websockets version accepts without a warning.
        self._connection = connect(targets[0]["webSocketDebuggerUrl"], max_size=64 * 1024 * 1024, open_timeout=timeout)
        self.ws = self._connection.__enter__()
        self._id = 0
        self.events: list[dict] = []  # every DevTools event seen (console messages, dialogs, ...)
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        self.navigate(url)

    def call(self, method: str, timeout: float = 30.0, **params):
        self._id += 1
        ident = self._id
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            message = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if "method" in message and len(self.events) < 10_000:
                self.events.append(message)
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails'].get('text')}")
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float = 10.0) -> float:
        """Seconds until `expression` is truthy in the page; raises after `timeout`."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            try:
                if self.evaluate(expression):
                    return time.monotonic() - start
            except RuntimeError:
                pass  # the page is still loading
            time.sleep(0.1)
        raise TimeoutError(f"{expression} was not true within {timeout} s")

    def screenshot(self, path: Path, *, full_page: bool = True) -> Path:
        params = {"format": "png", "captureBeyondViewport": full_page}
        if full_page:
            size = self.evaluate("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
            params["clip"] = {"x": 0, "y": 0, "width": size[0], "height": min(size[1], 6000), "scale": 1}
        data = self.call("Page.captureScreenshot", **params)["data"]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            if getattr(self, "ws", None) is not None:
                self._connection.__exit__(None, None, None)
        finally:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(10)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait(10)
            self._log.close()
            shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
