"""End to end on the CPU with the real train.py in step mode: the loop as a user runs it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from autoloop.config import resolve
from autoloop.loop.controller import Controller
from autoloop.gitops import GitRepo
from autoloop.proposers.seeding import seed_idea
from autoloop.store import Store

from conftest import make_repo
from test_controller import assert_consistent

TRAIN_PY = Path(__file__).resolve().parents[1] / "train.py"


@pytest.mark.slow
def test_real_train_py_baseline_plus_three_seeded_ideas(tmp_path):
    repo = make_repo(tmp_path / "repo", TRAIN_PY.read_text())
    config = resolve(repo, {"tag": "e2e", "max_steps": 8, "time_budget": 60, "grace_seconds": 240,
                            "proposers": "ideas"})
    for text, sets in (
        ("much lower matrix LR", ["MATRIX_LR=0.004"]),
        ("higher matrix LR", ["MATRIX_LR=0.06"]),
        ("absurd embedding LR", ["EMBEDDING_LR=600.0"]),
    ):
        seed_idea(config, repo, text, sets=sets, patch=None)
    summary = Controller(config, repo).run()
    rows = assert_consistent(repo, "e2e")
    assert len(rows) == 4 and summary.trials_run == 4
    assert rows[0]["kind"] == "baseline" and rows[0]["status"] == "keep"
    assert rows[0]["metric_source"] == "verified" and rows[0]["heldout_metric"] is not None
    assert rows[0]["n_runs"] == 3 and rows[0]["metric_sd"] is not None  # the baseline at three seeds
    assert all(r["status"] in ("keep", "discard", "crash") for r in rows)
    assert rows[0]["num_steps"] == 8 and rows[0]["total_tokens"] > 0 and rows[0]["num_params"] > 0
    gitrepo = GitRepo.open(repo)
    archived = gitrepo.archived("e2e")
    for row in rows[1:]:
        # Every trial's diff is recoverable, from the row and from git, kept or not.
        assert row["diff"] and row["diff"] == gitrepo.diff(row["parent_commit"], row["trial_commit"])
        if row["status"] != "keep":
            assert archived[row["number"]] == row["trial_commit"]
            assert not list((repo / ".autoloop" / "e2e" / "trials" / str(row["number"])).rglob("checkpoint.pt"))
    kept = [r for r in rows if r["status"] == "keep"]
    assert len(list((repo / ".autoloop" / "e2e" / "trials" / str(kept[-1]["number"])).rglob("checkpoint.pt"))) == 1
    store = Store(repo / "experiments.db")
    run = store.get_run("e2e")
    assert run["data_fingerprint"] and run["harness_fingerprint"] and run["torch_version"]
    assert store.curve(rows[0]["id"])
    store.close()
    assert subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                          capture_output=True, text=True).stdout == ""
