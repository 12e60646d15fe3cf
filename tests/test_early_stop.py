"""The early stop of clear losers, on inputs with known answers (autoloop/decide/early_stop.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from autoloop.decide.early_stop import (
    GRID, Calibration, EarlyStopConfig, StopRule, calibrate, curve_pairs, never, partial_difference, progress_of,
    schedule_changes, schedules_match, should_stop, stop_point,
)
from autoloop.errors import AutoloopError

CFG = EarlyStopConfig()


def _lr(p: float, warmdown: float = 0.5, warmup: float = 0.0) -> float:
    """train.py's lr_multiplier."""
    if p < warmup:
        return (p + 1e-8) / warmup
    if p < 1.0 - warmdown:
        return 1.0
    return (1.0 - p) / warmdown


def _curve(losses, max_steps, warmdown=0.5, seconds_per_step=None):
    out = []
    for k, loss in enumerate(losses):
        step = k + 1
        pt = {"step": step, "loss": float(loss), "lr": _lr(k / max_steps, warmdown)}
        if seconds_per_step is not None:
            pt["seconds"] = step * seconds_per_step
        out.append(pt)
    return out


def _gaussian_pairs(rng, n, slope, sd, f_sd=1.0):
    """n pairs with D(p) = slope * f + N(0, sd^2) at every checkpoint, f ~ N(0, f_sd^2)."""
    triples = []
    for _ in range(n):
        f = float(rng.normal(0, f_sd))
        for p in GRID:
            triples.append((p, slope * f + float(rng.normal(0, sd)), f))
    return triples


# ---------------------------------------------------------------------------------------
# The calibration's promise: a candidate that ends level is stopped with probability <= eps


def test_a_candidate_that_ends_level_is_stopped_at_most_eps_of_the_time():
    rng = np.random.default_rng(0)
    cfg = EarlyStopConfig(eps=0.05, min_progress=0.3)
    stopped = trials = 0
    for _ in range(300):  # calibrations on fresh nights of 60 pairs: the promise holds over them too
        rule = calibrate(_gaussian_pairs(rng, 60, slope=0.8, sd=0.5), cfg)
        assert rule.active
        for _ in range(20):  # candidates with final difference exactly 0: D ~ N(0, 0.5^2), independent per point
            partials = {p: float(rng.normal(0, 0.5)) for p in GRID}
            stopped += stop_point(rule, partials) is not None
            trials += 1
    rate = stopped / trials
    # Bonferroni over the 7 checkpoints from 0.3 (independent here): just under eps.
    assert 0.6 * cfg.eps < rate <= cfg.eps * 1.1, rate


def test_better_candidates_are_stopped_less_and_clear_losers_almost_always():
    rng = np.random.default_rng(1)
    rule = calibrate(_gaussian_pairs(rng, 80, slope=0.8, sd=0.3), EarlyStopConfig(eps=0.02))

    def rate(f):
        hits = sum(stop_point(rule, {p: 0.8 * f + float(rng.normal(0, 0.3)) for p in GRID}) is not None
                   for _ in range(2000))
        return hits / 2000

    assert rate(-1.0) < 0.002  # a clear gain is (essentially) never lost
    assert rate(0.0) <= 0.03
    assert rate(4.0) > 0.99  # a clear loser is stopped


def test_the_threshold_is_the_prediction_bound_at_level():
    # Exactly collinear good pairs (no residual) put the threshold on the line at f = 0.
    triples = [(p, 2.0 * f + 0.5, f) for f in np.linspace(-3, 3, 13) for p in GRID]
    rule = calibrate(triples, EarlyStopConfig(min_progress=0.0))
    assert all(t == pytest.approx(0.5, abs=1e-9) for t in rule.thresholds)


def test_crossing_curves_are_judged_at_the_best_final_seen():
    # Better finals come with HIGHER partials (a higher LR: worse mid-run, better at the
    # end): the worst case among candidates that end level or better is the best one seen.
    triples = [(p, -1.0 * f, f) for f in np.linspace(-3, 0, 10) for p in GRID]
    rule = calibrate(triples, EarlyStopConfig(min_progress=0.0, min_pairs=10))
    assert all(t == pytest.approx(3.0, abs=1e-9) for t in rule.thresholds)


def test_too_few_pairs_never_stop():
    rng = np.random.default_rng(2)
    rule = calibrate(_gaussian_pairs(rng, CFG.min_pairs - 1, 1.0, 0.1), CFG)
    assert not rule.active and "never stops" in rule.why and f"{CFG.min_pairs} needed" in rule.why
    assert stop_point(rule, {p: 1e9 for p in GRID}) is None
    # Enough pairs, but too few that ended level or better: never stops either.
    worse = [(p, d, abs(f) + 0.1) for p, d, f in _gaussian_pairs(rng, 40, 1.0, 0.1)]
    rule = calibrate(worse, CFG)
    assert not rule.active and "ended level or better" in rule.why
    assert not calibrate([], CFG).active


