"""Issue 19 in the loop: two tiers, the early stop of clear losers, the reserve behind the
headline, and `finalize --confirmed-only`, with the fake training script (real git repos,
real SQLite, real worker code; tests/fakes/fake_train.py).

The fake's val_bpb is a known function of its constants plus NOISE x a draw fixed by the
seed and SALT, so a change of LR or WIDTH keeps the draw (it cancels exactly in a pair)
and a change of SALT only re-draws it. With STEPWISE it also writes a loss curve, step by
step, whose distance from the unmodified script's grows with its final val_bpb's.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from autoloop.cli import app
from autoloop.config import resolve
from autoloop.decide.early_stop import Calibration
from autoloop.decide.remeasure import RESERVE_OFFSET
from autoloop.decide.rule import DecisionConfig, keep_bound
from autoloop.errors import AutoloopError
from autoloop.loop.controller import Controller
from test_decision_loop import run_loop as decision_loop_run
from autoloop.measure.job import MeasureJob
from autoloop.measure.worker import run_job
from autoloop.proposers.seeding import seed_idea
from autoloop.store import Store
from tests.conftest import FAKE_TRAIN, make_repo

BASE_SEED = 1337


def fake_source(**constants) -> str:
    source = FAKE_TRAIN.read_text()
    for name, value in constants.items():
        lines = [f"{name} = {value!r}" if line.startswith(f"{name} = ") else line for line in source.splitlines()]
        source = "\n".join(lines) + "\n"
    return source


def fake_val(seed: int, lr: float = 0.02, width: int = 64, noise: float = 0.0, salt: int = 0) -> float:
    """The fake's val_bpb, as tests/fakes/fake_train.py computes it."""
    value = 1.0 + (math.log10(lr) + 2.0) ** 2 + 0.1 * (math.log2(width) - 6.0) ** 2
    return value + noise * random.Random(seed * 1000003 + salt).gauss(0.0, 1.0)


def run_loop(repo, **flags):
    """test_decision_loop's loop, on the default (two-tier) rule unless told otherwise."""
    flags.setdefault("decision_rule", "two-tier")
    return decision_loop_run(repo, **flags)


def seed(repo, text, *sets):
    return seed_idea(resolve(repo, {}), repo, text, sets=list(sets), patch=None, priority=0)


def rows(repo, tag="t"):
    with Store(repo / "experiments.db") as store:
        run = store.get_run(tag)
        trials = store.trials(run["id"])
        return run, trials, {t["number"]: store.measurements(t["id"]) for t in trials}


def cli(repo, *args):
    result = CliRunner().invoke(app, [*args, "--repo", str(repo)])
    assert result.exit_code == 0, result.output
    return result


def git(repo, *args) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


# ---------------------------------------------------------------------------- the default rule


@pytest.fixture
def two_changes(tmp_path):
    """The baseline (WIDTH 128, LR 0.02), then a change too small for its noise (LR 0.0195:
    -0.0065 bpb) and a clear one (WIDTH 64: -0.1 bpb) on another line."""
    repo = make_repo(tmp_path / "repo", fake_source(NOISE=0.01, WIDTH=128))
    seed(repo, "slightly lower lr", "LR=0.0195")
    seed(repo, "half the width", "WIDTH=64")
    summary = run_loop(repo, max_trials=3)
    assert summary.trials_run == 3
    return repo


def test_the_default_adopts_on_the_paired_mean_and_confirms_only_at_the_bound(two_changes):
    run, trials, measurements = rows(two_changes)
    assert run["decision_rule"] == "two-tier"
    baseline, small, clear = trials
    assert baseline["tier"] == "baseline" and baseline["n_runs"] == 3
    noise_df = run["noise_df"]
    bound = keep_bound(DecisionConfig(), noise_df)
    for trial, effect in ((small, fake_val(BASE_SEED, 0.0195, 128) - fake_val(BASE_SEED, 0.02, 128)),
                          (clear, fake_val(BASE_SEED, 0.0195, 64) - fake_val(BASE_SEED, 0.0195, 128))):
        d = trial["decision"]
        assert trial["status"] == "keep" and trial["n_runs"] == 1  # one pair, like the strict rule
        assert [m["seed"] for m in measurements[trial["number"]]] == [BASE_SEED]
        assert d["mean_diff"] == pytest.approx(effect, abs=1e-9)  # the seed's draw cancels in the pair
        t = effect / d["pair_sd"]
        assert d["t"] == pytest.approx(t) and d["keep_bound"] == pytest.approx(bound)
        assert trial["tier"] == d["tier"] == ("confirmed" if t <= bound else "adopted")
        assert d["confirmed"] is (t <= bound)
    assert small["tier"] == "adopted" and clear["tier"] == "confirmed"  # -0.2 se is not confirmed; -3.5 se is
    log = cli(two_changes, "log").output
    assert next(l for l in log.splitlines() if l.strip().startswith("3 ")).split()[2:4] == ["keep", "✓"]
    assert "keep ✓" not in next(l for l in log.splitlines() if l.strip().startswith("2 "))
    assert "adopted" in cli(two_changes, "show", "2").output
    assert "confirmed (the sequential test" in cli(two_changes, "show", "3").output
    assert "(trial 3, confirmed," in cli(two_changes, "status").output


