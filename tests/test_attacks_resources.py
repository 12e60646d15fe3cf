"""Issue 31, item 6: a trial spends only bounded resources, through the real sandboxed loop.

Four attacks in one run (one baseline for all): a feed request for a huge batch (the
controller's memory), an out/ filled with files, a huge log, a fork storm. On the main of
2026-12-05 each ran to its end: the controller's peak RSS grew by ~0.8 GB for one
2^21-window batch, 20,000 files (1.3 GB) stayed in out/, a 100 MB train.log stayed on disk,
300 forked processes lived as long as the trial. Now each is `invalid` with its limit
named, its junk deleted, and the loop goes on.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from autoloop.loop.controller import Controller
from tests.conftest import make_repo
from tests.test_attacks import IMPORT_ANCHOR, TRAIN_PY, _patched, _run, _seed_attacks, _trials, needs_bwrap

# Each attack acts in training only (the evaluator imports train.py too, without AUTOLOOP_RESULT).
_IN_TRAINING = "import os as _os\nif _os.environ.get('AUTOLOOP_RESULT'):\n"

RESOURCE_ATTACKS = {
    # One batch of 2^21 windows: on main the feed drew it in the controller, a Python list per window.
    "huge feed batch": _patched(IMPORT_ANCHOR, IMPORT_ANCHOR + _IN_TRAINING + (
        "    from autoloop.harness.feed import feed_client as _fc\n"
        "    _fc().open_stream('train', 2**21, 30).next_windows()\n")),
    # 20,000 files of 64 KiB (1.3 GB) in out/, left behind.
    "fill out": _patched(IMPORT_ANCHOR, IMPORT_ANCHOR + _IN_TRAINING + (
        "    _out, _blob = _os.path.dirname(_os.environ['AUTOLOOP_RESULT']), b'x' * 65536\n"
        "    for _i in range(20000):\n"
        "        with open(_os.path.join(_out, f'junk{_i}.bin'), 'wb') as _f:\n"
        "            _f.write(_blob)\n")),
    # 100 MB of log lines.
    "huge log": _patched(IMPORT_ANCHOR, IMPORT_ANCHOR + _IN_TRAINING + (
        "    _line = 'spam ' * 200\n"
        "    for _i in range(100_000):\n"
        "        print(_line)\n")),
    # 300 processes that sleep through the trial.
    "fork storm": _patched(IMPORT_ANCHOR, IMPORT_ANCHOR + _IN_TRAINING + (
        "    import time as _t\n"
        "    for _i in range(300):\n"
        "        if _os.fork() == 0:\n"
        "            _t.sleep(120)\n"
        "            _os._exit(0)\n")),
}

# Limits a CPU test trips cheaply; the defaults (autoloop/config.py) never bind an honest GPU trial.
LIMITS = {"trial_disk_mb": 256, "trial_log_mb": 16, "trial_processes": 100}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


@pytest.mark.slow
@needs_bwrap
def test_resource_attacks_end_invalid_with_their_limit_and_leave_nothing(tmp_path, monkeypatch):
    from autoloop.config import Config
    from autoloop.harness.feed import DEFAULT_MEMORY_BUDGET

    repo = make_repo(tmp_path / "repo", TRAIN_PY.read_text())
    names = list(RESOURCE_ATTACKS)
    config = _run(repo, monkeypatch, max_steps=6, max_trials=1 + len(names), **LIMITS)
    assert isinstance(config, Config)
    _seed_attacks(repo, config, names, RESOURCE_ATTACKS)
    import torch  # noqa: F401  (the controller's own imports are not the feed's memory)

    rss_before = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from the current RSS
    summary = Controller(config, repo).run()
    grew_mb = (_status_kb("VmHWM") - rss_before) / 1024
    print(f"controller peak RSS grew by {grew_mb:.0f} MB during the run")
    assert summary.trials_run == 1 + len(names), summary.stop_reason
    trials = _trials(repo)
    for name, trial in trials.items():
        print(f"{name}: {trial['status']} ({trial['reason']})")
    assert trials["baseline"]["status"] == "keep", trials["baseline"]["reason"]

    def invalid(name: str, *words: str) -> dict:
        trial = trials[name]
        assert trial["status"] == "invalid", (name, trial["status"], trial["reason"])
        for word in words:
            assert word in trial["reason"], (name, trial["reason"])
        return trial

    invalid("huge feed batch", "data feed", f"{DEFAULT_MEMORY_BUDGET >> 20} MiB", "feed-memory-mb")
    assert grew_mb < DEFAULT_MEMORY_BUDGET / 2**20, grew_mb
    # 20,000 files of 64 KiB: whichever of its two limits the watch sees first (bytes or files).
    filled = invalid("fill out", "out/")
    assert "trial-disk-mb" in filled["reason"] or "trial-files" in filled["reason"], filled["reason"]
    invalid("huge log", "train.log", "16 MiB", "trial-log-mb")
    invalid("fork storm", "processes", "100", "trial-processes")

    runs = repo / ".autoloop" / "a" / "trials"
    for name in names:
        for run in (runs / str(trials[name]["number"]) / "runs").iterdir():
            assert not (run / "out").exists(), (name, sorted(p.name for p in (run / "out").iterdir())[:5])
            log = run / "train.log"
            assert log.stat().st_size < 1 << 20, (name, log.stat().st_size)
    log = next((runs / str(trials["huge log"]["number"]) / "runs").iterdir()) / "train.log"
    text = log.read_text()
    assert "spam spam" in text and "cut here" in text, text[-2000:]  # its tail kept for the user
    # The baseline's own output stays: it is the incumbent's checkpoint.
    assert any((run / "out" / "checkpoint.pt").is_file()
               for run in (runs / str(trials["baseline"]["number"]) / "runs").iterdir())
