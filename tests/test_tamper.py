"""StoreSeal: a training process that writes to experiments.db changes nothing that decides.

Real Store files in tmp_path; the "training process" is a second sqlite3 connection, as
a trial's code would open one.
"""

from __future__ import annotations

import sqlite3

from autoloop.store import Kind, Status, Store
from autoloop.trust.seal import StoreSeal


def _run_with_a_kept_baseline(tmp_path):
    store = Store(tmp_path / "experiments.db")
    run = store.create_run("t", branch="autoloop/t", best_commit="a" * 40)
    base = store.new_trial(run["id"], Kind.BASELINE, metric=2.65, metric_source="verified", heldout_metric=2.7,
                           trial_commit="a" * 40)
    store.update_trial(base["id"], status=Status.KEEP)
    store.add_measurement(base["id"], 2.65, seed=1, role="candidate", status="ok")
    running = store.new_trial(run["id"], Kind.PROPOSAL, trial_commit="b" * 40)  # the one training now
    return store, run, base, running


def _other_process(path, *statements):
    conn = sqlite3.connect(path, timeout=30)
    for statement in statements:
        conn.execute(statement)
    conn.commit()
    conn.close()


def test_untouched_store_passes_and_the_running_trial_may_change(tmp_path):
    store, run, _base, running = _run_with_a_kept_baseline(tmp_path)
    seal = StoreSeal.capture(store, run["id"])
    store.update_trial(running["id"], pid=123, heartbeat_at="now")  # the controller's own bookkeeping
    assert seal.check(store) is None
    store.close()


def test_metric_update_from_another_connection_is_named_and_restored(tmp_path):
    store, run, base, _running = _run_with_a_kept_baseline(tmp_path)
    seal = StoreSeal.capture(store, run["id"])
    _other_process(store.path, "UPDATE trials SET metric = 99.0 WHERE number = 1")
    problem = seal.check(store)
    assert problem == "trial 1 metric 2.65 -> 99.0"
    seal.restore(store)
    assert store.trial_by_id(base["id"])["metric"] == 2.65
    assert seal.check(store) is None
    store.close()


def test_best_commit_measurements_and_inserted_trials_are_caught(tmp_path):
    store, run, base, _running = _run_with_a_kept_baseline(tmp_path)
    seal = StoreSeal.capture(store, run["id"])
    _other_process(
        store.path,
        "UPDATE runs SET best_commit = 'c' WHERE id = 1",
        "UPDATE measurements SET metric = 1.0",
        f"INSERT INTO measurements (trial_id, seed, metric, created_at) VALUES ({base['id']}, 2, 1.0, 'x')",
        "INSERT INTO trials (run_id, number, kind, status, metric, created_at) VALUES (1, 9, 'proposal', 'keep', 0.5, 'x')",
        f"UPDATE trials SET status = 'discard' WHERE id = {base['id']}",
    )
    problem = seal.check(store)
    assert f"run best_commit {'a' * 40} -> c" in problem
    assert "trial 1 status keep -> discard" in problem
    assert "trial 9 added as keep" in problem
    assert "measurement 1 (trial 1) metric 2.65 -> 1.0" in problem
    assert "measurement 2 (trial 1) added" in problem
    seal.restore(store)
    assert seal.check(store) is None  # trial 9 is still there, but it decides nothing now
    assert store.get_run("t")["best_commit"] == "a" * 40
    assert [m["metric"] for m in store.measurements(base["id"])] == [2.65]
    assert store.get_trial(run["id"], 9)["status"] == "invalid"
    store.close()


def test_deleted_rows_come_back(tmp_path):
    store, run, base, _running = _run_with_a_kept_baseline(tmp_path)
    seal = StoreSeal.capture(store, run["id"])
    _other_process(store.path, "DELETE FROM measurements", f"DELETE FROM trials WHERE id = {base['id']}")
    problem = seal.check(store)
    assert "trial 1 deleted" in problem and "measurement 1 (trial 1) deleted" in problem
    seal.restore(store)
    assert seal.check(store) is None
    assert store.trial_by_id(base["id"])["metric"] == 2.65 and len(store.measurements(base["id"])) == 1
    store.close()
