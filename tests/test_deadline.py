"""A step-mode run's deadline follows what the run's runs took (autoloop.measure.deadline)."""

from __future__ import annotations

import pytest

from autoloop.config import resolve
from autoloop.loop.controller import Controller
from autoloop.measure.deadline import CHECK_SLACK, RUN_SLACK, grace_for
from autoloop.proposers.seeding import seed_idea
from autoloop.store import Store
from tests.conftest import FAKE_TRAIN, make_repo


def test_time_mode_keeps_the_configured_grace():
    assert grace_for(time_budget=300, grace_seconds=180, max_steps=None, check_result=None, walls=[9999.0]) == 180


def test_step_mode_follows_the_slowest_run_so_far_then_the_checks_estimate():
    # After runs: RUN_SLACK x the slowest, as budget + grace.
    assert grace_for(time_budget=300, grace_seconds=180, max_steps=120, check_result=None,
                     walls=[100.0, 200.0]) == pytest.approx(RUN_SLACK * 200 - 300)
    # Before any: the pre-run check's estimate of a run.
    check = {"budget": {"status": "ok", "seconds_per_run": 150.0}}
    assert grace_for(time_budget=300, grace_seconds=180, max_steps=120, check_result=check,
                     walls=[]) == pytest.approx(CHECK_SLACK * 150 - 300)
    # Never below budget + grace; nothing known: the configured grace.
    assert grace_for(time_budget=300, grace_seconds=180, max_steps=120, check_result=None, walls=[10.0]) == 180
    assert grace_for(time_budget=300, grace_seconds=180, max_steps=120, check_result={"budget": {}}, walls=[]) == 180


def test_a_slow_step_mode_run_is_not_killed_at_the_time_budgets_deadline(tmp_path):
    """budget 1 s + grace 4 s: a 5 s deadline. The baseline (2.5 s) sets the pace; the
    candidate, three times slower (and past 5 s), is measured, not killed as `timeout`."""
    repo = make_repo(tmp_path / "repo", FAKE_TRAIN.read_text().replace("SLEEP = 0.0", "SLEEP = 2.5", 1))
    seed_idea(resolve(repo, {}), repo, "slower", sets=["SLEEP=7.0"], patch=None)
    flags = {"tag": "s", "time_budget": 1, "grace_seconds": 4, "max_steps": 10, "proposers": "ideas",
             "decision_rule": "strict", "drift_every": 0, "max_trials": 2}
    Controller(resolve(repo, flags), repo, verifier=None).run()
    with Store(repo / "experiments.db") as store:
        trials = store.trials(store.get_run("s")["id"])
    assert [t["status"] for t in trials] == ["keep", "discard"], [t["reason"] for t in trials]