def test_finalize_confirmed_only_leaves_out_what_was_only_adopted(two_changes):
    out = cli(two_changes, "finalize", "--confirmed-only", "--no-remeasure").output
    assert "with kept trial 3, leaving out trial 2 (adopted, never confirmed)" in out
    tree = git(two_changes, "show", "final/t:train.py")
    assert "WIDTH = 64" in tree and "LR = 0.02" in tree  # the confirmed change, without the adopted one
    message = git(two_changes, "log", "-1", "--format=%B", "final/t")
    assert "Left out (not confirmed" in message and "trial 2: slightly lower lr" in message
    cli(two_changes, "finalize", "--branch", "final/all", "--no-remeasure")
    everything = git(two_changes, "show", "final/all:train.py")
    assert "WIDTH = 64" in everything and "LR = 0.0195" in everything


def test_finalize_confirmed_only_refuses_a_run_that_confirmed_nothing(tmp_path):
    from autoloop.review.finalize import finalize

    repo = make_repo(tmp_path / "repo", fake_source(NOISE=0.01))
    seed(repo, "slightly lower lr", "LR=0.0195")
    run_loop(repo, max_trials=2)
    with Store(repo / "experiments.db") as store:
        run = store.get_run("t")
        assert store.trials(run["id"])[1]["tier"] == "adopted"
        with pytest.raises(AutoloopError, match="confirmed none of its kept changes"):
            finalize(store, run, repo, confirmed_only=True)


def test_the_rule_is_one_setting_checked_in_one_line(tmp_path):
    repo = make_repo(tmp_path / "repo", fake_source())
    with pytest.raises(AutoloopError, match="--decision-rule bogus is not one of two-tier, strict, paired, "
                                            "confirmed-only"):
        resolve(repo, {"decision_rule": "bogus"})
    assert resolve(repo, {}).decision_rule == "two-tier"
    alphas = {rule: Controller(resolve(repo, {"decision_rule": rule}), repo, verifier=None).decision_config().alpha
              for rule in ("two-tier", "paired", "confirmed-only", "strict")}
    assert alphas == {"two-tier": 0.05, "paired": 0.05, "confirmed-only": 0.2, "strict": 0.05}
    assert Controller(resolve(repo, {"decision_rule": "confirmed-only", "alpha": 0.1}), repo,
                      verifier=None).decision_config().alpha == 0.1


# ---------------------------------------------------------------------------- the reserve


