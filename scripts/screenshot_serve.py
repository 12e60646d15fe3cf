#!/usr/bin/env python3
"""Make the live page's picture (docs/serve.png) from a demo night, with headless Chromium.

    python scripts/screenshot_serve.py docs/serve.png

The night is the one the live page's tests write (tests/serve_support.py's NightWriter,
through the real Store): a baseline, 60 trials of the two-tier rule (adopted and confirmed
keeps, discards, a few crashes and invalid proposals), and two trials running on two
workers. `autoloop serve` serves it on a free port and Chromium (tests/browser_support.py,
over the DevTools protocol) takes the run page at 1440 x 1010. Needs the `serve` extra, the
`websockets` package and Debian's `chromium`; nothing is downloaded. Exit status 0 with the
PNG written, 2 when no Chromium is installed.
"""

from __future__ import annotations

import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from browser_support import Browser, chromium  # noqa: E402
from conftest import FAKE_TRAIN, make_repo  # noqa: E402  (the tests' own git repo and fake train.py)
from serve_support import NightWriter, Server  # noqa: E402


def _iso(moment: datetime) -> str:
    return moment.isoformat(timespec="milliseconds")


def demo_night(folder: Path) -> Path:
    """A git repo with an experiments.db holding the demo night (module docstring)."""
    repo = make_repo(folder / "repo", FAKE_TRAIN.read_text())
    night = NightWriter(repo, "nov29", time_budget=300.0)
    night.night(60, keep_every=8)
    # Every other keep confirmed, as a night of the two-tier rule ends: the confirmed ones are marked ✓.
    for k, row in enumerate(r for r in night.store.trials(night.run["id"]) if r["tier"] == "adopted"):
        if k % 2:
            night.store.update_trial(row["id"], tier="confirmed")
    running = [night.start("raise MATRIX_LR to 0.045", worker="gpu0", steps=120),
               night.start("deeper model: DEPTH 8 -> 10", worker="gpu1", steps=60)]
    # The writer's trials all happened just now: spread them over the night's hours (a
    # 5-minute budget and its evaluation, two workers), so its rates read as a night's.
    now = datetime.now(timezone.utc)
    rows = night.store.trials(night.run["id"])
    for row in rows:
        if row["status"] == "running":
            started = now - timedelta(minutes=3 + 0.7 * (row["worker"] == "gpu1"))
            night.store.update_trial(row["id"], created_at=_iso(started), started_at=_iso(started))
            continue
        started = now - timedelta(minutes=3.6 * (len(rows) - row["number"]) + 7)
        night.store.update_trial(row["id"], created_at=_iso(started), started_at=_iso(started),
                                 finished_at=_iso(started + timedelta(minutes=6.5)))
    assert len(running) == 2
    night.close()
    return repo


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 1
    if chromium() is None:
        print("no chromium on PATH: apt-get install -y chromium", file=sys.stderr)
        return 2
    png = Path(argv[0]).resolve()
    with tempfile.TemporaryDirectory(prefix="autoloop-demo-") as tmp:
        repo = demo_night(Path(tmp))
        with Server(repo) as server, Browser(server.link, width=1440, height=1010) as browser:
            browser.wait_for("document.querySelector('#live .card') !== null && "
                             "document.querySelector('#stats .stat') !== null && "
                             "document.querySelector('#trials-table tr[data-trial]') !== null", 30)
            time.sleep(1.0)  # the charts draw after their data
            browser.screenshot(png, full_page=False)
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