def test_never_before_min_progress_and_conservative_around_the_warm_down():
    rng = np.random.default_rng(3)
    triples = _gaussian_pairs(rng, 100, 1.0, 0.2)
    cfg = EarlyStopConfig(min_progress=0.3)
    plain = calibrate(triples, cfg)
    assert [p for p, t in zip(plain.points, plain.thresholds) if t is not None] == [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    shaped = calibrate(triples, cfg, shape_changes=[0.5])
    active = {p: t for p, t in zip(shaped.points, shaped.thresholds) if t is not None}
    # the windows (0.2, 0.5], (0.3, 0.6] and (0.4, 0.7] hold the change of slope
    assert set(active) == {0.3, 0.4, 0.8, 0.9}
    for p in (0.3, 0.4):  # before the change: eps / 10, a higher threshold
        assert active[p] > dict(zip(plain.points, plain.thresholds))[p]
    assert shaped.shape_changes == (0.5,)


def test_rule_round_trips_as_json():
    rng = np.random.default_rng(4)
    rule = calibrate(_gaussian_pairs(rng, 30, 1.0, 0.2), CFG, shape_changes=[0.5], budget={"max_steps": 60})
    again = StopRule.from_json(json.loads(json.dumps(rule.to_json(), allow_nan=False)))
    assert again == rule
    with pytest.raises(ValueError):
        StopRule.from_json({**rule.to_json(), "version": 99})
    assert never("off").to_json()["thresholds"] == [None] * len(GRID)


def test_config_errors_are_one_line():
    for bad in ({"eps": 0.0}, {"eps": 0.6}, {"min_progress": 1.0}, {"min_good": 3}, {"window": 0.0}):
        with pytest.raises(AutoloopError) as err:
            EarlyStopConfig(**bad)
        assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------
# Curves: progress in step and time mode, same-step pairing, schedules


def test_progress_in_step_mode_time_mode_and_from_progress_lines():
    assert progress_of({"step": 30}, {"max_steps": 60}) == 0.5
    assert progress_of({"step": 30, "seconds": 15.0}, {"time_budget": 60}) == 0.25
    # In step mode the step wins (a progress line's "progress" is its step's start): the
    # recorded curve the rule is calibrated on and the lines the worker reads agree.
    assert progress_of({"progress": 0.7, "step": 1}, {"max_steps": 60}) == pytest.approx(1 / 60)
    assert progress_of({"progress": 0.7, "step": 1, "seconds": 3.0}, {"time_budget": 60}) == 0.7
    assert progress_of({"progress": 0.7}, {"max_steps": 60}) == 0.7
    assert progress_of({"step": 90}, {"max_steps": 60}) == 1.0
    assert progress_of({"step": 3}, None) is None


def test_partial_difference_pairs_the_same_step_in_step_mode():
    rng = np.random.default_rng(5)
    batch = rng.normal(0, 0.3, 100)  # each step's batch difficulty, shared at the same seed
    inc = _curve(3.0 - np.linspace(0, 1, 100) + batch, 100)
    cand = _curve(3.0 - np.linspace(0, 1, 100) + batch + 0.05, 100)
    # The batch noise cancels exactly: every window's difference is the offset.
    for p in GRID:
        assert partial_difference(inc, cand, p, 0.1, {"max_steps": 100}) == pytest.approx(0.05, abs=1e-9)
    # Progress lines every 10 steps (as train.py logs them) still pair step for step.
    lines = [dict(pt, progress=(pt["step"] - 1) / 100) for pt in cand if (pt["step"] - 1) % 10 == 0]
    assert partial_difference(inc, lines, 0.5, 0.1, {"max_steps": 100}) == pytest.approx(0.05, abs=1e-9)
    assert partial_difference(inc, cand, 0.005, 0.01, {"max_steps": 100}) is None  # no point in the window


def test_partial_difference_interpolates_in_time_mode():
    # Time mode: the candidate is slower (fewer steps by the same progress); the incumbent's
    # linear loss curve is interpolated at the candidate's progress.
    inc = [{"step": k, "seconds": k * 0.5, "loss": 3.0 - k * 0.01} for k in range(1, 121)]  # 60 s budget
    cand = [{"step": k, "seconds": k * 0.75, "loss": 3.0 - k * 0.75 / 0.5 * 0.01 + 0.02} for k in range(1, 81)]
    d = partial_difference(inc, cand, 0.5, 0.1, {"time_budget": 60})
    assert d == pytest.approx(0.02, abs=1e-9)


def test_schedule_changes_found_in_the_lr_column():
    curve = _curve(np.ones(60), 60)
    assert schedule_changes(curve, {"max_steps": 60}) == pytest.approx([0.5], abs=0.02)
    warm = [{"step": k + 1, "loss": 1.0, "lr": _lr(k / 100, 0.3, warmup=0.1)} for k in range(100)]
    assert schedule_changes(warm, {"max_steps": 100}) == pytest.approx([0.1, 0.7], abs=0.02)
    assert schedule_changes([{"step": k, "loss": 1.0, "lr": 1.0} for k in range(1, 50)], {"max_steps": 50}) == []


def test_schedules_match_skips_a_candidate_on_another_schedule():
    inc, cand = _curve(np.ones(100), 100, warmdown=0.5), _curve(np.ones(100), 100, warmdown=0.3)
    budget = {"max_steps": 100}
    assert schedules_match(inc, cand, 0.4, 0.1, budget)  # both flat at the peak
    assert not schedules_match(inc, cand, 0.6, 0.1, budget)  # the incumbent already decays
    assert schedules_match(inc, inc, 0.9, 0.1, budget)


def test_should_stop_on_real_shaped_curves_step_mode():
    rng = np.random.default_rng(6)
    steps, budget = 100, {"max_steps": 100}
    cfg = EarlyStopConfig()
    base = 3.0 - 1.5 * np.sqrt(np.linspace(0, 1, steps))
    # Calibration: 30 candidates whose curves sit `gap` above the incumbent's, final = gap.
    triples = []
    for _ in range(30):
        gap = float(rng.normal(0, 0.05))
        batch = rng.normal(0, 0.2, steps)
        inc = _curve(base + batch, steps)
        cand = _curve(base + batch + gap + rng.normal(0, 0.01, steps), steps)
        triples += curve_pairs(inc, cand, gap, cfg, budget)
    changes = schedule_changes(inc, budget)
    rule = StopRule.from_json(json.loads(json.dumps(calibrate(triples, cfg, shape_changes=changes, budget=budget).to_json())))
    assert rule.active
    batch = rng.normal(0, 0.2, steps)
    inc = _curve(base + batch, steps)
    loser = _curve(base + batch + 0.3, steps)
    # Live: the candidate's progress lines (every 10 steps) as they arrive.
    lines = [dict(pt, progress=(pt["step"] - 1) / steps) for pt in loser if (pt["step"] - 1) % 10 == 0]
    stop, why, reached = should_stop(rule, inc, lines[:3])  # up to step 21: before min_progress's checkpoint
    assert not stop and reached == pytest.approx(0.21)
    stop, why, reached = should_stop(rule, inc, lines[:5])
    assert stop and reached == pytest.approx(0.41) and why.startswith("stopped early at 41% of the budget")
    level = _curve(base + batch, steps)
    assert not should_stop(rule, inc, level)[0]
    # A candidate with a shorter warm-down is not compared where the schedules differ.
    other = _curve(base + batch + 0.3, steps, warmdown=0.3)
    late = [pt for pt in other if pt["step"] > 55]
    assert not should_stop(rule, inc, late)[0]


def test_should_stop_in_time_mode():
    rng = np.random.default_rng(7)
    budget = {"time_budget": 50.0}
    triples = []
    for _ in range(20):
        gap = float(rng.normal(0, 0.05))
        inc = [{"step": k, "seconds": k * 0.5, "loss": 3.0 - 0.01 * k} for k in range(1, 101)]
        cand = [{"step": k, "seconds": k * 0.6, "loss": 3.0 - 0.012 * k + gap} for k in range(1, 84)]
        triples += curve_pairs(inc, cand, gap, budget=budget)
    rule = calibrate(triples, budget=budget)
    assert rule.active and rule.budget == budget
    cand = [{"step": k, "seconds": k * 0.6, "loss": 3.0 - 0.012 * k + 0.5} for k in range(1, 50)]
    stop, why, reached = should_stop(rule, inc, cand)
    assert stop and reached == pytest.approx(49 * 0.6 / 50)
    assert not should_stop(never("off"), inc, cand)[0]


def test_partial_differences_are_finite_numbers_only():
    inc = _curve([1.0, math.nan, 1.0, 1.0], 4)
    cand = _curve([1.1, 1.1, math.inf, 1.1], 4)
    assert partial_difference(inc, cand, 1.0, 1.0, {"max_steps": 4}) == pytest.approx(0.1)


def test_calibration_one_pair_at_a_time_is_the_batch_calibration():
    rng = np.random.default_rng(8)
    triples = _gaussian_pairs(rng, 40, 0.7, 0.3)
    running = Calibration()
    for t in triples:
        running.add(*t)
    assert running.rule(shape_changes=[0.5]) == calibrate(triples, shape_changes=[0.5])
    assert running.pairs == 40
    running.add(0.55, 1.0, 0.0)  # off the grid: ignored
    running.add(0.5, math.nan, 0.0)
    assert running.pairs == 40


# ---------------------------------------------------------------------------------------
# What the worker sees: a 40-step CPU run (docs/decisions.md, "A real CPU night")

STEPS40 = 40
BUDGET40 = {"max_steps": STEPS40}


def _pair40(rng, f, noise=0.15, diffs=None):
    """The incumbent's and a candidate's per-step curves (as recorded) of a 40-step run at one
    seed: a shared batch difficulty, and candidate minus incumbent = f + N(0, noise^2) per
    step (the early steps of two models differ by a lot at random), or `diffs` exactly."""
    base = 5.5 - 2.5 * np.sqrt(np.linspace(0, 1, STEPS40)) + rng.normal(0, 0.2, STEPS40)
    gap = np.asarray(diffs) if diffs is not None else f + rng.normal(0, noise, STEPS40)
    return _curve(base, STEPS40), _curve(base + gap, STEPS40)


def _lines(curve, every):
    """The progress lines the worker reads: train.py's records (progress at the step's start,
    (step - 1) / steps) every `every` steps and the last; every=1 is what it writes now."""
    return [dict(pt, progress=(pt["step"] - 1) / STEPS40) for pt in curve
            if (pt["step"] - 1) % every == 0 or pt["step"] == STEPS40]


def _old_progress(lines):
    """Before the fix the rule took a line's own "progress" even in step mode: drop the step."""
    return [{k: v for k, v in pt.items() if k != "step"} for pt in lines]


def _night40(seed=27, n=30):
    rng = np.random.default_rng(seed)
    triples = []
    for _ in range(n):
        f = float(rng.normal(0, 0.1))
        inc, cand = _pair40(rng, f)
        triples += curve_pairs(inc, cand, f, CFG, BUDGET40)
    return rng, calibrate(triples, CFG, shape_changes=schedule_changes(inc, BUDGET40), budget=BUDGET40)


def _first_stop(rule, inc, lines):
    """The number of lines read when the worker stops the run (None: never before its last line)."""
    for k in range(1, len(lines)):
        if should_stop(rule, inc, lines[:k])[0]:
            return k
    return None


def test_a_clear_loser_of_a_40_step_run_is_stopped_at_30_percent_from_the_lines_the_worker_reads():
    # Trial 27 of the real CPU night (MODEL_DIM 256 -> 64, +0.39 bpb at the end): far behind in
    # the first steps, +0.128 at step 11 (the one line the worker had in the 30% window), the mean
    # over the window's twelve steps +0.325, falling further behind late in the run.
    rng, rule = _night40()
    assert rule.active and rule.thresholds[GRID.index(0.3)] is not None
    t30 = rule.thresholds[GRID.index(0.3)]
    diffs = np.concatenate([[0.75, 0.6, 0.5, 0.45, 0.4, 0.3, 0.22, 0.15, 0.14, 0.13, 0.128, 0.12],
                            np.full(28, 0.125)])
    diffs[-10:] = 0.39
    inc, loser = _pair40(rng, 0.0, diffs=diffs)
    assert np.mean(diffs[:12]) == pytest.approx(0.325, abs=0.01)
    assert diffs[10] < t30 < np.mean(diffs[:12])  # the one line below the threshold, the window's mean above
    # Before: a line every LOG_EVERY = 10 steps, placed by its own progress: never stopped before it ended.
    assert _first_stop(rule, inc, _old_progress(_lines(loser, 10))) is None
    # Now: a line for every step the curve keeps, placed by its step: stopped once step 12 is in.
    lines = _lines(loser, 1)
    k = _first_stop(rule, inc, lines)
    assert k == 12
    stop, why, reached = should_stop(rule, inc, lines[:k])
    assert stop and reached == pytest.approx(0.3) and why.startswith("stopped early at 30% of the budget: at 30%")


def test_no_candidate_that_ends_better_than_the_incumbent_is_stopped_from_every_step():
    # 200 candidates of 40-step runs that end better (f < 0) and 200 that end level, on a rule
    # calibrated on the night's pairs: none of the better ones is stopped, and the level ones
    # about as often as eps (5%) promises. Read a line every 10 steps instead, the single
    # noisy points stop more level ones than promised.
    rng, rule = _night40(seed=33)
    better = [_pair40(rng, -abs(float(rng.normal(0, 0.1))) - 0.01) for _ in range(200)]
    assert sum(_first_stop(rule, inc, _lines(c, 1)) is not None for inc, c in better) == 0
    level = [_pair40(rng, 0.0) for _ in range(200)]
    now = sum(_first_stop(rule, inc, _lines(c, 1)) is not None for inc, c in level)
    old = sum(_first_stop(rule, inc, _old_progress(_lines(c, 10))) is not None for inc, c in level)
    assert now <= 0.05 * 200 * 1.6, now  # eps with room for the sampling (binomial sd ~3 of 10)
    assert old > now, (old, now)