def test_the_headline_comes_from_reserve_runs_at_seeds_no_decision_used(tmp_path):
    repo = make_repo(tmp_path / "repo", fake_source(NOISE=0.01))
    seed(repo, "better lr", "LR=0.012")
    summary = run_loop(repo, max_trials=2, reserve_seeds=4)
    run, trials, measurements = rows(repo)
    best = trials[1]
    reserve = [m for m in measurements[2] if m["role"] == "reserve"]
    # A night of 4 runs (3 baseline seeds, 1 candidate run): the reserve is 2 runs (4% of it, at least 2).
    assert [m["seed"] for m in reserve] == [BASE_SEED + RESERVE_OFFSET, BASE_SEED + RESERVE_OFFSET + 1]
    decided = {m["seed"] for ms in measurements.values() for m in ms if m["role"] != "reserve"}
    assert decided == {BASE_SEED, BASE_SEED + 1, BASE_SEED + 2}
    assert not decided & {m["seed"] for m in reserve}
    for m in reserve:
        assert m["metric"] == pytest.approx(fake_val(m["seed"], 0.012, noise=0.01))
    head = summary.headline
    value = sum(fake_val(m["seed"], 0.012, noise=0.01) for m in reserve) / 2
    base = sum(fake_val(BASE_SEED + k, noise=0.01) for k in range(3)) / 3
    assert head["value"] == pytest.approx(value) and head["gain"] == pytest.approx(base - value)
    assert head["n"] == 2 and head["paired"] is False
    # Unpaired (the reserve shares no seed with the baseline): se = run_sd sqrt(1/2 + 1/3), t interval at the run's df.
    assert head["gain_se"] == pytest.approx(run["noise_sd"] * math.sqrt(1 / 2 + 1 / 3))
    assert head["value_se"] == pytest.approx(run["noise_sd"] / math.sqrt(2))
    # The selection mean the decision saw is another number: one run at a decision seed.
    assert best["metric"] == pytest.approx(fake_val(BASE_SEED, 0.012, noise=0.01)) != pytest.approx(value)
    info = json.loads(cli(repo, "best", "--json").output)
    assert info["reserve"]["value"] == pytest.approx(value) and info["metric"] == best["metric"]
    text = cli(repo, "best").output
    assert f"{value:.6f}" in text and "re-measured at 2 fresh seeds no decision used" in text
    with Store(repo / "experiments.db") as store:
        assert store.events(run["id"], kind="headline")
        assert store.get_run("t")["noise_sd"] == run["noise_sd"]  # the reserve never enters the noise


def test_a_night_that_kept_nothing_reports_the_baselines_own_runs(tmp_path):
    repo = make_repo(tmp_path / "repo", fake_source(NOISE=0.01))
    seed(repo, "worse lr", "LR=0.5")
    summary = run_loop(repo, max_trials=2, reserve_seeds=4)
    _, trials, measurements = rows(repo)
    assert trials[1]["status"] == "discard"
    assert not any(m["role"] == "reserve" for ms in measurements.values() for m in ms)  # never selected: no reserve
    head = summary.headline
    assert head["source"] == "baseline" and head["n"] == 3 and head["gain"] == 0.0 and head["gain_se"] == 0.0
    assert head["value"] == pytest.approx(sum(fake_val(BASE_SEED + k, noise=0.01) for k in range(3)) / 3)


def test_best_remeasures_a_run_that_has_no_reserve(tmp_path):
    from autoloop.review.queries import best_summary
    from autoloop.review.remeasure import ensure_headline

    repo = make_repo(tmp_path / "repo", fake_source(NOISE=0.01))
    seed(repo, "better lr", "LR=0.012")
    run_loop(repo, max_trials=2)  # the tests' default: reserve-seeds 0
    with Store(repo / "experiments.db") as store:
        run = store.get_run("t")
        assert best_summary(store, run)["reserve"] is None
        assert "the selection mean, not re-measured" in cli(repo, "best").output
        config = dict(run["config"])
        config.pop("reserve_seeds")  # as a run from before the reserve
        store.update_run(run["id"], config=config)
        run = store.get_run("t")
    assert ensure_headline(repo, run, verifier=None) is None
    with Store(repo / "experiments.db") as store:
        info = best_summary(store, store.get_run("t"))
        assert store.get_run("t")["status"] == run["status"]
    assert info["reserve"]["n"] == 2 and list(info["reserve"]["seeds"]) == [BASE_SEED + RESERVE_OFFSET + k for k in range(2)]
    assert ensure_headline(repo, run, verifier=None) is None  # nothing missing: nothing trained
    _, _, measurements = rows(repo)
    assert sum(m["role"] == "reserve" for m in measurements[2]) == 2


# ---------------------------------------------------------------------------- the early stop


def _calibrated_rule(budget: dict, n: int = 14) -> dict:
    """A rule calibrated on n pairs that ended level (f = 0) with partial differences of
    sd 0.003: its threshold is ~0.01, so a candidate ahead by nothing is never stopped."""
    draws = random.Random(5)
    calibration = Calibration()
    for _ in range(n):
        for p in calibration.cfg.grid:
            calibration.add(p, 0.003 * draws.gauss(0, 1), 0.0)
    return calibration.rule(budget=budget).to_json()


