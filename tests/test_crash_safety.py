"""Crash safety: kill the controller (SIGKILL) at each critical window, restart, check.

The controller is a real `autoloop run` subprocess, killed as an OOM kill or a closed
laptop lid would; its training child runs in its own process group and is made to die
with its parent, and the restart must still find and clean up whatever the dead
controller left.
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import time

import pytest

from autoloop.base.faults import POINTS
from autoloop.base.processes import process_group_alive
from autoloop.store import Store

from test_controller import assert_consistent, run_loop, seed


# The loop's mechanics (git, db, processes, recovery), one training run per trial.
pytestmark = pytest.mark.usefixtures("one_run_per_trial")



def autoloop_run(repo, *args, fault: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ}
    if fault:
        env["AUTOLOOP_FAULT"] = fault
    return subprocess.run(
        # --no-sandbox: bubblewrap's training process dies with its controller by itself; these
        # tests are about the recovery of one that did not (an unsandboxed run).
        ["autoloop", "run", "--tag", "t", "--time-budget", "60", "--grace-seconds", "30", "--no-verify", "--no-sandbox",
         "--proposers", "ideas", *args],
        cwd=repo, env=env, capture_output=True, text=True, timeout=timeout,
    )


def rows_of(repo):
    store = Store(repo / "experiments.db")
    try:
        return store.trials(store.get_run("t")["id"])
    finally:
        store.close()


def integrity_ok(repo):
    conn = sqlite3.connect(repo / "experiments.db")
    try:
        return conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()


@pytest.mark.parametrize("point", [p for p in POINTS if p != "between_measurements"])
def test_controller_killed_at_each_fault_point_recovers(fake_repo, point):
    # between_measurements needs several runs per trial: tests/test_decision_loop.py kills it there.
    # Only the orphan test needs a training child that would outlive its controller for long.
    seed(fake_repo, "better idea", "LR=0.01", "SLEEP=20" if point == "during_training" else "SLEEP=0.2")
    # The baseline passes every point but after_commit once; die in the proposal's trial.
    died = autoloop_run(fake_repo, fault=point if point == "after_commit" else f"{point}:2")
    assert died.returncode == -signal.SIGKILL, died.stdout + died.stderr

    before = rows_of(fake_repo)
    assert [r["number"] for r in before] == [1, 2]
    orphan = before[1]["pgid"]
    if point == "during_training":
        # The training child dies with its controller (autoloop.measure.logpipe.die_with_parent):
        # nothing of a killed controller trains on unwatched.
        assert orphan
        deadline = time.monotonic() + 30
        while process_group_alive(orphan) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not process_group_alive(orphan), "the training child outlived its controller"

    started = time.monotonic()
    restarted = autoloop_run(fake_repo, "--max-trials", "0")
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr
    if orphan:
        assert not process_group_alive(orphan)
        assert time.monotonic() - started < 15

    rows = assert_consistent(fake_repo)
    assert integrity_ok(fake_repo)
    assert [r["number"] for r in rows] == [1, 2], "no trial lost or counted twice"
    second = rows[1]
    if point == "during_reset":
        # The decision was recorded before the controller died: it stands, and git was
        # made to agree (the kept commit is the branch tip).
        assert second["status"] == "keep"
    else:
        assert second["status"] == "interrupted"
        store = Store(fake_repo / "experiments.db")
        assert store.ideas()[0]["status"] == "pending"  # the idea goes back to the queue
        store.close()
    if point in ("after_commit", "during_training", "after_training"):
        assert second["trial_commit"]  # its edits are not lost: archived
    # The loop carries on normally afterwards.
    seed(fake_repo, "quick next", "LR=0.012", priority=5)
    finished = autoloop_run(fake_repo, "--max-trials", "1")
    assert finished.returncode == 0, finished.stdout + finished.stderr
    rows = assert_consistent(fake_repo)
    assert [r["number"] for r in rows] == [1, 2, 3] and rows[2]["description"] == "quick next"


@pytest.mark.slow
def test_soak_random_kills(fake_repo):
    """Kill the controller at random moments at least 20 times; nothing may break."""
    rng = random.Random(1234)
    for i in range(40):
        seed(fake_repo, f"lr {i}", f"LR={0.005 + i * 0.0005:.4f}", "SLEEP=0.3")
    kills = 0
    env = {**os.environ}
    while kills < 20:
        proc = subprocess.Popen(
            ["autoloop", "run", "--tag", "t", "--time-budget", "60", "--grace-seconds", "30", "--no-verify", "--proposers", "ideas"],
            cwd=fake_repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        time.sleep(rng.uniform(1.5, 4.0))  # start-up (torch import) takes ~2 s
        if proc.poll() is not None:
            _, err = proc.communicate()
            assert proc.returncode == 0, err
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
    assert kills >= 20
    final = autoloop_run(fake_repo, timeout=600)
    assert final.returncode == 0, final.stdout + final.stderr
    rows = assert_consistent(fake_repo)
    assert integrity_ok(fake_repo)
    for row in rows:
        if row["pgid"]:
            assert not process_group_alive(row["pgid"])
    store = Store(fake_repo / "experiments.db")
    ideas = store.ideas()
    store.close()
    assert all(i["status"] == "done" for i in ideas), "every idea evaluated exactly once to completion"
    done_trials = [r for r in rows if r["status"] != "interrupted" and r["kind"] == "proposal"]
    # ...or ended by the crash-loop guard, when the controller died in two of its trials.
    twice = {r["idea_id"] for r in rows if r["status"] == "interrupted" and "stopped twice" in (r["reason"] or "")}
    assert len(done_trials) + len(twice) == len(ideas) == len({r["idea_id"] for r in done_trials} | twice)



def test_an_idea_whose_trials_kill_the_controller_twice_is_not_tried_a_third_time(fake_repo):
    """The crash-loop guard (autoloop.loop.recovery): the first death gives the idea back to
    the queue as before; when its next trial dies too, the idea is done, and the night goes on."""
    seed(fake_repo, "kills the controller", "LR=0.01")
    seed(fake_repo, "next idea", "LR=0.012", priority=-1)
    # The baseline trains once; the idea's trial dies as its training starts.
    died = autoloop_run(fake_repo, fault="during_training:2")
    assert died.returncode == -signal.SIGKILL, died.stdout + died.stderr
    # Recovered: the idea is back in the queue, and its new trial dies the same way.
    died = autoloop_run(fake_repo, fault="during_training:1")
    assert died.returncode == -signal.SIGKILL, died.stdout + died.stderr
    run_loop(fake_repo, max_trials=1)
    rows = assert_consistent(fake_repo)
    assert [r["description"] for r in rows[1:]] == ["kills the controller", "kills the controller", "next idea"]
    assert [r["status"] for r in rows[1:3]] == ["interrupted", "interrupted"]
    assert "stopped twice" in rows[2]["reason"] and "stopped twice" not in rows[1]["reason"]
    assert rows[3]["status"] in ("keep", "discard")
    with Store(fake_repo / "experiments.db") as store:
        first = next(i for i in store.ideas() if i["text"] == "kills the controller")
        assert first["status"] == "done" and first["trial_id"] == rows[2]["id"]


# ---------------------------------------------------------------------- a full disk


def fake_git_on_path(tmp_path, monkeypatch, repo):
    """`git` on PATH that fails `git reset` as git does on a full disk once a trial has left
    a DISK_FULL file in its folder (fake_train.py's enospc mode); real git otherwise."""
    import shutil

    real = shutil.which("git")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "git"
    script.write_text(
        "#!/bin/sh\n"
        f"if [ \"$1\" = reset ] && ls {repo}/.autoloop/*/trials/*/DISK_FULL >/dev/null 2>&1; then\n"
        f"  echo \"fatal: Unable to create '$({real} rev-parse --absolute-git-dir)/index.lock': No space left on device\" >&2\n"
        "  exit 128\n"
        "fi\n"
        f"exec {real} \"$@\"\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def assert_paused_for_a_full_disk(repo, summary):
    assert summary.paused, summary.stop_reason
    assert "disk is full" in summary.stop_reason and "index.lock" not in summary.stop_reason, summary.stop_reason
    store = Store(repo / "experiments.db")
    try:
        run = store.get_run("t")
        assert run["status"] == "paused" and "disk is full" in run["pause_reason"]
        assert store.running_trials(run["id"]) == []  # consistent now, not after a restart
        return store.trials(run["id"])
    finally:
        store.close()


def test_a_training_run_that_fills_the_disk_pauses_the_run_as_a_full_disk(fake_repo):
    seed(fake_repo, "bigger checkpoints", "LR=0.01", "MODE='enospc'")
    seed(fake_repo, "next idea", "LR=0.012", priority=-1)
    rows = assert_paused_for_a_full_disk(fake_repo, run_loop(fake_repo))
    assert [r["status"] for r in rows] == ["keep", "interrupted"]  # nothing ran after the pause
    assert "No space left on device" in rows[1]["reason"] and "disk is full" in rows[1]["reason"]
    assert_consistent(fake_repo)
    with Store(fake_repo / "experiments.db") as store:
        assert store.ideas()[0]["status"] == "pending"  # not the idea's fault: it runs again after the pause


def test_git_failing_on_a_full_disk_is_not_reported_as_a_lock(fake_repo, tmp_path, monkeypatch):
    fake_git_on_path(tmp_path, monkeypatch, fake_repo)
    seed(fake_repo, "bigger checkpoints", "LR=0.01", "MODE='enospc'")
    rows = assert_paused_for_a_full_disk(fake_repo, run_loop(fake_repo))
    assert rows[1]["status"] == "interrupted" and "disk is full" in rows[1]["reason"]
    # Space freed: the next start converges git and the run goes on.
    for marker in (fake_repo / ".autoloop").glob("*/trials/*/DISK_FULL"):
        marker.unlink()
    summary = run_loop(fake_repo, max_trials=0)
    assert not summary.paused
    assert_consistent(fake_repo)


@pytest.mark.parametrize("point", [p for p in POINTS if p != "between_measurements"])
def test_no_space_left_at_any_point_of_a_trial_pauses_with_a_consistent_db(fake_repo, monkeypatch, point):
    from autoloop.base import faults

    monkeypatch.setattr(faults, "_hits", {})
    # The baseline passes every point but after_commit once: fail in the proposal's trial.
    monkeypatch.setenv("AUTOLOOP_FAULT", f"enospc@{point}" + ("" if point == "after_commit" else ":2"))
    seed(fake_repo, "better idea", "LR=0.01")
    rows = assert_paused_for_a_full_disk(fake_repo, run_loop(fake_repo))
    assert [r["number"] for r in rows] == [1, 2]
    assert rows[1]["status"] == ("keep" if point == "during_reset" else "interrupted")
    monkeypatch.delenv("AUTOLOOP_FAULT")
    run_loop(fake_repo, max_trials=0)
    assert_consistent(fake_repo)
