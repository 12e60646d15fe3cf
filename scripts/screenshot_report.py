#!/usr/bin/env python3
"""Render an autoloop HTML report to a PNG with headless Chromium, to check how it looks.

    autoloop report --out /tmp/report
    python scripts/screenshot_report.py /tmp/report/report.html /tmp/report/screenshot.png

Needs Debian's `chromium` (apt-get install -y chromium) or Chrome on PATH. The flags keep
Chromium offline and stateless: a throwaway profile, no sandbox (it runs as root in
containers), no GPU, no background networking, sync or component updates. The report is
self-contained, so nothing is fetched. Exit status: 0 with a PNG written, 2 when no
Chromium is installed, 1 when it failed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


def screenshot(html: Path, png: Path, *, width: int = 1280, height: int = 2000, timeout: float = 120) -> Path:
    """Render `html` to `png`; raises RuntimeError with Chromium's output if it fails."""
    browser = find_chromium()
    if browser is None:
        raise FileNotFoundError("no chromium on PATH: apt-get install -y chromium")
    html, png = Path(html).resolve(), Path(png).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    if png.exists():
        png.unlink()
    with tempfile.TemporaryDirectory(prefix="autoloop-chromium-") as profile:
        argv = [
            browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--hide-scrollbars", f"--user-data-dir={profile}", f"--screenshot={png}",
            f"--window-size={width},{height}", html.as_uri(),
        ]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if not png.exists() or png.stat().st_size == 0:
        raise RuntimeError(f"chromium wrote no screenshot (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return png


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3) or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 1
    html = Path(argv[0])
    png = Path(argv[1])
    height = int(argv[2]) if len(argv) == 3 else 2000
    try:
        screenshot(html, png, height=height)
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 2
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"screenshot failed: {exc}", file=sys.stderr)
        return 1
    print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
