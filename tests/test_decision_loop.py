"""The paired, sequential decision inside the loop (`decision-rule = "paired"`: only
confirmed candidates move the branch), with the fake training script. The default rule
(two tiers), the early stop and the reserve are tests/test_tiers_loop.py.

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
    flags.setdefault("decision_rule", "paired")
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
        "c = Controller(resolve(sys.argv[1], {'tag': 't', 'proposers': 'ideas', 'max_trials': 2, 'drift_every': 0, 'decision_rule': 'paired'}),"
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
        "Controller(resolve(sys.argv[1], {'tag': 't', 'proposers': 'ideas', 'max_trials': 2, 'drift_every': 0, 'decision_rule': 'paired'}),"
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


@pytest.mark.parametrize("rule, seeds, verify, runs", [
    ("strict", 3, False, 1),  # autoresearch's rule as it is: one baseline run
    ("strict", 3, True, 3),  # verified: the held-out guard needs the noise the baseline measures
    ("strict", 2, True, 2),
    ("strict", 1, True, 1),  # asked for (the run says what it costs)
    ("two-tier", 1, False, 1),
    ("two-tier", 4, True, 4),
])
def test_the_baseline_measures_the_noise_whenever_keeps_are_verified(rule, seeds, verify, runs):
    from types import SimpleNamespace

    from autoloop.config import Config
    from autoloop.decide.rule import DecisionConfig
    from autoloop.loop.trial import baseline_seed_count

    cfg = DecisionConfig(rule=rule, baseline_seeds=seeds)
    for verifier in (object(), None):  # no verifier (Controller(verifier=None)): nothing is verified
        c = SimpleNamespace(verifier=verifier, config=Config(verify=verify))
        assert baseline_seed_count(c, cfg) == (runs if verifier is not None else max(1, cfg.baseline_runs))


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


# ---------------------------------------------------------------------------- the machine's speed (issue 22)


@pytest.fixture
def fake_machine(tmp_path, monkeypatch):
    """A machine whose speed a test sets: the fake train.py trains more in the budget
    when it is faster (SPEED_FILE), and the speed probe reads the same file. The probe is
    what is faked; the loop, the worker and the store are the real ones. The tolerance is
    the default one (tests/conftest.py sets none for the other tests)."""
    from autoloop.measure import probe

    monkeypatch.delenv("AUTOLOOP_PAIR_SPEED_TOLERANCE", raising=False)

    speed = tmp_path / "speed.txt"
    speed.write_text("1")
    monkeypatch.setattr(probe, "machine_speed", lambda loops=probe.LOOPS: float(speed.read_text()))
    return speed


def _first_keep_done(repo, speed):
    """The baseline and a clearly better change kept, at the usual speed: the run's first
    keep (and its drift check) is behind it."""
    seed(repo, "better lr", "LR=0.012")
    run_loop(repo, max_trials=2)
    _, trials, _ = rows(repo)
    assert [t["status"] for t in trials] == ["keep", "keep"], [t["reason"] for t in trials]


@pytest.mark.parametrize("after", ["2", "0.5"])
def test_a_pair_of_runs_at_different_machine_speeds_is_not_a_pair(tmp_path, fake_machine, after):
    """The machine's speed changes (doubles: the load went away; halves: a burner came)
    between the incumbent's runs and a candidate that changes nothing. Paired with the
    incumbent's old runs it would be clearly better (kept) or clearly worse; instead the
    incumbent is measured again next to it, and on those fresh pairs it is what it is:
    no different."""
    repo = fake_repo_with(tmp_path, NOISE=0.01, SPEED_FILE=str(fake_machine))
    _first_keep_done(repo, fake_machine)
    seed(repo, "the same width, written differently", "WIDTH=2**6")  # no effect at all
    fake_machine.write_text(after)
    run_loop(repo, max_trials=1)
    run, trials, measurements = rows(repo)
    null, incumbent = trials[2], trials[1]
    assert null["status"] == "discard", null["reason"]
    decision = null["decision"]
    assert decision["confounded"] and decision["confounded"][0]["seed"] == 1337
    assert decision["mean_diff"] == pytest.approx(0.0, abs=1e-9)  # judged on pairs at one speed only
    fresh = [m for m in measurements[incumbent["number"]] if m.get("for_trial_id") == null["id"]]
    assert fresh and all(m["machine_speed"] == float(after) for m in fresh)
    assert all(m["machine_speed"] == float(after) for m in measurements[null["number"]])
    store = Store(repo / "experiments.db")
    try:
        events = store.events(run["id"], kind="confounded")
    finally:
        store.close()
    assert events and "not a pair" in events[0]["message"]


def test_without_the_speed_tolerance_the_confounded_pair_is_kept(tmp_path, fake_machine, monkeypatch):
    """The same night as above with `pair-speed-tolerance = none` (the loop as it was
    before the probe): the change that does nothing, measured at twice the machine's
    speed against the incumbent's old runs, is kept. This is the false keep the default
    tolerance prevents."""
    monkeypatch.setenv("AUTOLOOP_PAIR_SPEED_TOLERANCE", "none")
    repo = fake_repo_with(tmp_path, NOISE=0.01, SPEED_FILE=str(fake_machine))
    _first_keep_done(repo, fake_machine)
    seed(repo, "the same width, written differently", "WIDTH=2**6")
    fake_machine.write_text("2")
    run_loop(repo, max_trials=1)
    _, trials, measurements = rows(repo)
    null = trials[2]
    assert null["status"] == "keep", null["reason"]
    assert "confounded" not in null["decision"]
    assert not [m for m in measurements[2] if m.get("for_trial_id") == null["id"]]  # no fresh incumbent run


def test_a_machine_that_keeps_changing_costs_runs_never_a_keep(tmp_path, fake_machine, monkeypatch):
    """Every run on a different speed: no seed ever has a comparable pair, each is given
    up after the re-measurements allowed, and the candidate is discarded, not kept."""
    from autoloop.measure import probe

    repo = fake_repo_with(tmp_path, NOISE=0.01, SPEED_FILE=str(fake_machine))
    _first_keep_done(repo, fake_machine)
    readings = iter(float(2 ** (k % 7)) for k in range(10_000))
    monkeypatch.setattr(probe, "machine_speed", lambda loops=probe.LOOPS: next(readings))
    seed(repo, "the same width, written differently", "WIDTH=2**6")
    run_loop(repo, max_trials=1)
    _, trials, _ = rows(repo)
    assert trials[2]["status"] == "discard", [(t["kind"], t["status"], t["reason"]) for t in trials]
    assert trials[2]["decision"].get("confounded_dropped")


def test_the_incumbent_is_measured_again_before_the_first_keep(tmp_path, fake_machine):
    """Before the run's first keep, the incumbent runs again next to the candidate: the
    keep stands on that fresh pair, and the fresh run is a drift check."""
    offset = tmp_path / "offset.txt"
    offset.write_text("0")
    repo = fake_repo_with(tmp_path, NOISE=0.01, OFFSET_FILE=str(offset))
    run_loop(repo, max_trials=1)  # the baseline
    offset.write_text("-0.2")  # the machine drifts at the same speed (new driver, another library)
    seed(repo, "better lr", "LR=0.012")
    run_loop(repo, max_trials=1)
    run, trials, measurements = rows(repo)
    better = trials[1]
    fresh = [m for m in measurements[1] if m.get("for_trial_id") == better["id"]]
    assert fresh and fresh[0]["seed"] == 1337 and fresh[0]["role"] == "incumbent"
    # The fresh run is 0.2 off the old one at the same speed: every pair of this keep is fresh.
    assert better["decision"]["incumbent_drifted"]["shift"] == pytest.approx(-0.2, abs=1e-9)
    assert better["decision"]["fresh_incumbent_seeds"] == sorted(better["decision"]["seeds"])
    store = Store(repo / "experiments.db")
    try:
        drift = store.events(run["id"], kind="drift")
    finally:
        store.close()
    assert drift and "drift check" in drift[0]["message"] and "-0.200000" in drift[0]["message"]
    assert better["status"] == "keep" and better["decision"]["mean_diff"] == pytest.approx(-0.084, abs=0.03)


def test_the_log_delta_is_the_number_the_reason_gives(tmp_path):
    """One definition of a trial's delta: the paired difference its decision used (the
    log showed -0.1320 beside a reason of -0.0300 ± 0.1351)."""
    from autoloop.review.queries import log_rows

    repo = fake_repo_with(tmp_path, NOISE=0.02)
    seed(repo, "much worse lr", "LR=0.5")  # one run: paired at one seed, the baseline has three
    seed(repo, "a small gain", "LR=0.017")  # several runs
    seed(repo, "re-draw the init stream", "SALT=3")
    run_loop(repo, max_trials=4)
    store = Store(repo / "experiments.db")
    try:
        run = store.get_run("t")
        rows = log_rows(store, run)
        decisions = {t["number"]: t["decision"] for t in store.trials(run["id"])}
    finally:
        store.close()
    proposals = [r for r in rows if r["kind"] == "proposal"]
    assert len(proposals) == 3
    for r in proposals:
        shown = f"{r['delta']:+.4f}"
        assert r["reason"].split(":", 1)[1].strip().startswith(shown), (shown, r["reason"])
        assert r["delta"] == pytest.approx(decisions[r["number"]]["mean_diff"], abs=1e-12)