@pytest.mark.parametrize("mode", ["steps", "time"])
def test_the_worker_stops_a_clear_loser_and_lets_a_level_run_finish(tmp_path, mode):
    budget = {"max_steps": 20} if mode == "steps" else {"time_budget": 1.5}
    incumbent = tmp_path / "incumbent"
    inc_repo = make_repo(incumbent, fake_source(STEPWISE=True, SLEEP=0.0 if mode == "steps" else 1.5))
    extra = {"max_steps": 20} if mode == "steps" else {"time_budget": 1.5}
    job = MeasureJob(kind="train", commit="0" * 40, seed=3, train_argv=[sys.executable, "train.py"], grace_seconds=60,
                     data_dir=str(tmp_path / "no-data"), harness_mode=False, external_eval=False, sandbox="off",
                     script="train.py", **extra)
    inc = run_job(job, project_dir=inc_repo, run_dir=tmp_path / "inc-run")
    assert inc.status == "ok" and len(inc.result["curve"]) == 20
    early = {"rule": _calibrated_rule(budget), "incumbent_curve": inc.result["curve"]}
    for name, constants, stopped in (("loser", {"LR": 0.5, "SLEEP": 3.0}, True), ("level", {"SALT": 1, "SLEEP": 1.5}, False)):
        repo = make_repo(tmp_path / name, fake_source(STEPWISE=True, **constants))
        result = run_job(MeasureJob(**{**job.to_dict(), "early_stop": early}), project_dir=repo,
                         run_dir=tmp_path / f"{name}-run")
        if stopped:
            assert result.status == "stopped" and result.metric is None
            assert 0.3 <= result.fields["stopped_at"] < 0.8  # never before 30% of the budget
            assert result.fields["wall_seconds"] < 3.0
            assert "stopped early at" in result.reason and "above the night's threshold" in result.reason
        else:
            assert result.status == "ok" and result.metric == pytest.approx(fake_val(3, salt=1))


def test_a_job_without_a_readable_rule_is_never_stopped(tmp_path):
    from autoloop.measure.stop_watch import StopWatch

    job = MeasureJob(kind="train", commit="0", seed=1, early_stop={"rule": {"version": 999}, "incumbent_curve": []})
    assert StopWatch.from_job(job, tmp_path / "progress.jsonl") is None
    never = Calibration().rule(budget={"max_steps": 20}).to_json()  # no pairs: never stops
    job = MeasureJob(kind="train", commit="0", seed=1, early_stop={"rule": never, "incumbent_curve": []})
    assert StopWatch.from_job(job, tmp_path / "progress.jsonl") is None


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_the_loop_stops_a_clear_loser_once_the_night_has_calibrated_the_rule(tmp_path, workers):
    """13 null proposals (each re-draws only the curve's own noise: they end exactly level)
    calibrate the rule; then a clearly worse learning rate is stopped early and discarded,
    its diff kept, and a better one after it is adopted, not stopped. Serial, and on two
    workers of the local executor (the rule travels in the job to a worker process)."""
    repo = make_repo(tmp_path / "repo", fake_source(STEPWISE=True, STEP_NOISE=0.003))
    for salt in range(1, 14):
        seed(repo, f"re-draw ({salt})", f"SALT={salt}")
    seed(repo, "much worse lr", "LR=0.5", "SLEEP=4.0")
    seed(repo, "better lr", "LR=0.012", "SLEEP=1.0")
    run_loop(repo, max_trials=16, max_steps=20, time_budget=60,
             **({"executor": "local", "workers": workers} if workers else {}))
    _, trials, measurements = rows(repo)
    nulls, loser, better = trials[1:14], trials[14], trials[15]
    assert all(t["status"] == "discard" and t["stopped_at"] is None for t in nulls), [t["reason"] for t in nulls]
    assert loser["status"] == "discard" and loser["metric"] is None and loser["tier"] is None
    assert 0.3 <= loser["stopped_at"] < 0.8 and "stopped early at" in loser["reason"]
    assert loser["decision"]["stopped"] == "early stop"
    assert [(m["role"], m["status"], m["metric"]) for m in measurements[15]] == [("candidate", "stopped", None)]
    assert loser["diff"] and "LR = 0.5" in loser["diff"]
    assert git(repo, "rev-parse", "refs/autoloop/t/trials/15") == loser["trial_commit"]
    assert better["status"] == "keep" and better["stopped_at"] is None
    assert "stop@" in cli(repo, "log").output
