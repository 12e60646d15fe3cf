"""`autoloop run` checks train.py before a new run's baseline (issue 14): a script that
cannot overfit one batch stops the run before the night is spent; a sound one leaves its
LR range test on the run for the proposers."""

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
                          "decision_rule": "strict", "drift_every": 0})


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


@pytest.mark.slow
def test_a_sound_script_passes_and_its_lr_range_test_is_on_the_run(tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo", TRAIN_PY.read_text())
    summary = Controller(_config(repo, monkeypatch), repo).run()
    assert summary.trials_run == 1
    store = Store(repo / "experiments.db")
    try:
        run = store.get_run("c")
    finally:
        store.close()
    result = run["check_result"]
    assert result["ok"] and result["overfit"]["status"] == "ok"
    assert result["lr"]["status"] in ("ok", "warn") and (repo / ".autoloop" / "check" / "lr_range.png").exists()
