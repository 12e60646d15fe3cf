"""Attacks on the controller's processes, through the real loop (split from
tests/test_attacks.py, whose helpers they use, so that two CI workers share the attack
tests): a trial that points a worker at someone else's process group, two honest workers
in flight, a training that kills its own worker, and --no-verify's data under the sandbox."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from autoloop.loop.controller import Controller
from autoloop.proposers.seeding import seed_idea
from autoloop.store import Store
from tests.conftest import make_repo
from tests.test_attacks import (
    _EVAL_OUT, FINISH_ANCHOR, IMPORT_ANCHOR, TRAIN_PY, _kept, _patched, _run, _seed_attacks, _trials, needs_bwrap,
)

def _victim() -> tuple[subprocess.Popen, int | None]:
    """An unrelated process group of the user's (a `sleep` in a session of its own)."""
    from autoloop.base.processes import process_start_time

    victim = subprocess.Popen(["sleep", "600"], start_new_session=True)
    return victim, process_start_time(victim.pid)


@pytest.mark.slow
@needs_bwrap
def test_a_trial_cannot_make_a_worker_kill_someone_else(attacked_repo, monkeypatch):
    """Issue 23, item 6: a worker's control files sit where training cannot write; process
    ids come from the worker's own channel; nothing is killed without a matching start time."""
    victim, start = _victim()
    try:
        pids = f"{{'pid': {victim.pid}, 'pgid': {victim.pid}, 'start_time': {start}}}"
        attack = _patched(IMPORT_ANCHOR, IMPORT_ANCHOR + _EVAL_OUT + (
            "if _training():\n"
            "    import json as _json, time as _time\n"
            "    _run = _os.path.dirname(_os.environ['AUTOLOOP_RESULT'])\n"
            "    for _ in range(3):\n"
            "        for _d in (_run, _os.path.dirname(_run)):\n"
            "            try:\n"
            f"                open(_os.path.join(_d, 'pids.json'), 'w').write(_json.dumps({pids}))\n"
            "            except OSError:\n"
            "                pass\n"
            "        _time.sleep(0.5)\n"),
            _patched(FINISH_ANCHOR, "    result['num_steps'] = float('nan')\n" + FINISH_ANCHOR))
        repo = attacked_repo  # the shared sandboxed baseline's run, ours to run on (the attack on a worker)
        config = _run(repo, monkeypatch, max_steps=6, max_trials=1, workers=1, executor="local")
        _seed_attacks(repo, config, ["victim pids"], {"victim pids": attack})
        Controller(config, repo).run()
        trials = _trials(repo)
        assert trials["baseline"]["status"] == "keep", trials["baseline"]["reason"]
        assert not _kept(trials["victim pids"])
        time.sleep(0.5)
        assert victim.poll() is None, "the controller killed a process group that was not the trial's"
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.slow
def test_two_workers_with_honest_trials_unsandboxed_lose_nothing(tmp_path, monkeypatch):
    """Issue 23, item 6: with two trials in flight, one thread's legitimate writes are neither
    blamed on the other's training nor undone by its seal."""
    repo = make_repo(tmp_path / "repo", TRAIN_PY.read_text())
    values = ["0.03", "0.05", "0.035", "0.045"]
    config = _run(repo, monkeypatch, max_steps=6, max_trials=1 + len(values), workers=2, executor="local",
                  sandbox="off")
    for value in values:  # constants set on whatever the best is then, so every one applies
        seed_idea(config, repo, f"attack: lr {value}", sets=[f"MATRIX_LR={value}"], patch=None)
    honest = values
    Controller(config, repo).run()
    store = Store(repo / "experiments.db")
    try:
        run = store.get_run("a")
        rows = store.trials(run["id"])
        failed = [(t["number"], t["status"], t["reason"]) for t in rows if t["status"] not in ("keep", "discard")]
        assert not failed, failed
        for trial in rows:
            ok = [m for m in store.measurements(trial["id"]) if m["status"] == "ok" and m["metric"] is not None]
            assert ok, f"trial {trial['number']} ({trial['status']}, metric {trial['metric']}) has no measurement"
    finally:
        store.close()
    assert len(rows) == 1 + len(honest)


@pytest.mark.slow
def test_the_training_of_a_lost_worker_dies_with_it(tmp_path, monkeypatch):
    """Issue 23, item 6: whenever a worker dies, before or after it told anyone its
    training's process group, that training dies with it (here the training kills its own
    worker at once, unsandboxed, then tries to outlive it)."""
    marker = tmp_path / "survivor.pid"
    # First thing in the file, before torch is imported: the worker dies within
    # milliseconds of starting its training, before it could have told anyone its group.
    # It also removes whatever told its worker's parent its process group, then kills the worker.
    attack = (
        "import os as _os, signal as _signal, time as _time\n"
        "if _os.environ.get('AUTOLOOP_RESULT'):\n"
        f"    open({str(marker)!r}, 'w').write(str(_os.getpid()))\n"
        "    _run = _os.path.dirname(_os.environ['AUTOLOOP_RESULT'])\n"
        "    for _d in (_run, _os.path.dirname(_run)):\n"
        "        try:\n"
        "            _os.unlink(_os.path.join(_d, 'pids.json'))\n"
        "        except OSError:\n"
        "            pass\n"
        "    _os.kill(_os.getppid(), _signal.SIGKILL)\n"
        "    _time.sleep(120)\n"
    ) + TRAIN_PY.read_text()
    repo = make_repo(tmp_path / "repo", TRAIN_PY.read_text())
    config = _run(repo, monkeypatch, max_steps=6, max_trials=2, workers=1, executor="local", sandbox="off")
    _seed_attacks(repo, config, ["kill my worker"], {"kill my worker": attack})
    Controller(config, repo).run()
    trials = _trials(repo)
    assert trials["baseline"]["status"] == "keep", trials["baseline"]["reason"]
    assert marker.exists(), "the attack did not run"
    pid = int(marker.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.2)
    alive = Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
    if alive:
        os.kill(pid, 9)
    assert not alive, "the training of a dead worker is still running"


@pytest.mark.slow
@needs_bwrap
def test_no_verify_under_the_sandbox_sees_a_dataset_in_tmp(tmp_path, monkeypatch):
    """Issue 23, item 7: with --no-verify training reads its data itself, from wherever it is."""
    from autoloop import harness as H

    data = H.prepare_embedded(tmp_path / "data")
    repo = make_repo(tmp_path / "repo", TRAIN_PY.read_text())
    config = _run(repo, monkeypatch, max_steps=4, max_trials=1, verify=False, dataset=str(tmp_path / "data"))
    assert data.fingerprint
    Controller(config, repo).run()
    baseline = _trials(repo)["baseline"]
    assert baseline["status"] == "keep", baseline["reason"]
