"""The paired, sequential decision inside the loop, with the fake training script.

The fake's val_bpb is a known function of its constants plus NOISE x a draw that depends
on the seed and on SALT: a change of LR keeps the draw (the noise cancels in a paired
comparison); a change of SALT only re-draws it (a null proposal, true effect zero).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from autoloop.config import resolve
from autoloop.loop.controller import Controller
from autoloop.proposers.seeding import seed_idea
from autoloop.store import Store
from tests.conftest import FAKE_TRAIN, make_repo


def fake_repo_with(tmp_path, **constants) -> Path:
    source = FAKE_TRAIN.read_text()
    for name, value in constants.items():
        lines = source.splitlines()
        lines = [f"{name} = {value!r}" if line.startswith(f"{name} = ") else line for line in lines]
        source = "\n".join(lines) + "\n"
    return make_repo(tmp_path / "repo", source)


def run_loop(repo, **flags):
    flags.setdefault("tag", "t")
    flags.setdefault("time_budget", 5)
    flags.setdefault("grace_seconds", 20)
    flags.setdefault("proposers", "ideas")
    flags.setdefault("drift_every", 0)
    return Controller(resolve(repo, flags), repo, verifier=None).run()


def seed(repo, text, *sets):
    return seed_idea(resolve(repo, {}), repo, text, sets=list(sets), patch=None, priority=0)


def rows(repo, tag="t"):
    store = Store(repo / "experiments.db")
    try:
        run = store.get_run(tag)
        trials = store.trials(run["id"])
        measurements = {t["number"]: store.measurements(t["id"]) for t in trials}
        return run, trials, measurements
    finally:
        store.close()


def test_baseline_runs_at_several_seeds_and_measures_the_noise(tmp_path):
    repo = fake_repo_with(tmp_path, NOISE=0.01)
    run_loop(repo, max_trials=1, baseline_seeds=3)
    run, trials, measurements = rows(repo)
    baseline = trials[0]
    assert baseline["status"] == "keep" and baseline["n_runs"] == 3
    seeds = [m["seed"] for m in measurements[1]]
    assert seeds == [1337, 1338, 1339]
    values = [m["metric"] for m in measurements[1]]
    assert baseline["metric"] == pytest.approx(sum(values) / 3)
    assert baseline["metric_sd"] > 0
    assert run["noise_sd"] > 0 and run["noise_df"] == 2
    assert run["decision_rule"] == "paired"


def test_clearly_worse_costs_one_run_and_clearly_better_is_kept(tmp_path):
    repo = fake_repo_with(tmp_path, NOISE=0.01)
    seed(repo, "much worse lr", "LR=0.5")  # +1.7 bpb
    seed(repo, "better lr", "LR=0.012")  # -0.084 bpb, far beyond the noise
    run_loop(repo, max_trials=3)
    _, trials, measurements = rows(repo)
    worse, better = trials[1], trials[2]
    assert worse["status"] == "discard" and worse["n_runs"] == 1
    assert [m["role"] for m in measurements[2]] == ["candidate"]
    assert better["status"] == "keep", better["reason"]
    assert better["metric"] < trials[0]["metric"] - 0.05
    assert better["decision"]["action"] == "keep"


def test_null_proposals_that_only_redraw_the_noise_are_not_kept(tmp_path):
    repo = fake_repo_with(tmp_path, NOISE=0.02)
    for salt in range(1, 7):
        seed(repo, f"re-draw the init stream ({salt})", f"SALT={salt}")
    run_loop(repo, max_trials=7)
    _, trials, _ = rows(repo)
    proposals = [t for t in trials if t["kind"] == "proposal"]
    assert len(proposals) == 6
    assert [t["status"] for t in proposals].count("keep") == 0, [t["reason"] for t in proposals]


def test_a_kill_between_measurements_loses_none_and_repeats_none(tmp_path):
    repo = fake_repo_with(tmp_path, NOISE=0.01)
    seed(repo, "slightly better lr", "LR=0.0195")  # a small gain: needs several paired runs
    code = (
        "import sys; from autoloop.config import resolve; from autoloop.loop.controller import Controller\n"
        "c = Controller(resolve(sys.argv[1], {'tag': 't', 'proposers': 'ideas', 'max_trials': 2, 'drift_every': 0}),"
        " sys.argv[1], verifier=None); c.run()\n"
    )
    env = {**os.environ, "AUTOLOOP_FAULT": "between_measurements:1"}
    died = subprocess.run([sys.executable, "-c", code, str(repo)], env=env, capture_output=True, timeout=120)
    assert died.returncode == -9, died.stderr.decode()[-2000:]
    _, trials, measurements = rows(repo)
    assert trials[1]["status"] == "running"
    before = [(m["trial_id"], m["seed"], m["role"]) for ms in measurements.values() for m in ms]
    env.pop("AUTOLOOP_FAULT")
    done = subprocess.run([sys.executable, "-c", code, str(repo)], env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    _, trials, measurements = rows(repo)
    assert trials[1]["status"] in ("keep", "discard")
    after = [(m["trial_id"], m["seed"], m["role"]) for ms in measurements.values() for m in ms]
    assert set(before) <= set(after)  # none lost
    assert len(after) == len(set(after))  # none repeated
    assert len(trials) == 2  # the resumed trial is the same trial



def test_a_trial_the_controller_died_in_twice_is_not_resumed_a_third_time(tmp_path):
    """The crash-loop guard (autoloop.loop.recovery): resumed after a dead controller, a trial
    that dies with the controller again ends interrupted and its idea is done."""
    repo = fake_repo_with(tmp_path, NOISE=0.01)
    seed(repo, "a better lr", "LR=0.018")  # a gain that takes four paired runs to show
    code = (
        "import sys; from autoloop.config import resolve; from autoloop.loop.controller import Controller\n"
        "Controller(resolve(sys.argv[1], {'tag': 't', 'proposers': 'ideas', 'max_trials': 2, 'drift_every': 0}),"
        " sys.argv[1], verifier=None).run()\n"
    )
    env = {**os.environ, "AUTOLOOP_FAULT": "between_measurements:1"}
    for _ in range(2):  # killed; resumed and killed again
        died = subprocess.run([sys.executable, "-c", code, str(repo)], env=env, capture_output=True, timeout=120)
        assert died.returncode == -9, died.stderr.decode()[-2000:]
    _, trials, measurements = rows(repo)
    assert trials[1]["status"] == "running" and len(measurements[2]) >= 2
    run_loop(repo, max_trials=0)
    _, trials, _ = rows(repo)
    assert len(trials) == 2 and trials[1]["status"] == "interrupted", trials[1]
    assert "stopped twice" in trials[1]["reason"]
    with Store(repo / "experiments.db") as store:
        assert store.ideas()[0]["status"] == "done"


def test_strict_rule_is_one_run_lower_wins(tmp_path):
    repo = fake_repo_with(tmp_path, NOISE=0.0)
    seed(repo, "better lr", "LR=0.012")
    run_loop(repo, max_trials=2, decision_rule="strict")
    _, trials, measurements = rows(repo)
    assert [len(measurements[t["number"]]) for t in trials] == [1, 1]
    assert trials[1]["status"] == "keep"


def test_drift_check_records_an_event_and_a_large_shift_pauses(tmp_path):
    offset = tmp_path / "offset.txt"
    offset.write_text("0")
    repo = fake_repo_with(tmp_path, NOISE=0.01, OFFSET_FILE=str(offset))
    for lr in ("0.5", "0.6", "0.7"):
        seed(repo, f"worse lr {lr}", f"LR={lr}")
    offset_after_baseline = "0.5"

    # The baseline, two discards, then a drift check that sees the machine changed.
    run_loop(repo, max_trials=3, drift_every=2)
    offset.write_text(offset_after_baseline)
    summary = run_loop(repo, max_trials=3, drift_every=2)
    assert summary.paused and "drift" in summary.stop_reason
    store = Store(repo / "experiments.db")
    try:
        run = store.get_run("t")
        events = store.events(run["id"], kind="drift")
        drift = store.trials(run["id"], kind="drift")
    finally:
        store.close()
    assert drift and drift[0]["decision"]["shift"] == pytest.approx(0.5, abs=1e-6)
    assert events


def test_an_old_run_resumes_with_the_new_rule_and_says_so(tmp_path):
    repo = fake_repo_with(tmp_path, NOISE=0.0)
    run_loop(repo, max_trials=1, decision_rule="strict")
    store = Store(repo / "experiments.db")
    try:
        run = store.get_run("t")
        store.update_run(run["id"], decision_rule=None)  # as a run started before noise-aware decisions
    finally:
        store.close()
    seed(repo, "better lr", "LR=0.012")
    run_loop(repo, max_trials=1)
    store = Store(repo / "experiments.db")
    try:
        run = store.get_run("t")
        events = store.events(run["id"], kind="rule_change")
        trials = store.trials(run["id"])
    finally:
        store.close()
    assert run["decision_rule"] == "paired"
    assert events and "resumes with the paired rule" in events[0]["message"]
    assert trials[-1]["status"] == "keep"


OOM_FAKE_PATCH = (
    "DEVICE_BATCH_SIZE = 32  # sequences per micro-step\n"
    "TOTAL_BATCH_TOKENS = 64 * 256\n"
    "MEMORY_LIMIT = 16  # the largest DEVICE_BATCH_SIZE that fits\n"
)


def test_out_of_memory_is_repaired_with_half_the_batch_and_the_same_total(tmp_path):
    source = FAKE_TRAIN.read_text().replace('MODE = "ok"', OOM_FAKE_PATCH + 'MODE = "ok"', 1)
    source = source.replace(
        "    if MODE == \"crash\":",
        "    if DEVICE_BATCH_SIZE > MEMORY_LIMIT:\n"
        "        raise RuntimeError(\"CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.11 GiB total capacity)\")\n"
        "    if MODE == \"crash\":", 1)
    repo = make_repo(tmp_path / "repo", source)
    seed(repo, "better lr", "LR=0.012")
    run_loop(repo, max_trials=3, decision_rule="strict", baseline_seeds=1)
    # The baseline itself OOMs at 32: no repair of the user's own script; the run pauses.
    _, trials, _ = rows(repo)
    assert trials[0]["status"] == "crash" and "out of memory" in trials[0]["reason"]

    source = source.replace("DEVICE_BATCH_SIZE = 32", "DEVICE_BATCH_SIZE = 8")
    repo2 = make_repo(tmp_path / "repo2", source)
    seed(repo2, "bigger micro-batch", "DEVICE_BATCH_SIZE=64")  # OOMs; two halvings fit again
    run_loop(repo2, max_trials=4, decision_rule="strict", baseline_seeds=1)
    _, trials, _ = rows(repo2)
    kinds = [(t["kind"], t["status"]) for t in trials]
    assert kinds[:2] == [("baseline", "keep"), ("proposal", "crash")], kinds
    first, second = trials[2], trials[3]
    assert first["kind"] == "repair" and first["derived_from"] == trials[1]["id"], kinds
    assert "DEVICE_BATCH_SIZE 64 -> 32" in first["description"] and first["status"] == "crash"
    assert second["kind"] == "repair" and second["derived_from"] == first["id"]
    assert "32 -> 16" in second["description"] and second["status"] != "crash", second["reason"]
    changed = [line for line in second["diff"].splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert changed == ["-DEVICE_BATCH_SIZE = 8  # sequences per micro-step",
                       "+DEVICE_BATCH_SIZE = 16  # sequences per micro-step"], changed


def test_out_of_memory_without_a_batch_constant_is_a_crash_with_the_reason(tmp_path):
    source = FAKE_TRAIN.read_text().replace("    if MODE == \"crash\":", "    if LR > 0.1:\n"
                                            "        raise MemoryError(\"DefaultCPUAllocator: can't allocate memory\")\n"
                                            "    if MODE == \"crash\":", 1)
    repo = make_repo(tmp_path / "repo", source)
    seed(repo, "huge lr", "LR=0.5")
    run_loop(repo, max_trials=3, decision_rule="strict", baseline_seeds=1)
    _, trials, _ = rows(repo)
    assert trials[1]["status"] == "crash" and "not repaired" in trials[1]["reason"]
    assert "DEVICE_BATCH_SIZE" in trials[1]["reason"]
    assert all(t["kind"] != "repair" for t in trials)


def test_a_near_miss_is_tried_once_more_after_the_incumbent_changes(tmp_path):
    repo = fake_repo_with(tmp_path, NOISE=0.01)
    seed(repo, "a tiny gain", "LR=0.0195")  # -0.004 bpb: better, but within the noise: a near miss
    seed(repo, "better lr", "LR=0.012")
    run_loop(repo, max_trials=4, requeue_near_misses=True)
    _, trials, _ = rows(repo)
    tiny = trials[1]
    assert tiny["status"] == "discard" and tiny["decision"]["near_miss"], tiny["decision"]
    again = [t for t in trials if t.get("derived_from") == tiny["id"]]
    assert trials[2]["status"] == "keep"
    assert len(again) == 1 and "near miss of trial 2" in again[0]["description"]
    assert again[0]["parent_commit"] == trials[2]["trial_commit"]
