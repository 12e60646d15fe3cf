"""`autoloop run` checks train.py before a new run's baseline (issue 14): a script that
cannot overfit one batch stops the run before the night is spent; a sound one leaves its
LR range test on the run for the proposers (the README's first command is that run:
tests/test_readme.py asserts it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autoloop.config import resolve
from autoloop.loop.controller import Controller
from autoloop.errors import AutoloopError
from autoloop.store import Store
from tests.conftest import make_repo
from tests.test_check import LOSS_LINE, SHIFTED, TRAIN_PY


def _config(repo: Path, monkeypatch):
    monkeypatch.setenv("AUTOLOOP_CHECK", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return resolve(repo, {"tag": "c", "max_steps": 4, "max_trials": 1, "proposers": "ideas",
                          "decision_rule": "strict", "baseline_seeds": 1, "drift_every": 0})


@pytest.mark.slow
def test_a_script_that_cannot_overfit_one_batch_stops_the_run_before_the_baseline(tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo", TRAIN_PY.read_text().replace(LOSS_LINE, SHIFTED))
    with pytest.raises(AutoloopError, match="cannot overfit a single batch"):
        Controller(_config(repo, monkeypatch), repo).run()
    store = Store(repo / "experiments.db")
    try:
        run = store.get_run("c")
        assert store.trials(run["id"]) == []  # no baseline was spent
        assert store.events(run["id"], kind="check_failed")
    finally:
        store.close()


def _check_processes(repo: Path) -> list[int]:
    """Pids of `autoloop check` processes running on `repo` (the pre-night check's)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"check" in argv and b"--parts" in argv and str(repo).encode() in argv:
            pids.append(int(entry.name))
    return pids


@pytest.mark.slow
def test_one_ctrl_c_stops_the_pre_night_check_at_once(tmp_path):
    """Ctrl-C while `autoloop check` runs before the baseline: the check's process group
    is ended and the run stops the usual way (exit 0, no trial), not after the check."""
    import os
    import signal
    import subprocess
    import time

    # train.py hangs when the check imports it (training runs it as __main__ and would not).
    slow = "import time as _time\nif __name__ != '__main__':\n    _time.sleep(600)\n" + TRAIN_PY.read_text()
    repo = make_repo(tmp_path / "repo", slow)
    env = {**os.environ, "AUTOLOOP_CHECK": "1"}
    controller = subprocess.Popen(["autoloop", "run", "--tag", "c", "--max-steps", "4", "--proposers", "ideas"],
                                  cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _check_processes(repo):
            assert controller.poll() is None, controller.communicate()[0]
            assert time.monotonic() < deadline, "the pre-night check never started"
            time.sleep(0.2)
        checks = _check_processes(repo)
        time.sleep(1.0)  # let it reach the import of train.py
        sent = time.monotonic()
        controller.send_signal(signal.SIGINT)
        output, _ = controller.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        if controller.poll() is None:
            controller.kill()
        leftover = _check_processes(repo)
        for pid in leftover:  # never leave a check behind, whatever went wrong
            os.kill(pid, signal.SIGKILL)
    assert controller.returncode == 0, output
    assert not leftover, "the check outlived the run"
    assert took < 10, f"the controller took {took:.1f} s to stop after one Ctrl-C"
    assert not any(Path(f"/proc/{pid}").exists() for pid in checks), "the check outlived the run"
    store = Store(repo / "experiments.db")
    try:
        run = store.get_run("c")
        assert run["status"] == "stopped" and run["check_result"] is None
        assert store.trials(run["id"]) == []  # no baseline was spent
    finally:
        store.close()
