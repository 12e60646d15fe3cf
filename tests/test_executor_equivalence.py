"""One worker on the local or the Ray executor behaves exactly like the serial loop.

The real train.py (its CPU scale made smaller, as in tests/test_verify.py) in step mode,
the paired rule with its repeated runs, verification and the sandbox where it works: the
same seeded ideas run serially, on one local worker and on one Ray worker, and the trials,
decisions and measurements must be the same, apart from timings and the worker's name.
Step mode on a CPU is deterministic, so the numbers agree exactly.
"""

from __future__ import annotations


import pytest
from conftest import make_repo

from autoloop.config import resolve
from autoloop.loop.controller import Controller
from autoloop.proposers.seeding import seed_idea
from autoloop.store import Store

from test_verify import _contract_env, tiny_train_source

TAG = "eq"
TRIAL_FIELDS = ("number", "kind", "status", "description", "metric", "metric_source", "n_runs", "heldout_metric",
                "num_steps", "total_tokens", "diff", "reason")
MEASUREMENT_FIELDS = ("seed", "role", "status", "metric", "heldout_metric", "verified", "num_steps")


def _run(repo, executor: str) -> tuple[list, list]:
    flags = {"tag": TAG, "proposers": "ideas", "max_steps": 30, "time_budget": 60, "grace_seconds": 300,
             "baseline_seeds": 2, "max_runs": 3, "drift_every": 0, "check": False, "max_trials": 3,
             "executor": executor, "workers": 1 if executor != "serial" else 0}
    config = resolve(repo, flags)
    seed_idea(config, repo, "matrix lr x2", sets=["MATRIX_LR=0.08"], patch=None)
    seed_idea(config, repo, "matrix lr / 8", sets=["MATRIX_LR=0.005"], patch=None)
    Controller(config, repo).run()
    store = Store(repo / "experiments.db")
    try:
        rows = store.trials(store.get_run(TAG)["id"])
        trials = [{k: row.get(k) for k in TRIAL_FIELDS} | {"action": (row.get("decision") or {}).get("action")}
                  for row in rows]
        measurements = [[{k: m.get(k) for k in MEASUREMENT_FIELDS} | {"owner": row["number"]}
                         for m in store.measurements(row["id"])] for row in rows]
    finally:
        store.close()
    return trials, measurements


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["local", "ray"])
def test_one_worker_behaves_like_serial(executor, tmp_path, session_cache, monkeypatch, request):
    if executor == "ray":
        request.getfixturevalue("ray_cluster")
    _contract_env(monkeypatch, session_cache)
    source = tiny_train_source()
    serial = _run(make_repo(tmp_path / "serial", source), "serial")
    other = _run(make_repo(tmp_path / executor, source), executor)
    assert [t["status"] for t in serial[0]][0] == "keep"
    assert other[0] == serial[0]
    assert other[1] == serial[1]
