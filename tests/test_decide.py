"""The decision's statistics on inputs with known answers, and every branch of decide()."""

from __future__ import annotations

import json
import math
from statistics import NormalDist

import numpy as np
import pytest

from autoloop.decide.rule import (
    DecisionConfig, Noise, NoiseSums, Verdict, decide, decide_by_margin, estimate, keep_bound, noise_sums,
    paired_effect, pool_noise, sequential_bound, t_cdf, t_quantile,
)
from autoloop.errors import AutoloopError

SEEDS = [0, 1, 2, 3, 4, 5, 6]
CFG = DecisionConfig(max_runs=4)  # paired, baseline 3, alpha 0.05, futility -0.5
NOISE = Noise(run_sd=0.01, pair_sd=0.01, df=20)
INC = {0: 2.50, 1: 2.52, 2: 2.48}


# ---------------------------------------------------------------------------------------
# Student t against printed tables


@pytest.mark.parametrize("p, df, table", [
    (0.975, 1, 12.706), (0.975, 2, 4.303), (0.975, 5, 2.571), (0.975, 10, 2.228), (0.975, 30, 2.042),
    (0.95, 5, 2.015), (0.95, 1, 6.314), (0.99, 20, 2.528), (0.995, 3, 5.841), (0.9995, 1, 636.619),
    (0.9, 120, 1.289),
])
def test_t_quantile_matches_tables(p, df, table):
    assert t_quantile(p, df) == pytest.approx(table, abs=1e-3)
    assert t_quantile(1 - p, df) == pytest.approx(-table, abs=1e-3)


def test_t_cdf_known_values_and_limits():
    assert t_cdf(0.0, 3) == 0.5
    assert t_cdf(1.0, 1) == pytest.approx(0.75)  # Cauchy: 1/2 + atan(1)/pi
    assert t_cdf(-2.0, 2) == pytest.approx(0.5 - 1 / math.sqrt(6))  # closed form for df = 2
    assert t_cdf(1.96, math.inf) == pytest.approx(0.975, abs=1e-4)
    assert t_quantile(0.975, 1e9) == pytest.approx(1.959964, abs=1e-6)
    for df in (1, 4, 17):
        for p in (0.6, 0.9, 0.999):
            assert t_cdf(t_quantile(p, df), df) == pytest.approx(p, abs=1e-12)


@pytest.mark.parametrize("looks, pocock", [(2, 1.875), (3, 1.992), (4, 2.068), (5, 2.122)])
def test_sequential_bound_matches_pocock_tables(looks, pocock):
    # Without futility the bound is Pocock's constant (one-sided 0.05 = two-sided 0.10;
    # the two differ by paths crossing both ways, < 0.005 here).
    assert sequential_bound(0.05, looks, 100.0) == pytest.approx(pocock, abs=0.006)


def test_sequential_bound_with_futility_and_one_look():
    assert sequential_bound(0.05, 1, -0.5) == pytest.approx(1.644854, abs=1e-6)
    # A binding futility bound removes paths that could later cross: the bound can drop.
    assert sequential_bound(0.05, 4, -0.5) < sequential_bound(0.05, 4, 100.0)
    # Futility below the keep bound: only the first look ever decides.
    assert sequential_bound(0.05, 4, -3.0) == pytest.approx(1.644854, abs=1e-6)


def test_sequential_bound_type_one_by_simulation():
    rng = np.random.default_rng(2)
    c, f, looks = sequential_bound(0.05, 4, -0.5), -0.5, 4
    z = np.cumsum(rng.standard_normal((200_000, looks)), axis=1) / np.sqrt(np.arange(1, looks + 1))
    alive = np.ones(len(z), bool)
    kept = 0
    for n in range(looks):
        kept += int(np.sum(alive & (z[:, n] <= -c)))
        alive &= (z[:, n] > -c) & (z[:, n] < f)
    assert kept / len(z) == pytest.approx(0.05, abs=0.0025)


def test_keep_bound_is_the_sequential_level_in_t():
    c = sequential_bound(CFG.alpha, CFG.max_runs, CFG.futility)
    assert keep_bound(CFG, math.inf) == pytest.approx(-c, abs=1e-9)
    assert keep_bound(CFG, 5) == pytest.approx(t_quantile(NormalDist().cdf(-c), 5))
    assert keep_bound(CFG, 5) < keep_bound(CFG, 50) < -c + 1e-12


# ---------------------------------------------------------------------------------------
# Pooled noise


def test_pool_noise_on_constructed_groups():
    # Repeats [1, 2, 3]: SS 2 on 2 df (run variance 1); diffs [0.5, 1.5]: SS 0.5 on 1 df.
    noise = pool_noise([[1.0, 2.0, 3.0]], [[0.5, 1.5]])
    assert noise.df == 3
    assert noise.run_sd == pytest.approx(1.0)
    assert noise.pair_sd == pytest.approx(math.sqrt((2 * 2.0 + 0.5) / 3))
    # Only repeats: a paired difference is bounded by twice the run variance.
    only = pool_noise([[1.0, 2.0, 3.0], [5.0, 7.0]], [])
    assert only.run_sd == pytest.approx(math.sqrt((2.0 + 2.0) / 3))
    assert only.pair_sd == pytest.approx(math.sqrt(2) * only.run_sd)
    # Only differences: the run sd falls back to pair_sd / sqrt(2).
    diffs = pool_noise([], [[0.0, 2.0]])
    assert (diffs.pair_sd, diffs.df) == (pytest.approx(math.sqrt(2)), 1)
    assert diffs.run_sd == pytest.approx(1.0)


def test_pool_noise_ignores_group_means_and_singletons():
    # A true effect shifts a group's mean, never its spread: same noise either way.
    a = pool_noise([[1.0, 2.0, 3.0]], [[0.5, 1.5]])
    b = pool_noise([[101.0, 102.0, 103.0], [7.0]], [[-9.5, -8.5], [3.0]])
    assert a == b
    assert pool_noise([[1.0], [2.0]], [[0.3]]) is None
    assert pool_noise([], []) is None


def test_pool_noise_base_sums_add_up():
    groups, diffs = [[1.0, 2.0, 4.0], [3.0, 3.5]], [[0.1, -0.2, 0.4]]
    whole = pool_noise(groups, diffs)
    split = pool_noise(groups[1:], [], base=noise_sums(groups[:1], diffs))
    assert split.pair_sd == pytest.approx(whole.pair_sd) and split.df == whole.df
    assert NoiseSums() + NoiseSums(1.0, 1, 2.0, 2) == NoiseSums(1.0, 1, 2.0, 2)


def test_pool_noise_recovers_known_sd():
    rng = np.random.default_rng(0)
    sd_b, sd_e = 0.6, 0.8  # run sd 1.0, paired difference sd 0.8 * sqrt(2)
    repeats, diffs = [], []
    for _ in range(400):
        b = rng.normal(0, sd_b, 3)
        cand, inc = 0.3 + b + rng.normal(0, sd_e, 3), b + rng.normal(0, sd_e, 3)
        repeats.append(list(inc))
        diffs.append(list(cand - inc))
    assert pool_noise(repeats, []).run_sd == pytest.approx(1.0, rel=0.05)
    assert pool_noise([], diffs).pair_sd == pytest.approx(0.8 * math.sqrt(2), rel=0.05)


# ---------------------------------------------------------------------------------------
# estimate and paired_effect


def test_estimate():
    assert estimate([1.0, 2.0, 3.0], Noise(0.5, 0.7, 10)) == (2.0, pytest.approx(0.5 / math.sqrt(3)))
    assert estimate([1.0, 2.0, 3.0], None) == (2.0, pytest.approx(1.0 / math.sqrt(3)))
    assert estimate([2.5], None) == (2.5, None)
    with pytest.raises(ValueError):
        estimate([], None)


def test_paired_effect_interval():
    cand, inc = {0: 1.1, 1: 1.3, 2: 0.9, 9: 5.0}, {0: 1.0, 1: 1.0, 2: 1.0}
    mean, low, high = paired_effect(cand, inc, Noise(0.2, 0.3, 12), level=0.95)
    half = t_quantile(0.975, 12) * 0.3 / math.sqrt(3)
    assert mean == pytest.approx(0.1)
    assert (low, high) == (pytest.approx(0.1 - half), pytest.approx(0.1 + half))
    # Without noise: the differences' own spread, n - 1 df (diffs 0.1, 0.3, -0.1: sd 0.2).
    mean, low, high = paired_effect(cand, inc, None, level=0.9)
    assert high - mean == pytest.approx(t_quantile(0.95, 2) * 0.2 / math.sqrt(3))
    assert paired_effect({0: 1.0}, {0: 2.0}, None) == (-1.0, -math.inf, math.inf)
    with pytest.raises(ValueError):
        paired_effect({1: 1.0}, {0: 1.0}, None)


def test_interval_covers_at_its_level():
    rng = np.random.default_rng(1)
    hits = 0
    for _ in range(2000):
        inc = {s: float(rng.normal()) for s in range(3)}
        cand = {s: inc[s] + 0.5 + float(rng.normal(0, 0.3)) for s in range(3)}
        noise = pool_noise([], [[float(x) for x in rng.normal(0, 0.3, 4)] for _ in range(2)])
        _, low, high = paired_effect(cand, inc, noise, level=0.9)
        hits += low <= 0.5 <= high
    assert 0.87 < hits / 2000 < 0.93


# ---------------------------------------------------------------------------------------
# decide(): every branch


def _json(v: Verdict) -> dict:
    return json.loads(json.dumps(v.figures, allow_nan=False))


def test_baseline_is_measured_at_its_seeds_then_kept():
    v = decide({}, {}, None, CFG, SEEDS)
    assert (v.action, v.side, v.seed) == ("measure", "candidate", 0)
    v = decide({0: 2.5, 1: 2.6}, {}, None, CFG, SEEDS)
    assert (v.action, v.side, v.seed) == ("measure", "candidate", 2)
    v = decide(INC, {}, pool_noise([list(INC.values())], []), CFG, SEEDS)
    assert v.action == "keep" and v.reason.startswith("baseline: 2.5000 ± 0.0115 bpb over 3 seeds")
    assert _json(v)["n"] == 3


def test_keep_early_on_one_clearly_better_run():
    v = decide({0: 2.40}, INC, NOISE, CFG, SEEDS)
    assert v.action == "keep" and v.side is None
    assert v.reason == f"keep: -0.1000 ± 0.0100 bpb over 1 paired seed (t = -10.0, bound {keep_bound(CFG, 20):.1f})"
    f = _json(v)
    assert f["stopped"] == "keep bound" and f["n"] == 1 and f["t"] == pytest.approx(-10.0)
    assert f["interval"][1] < 0 and f["df"] == 20


def test_discard_after_one_clearly_worse_run():
    v = decide({0: 2.60}, INC, NOISE, CFG, SEEDS)
    assert v.action == "discard"
    assert "not better than the incumbent" in v.reason and _json(v)["stopped"] == "futility"
    assert _json(v)["near_miss"] is False


def test_discard_when_better_by_less_than_the_futility_bound():
    v = decide({0: 2.497}, INC, NOISE, CFG, SEEDS)  # t = -0.3: better, but by too little to chase
    assert v.action == "discard" and _json(v)["stopped"] == "futility" and _json(v)["near_miss"] is True
    assert v.reason.startswith("discard: -0.0030 ± 0.0100 bpb over 1 paired seed, too little better to measure again (t = -0.3 >= -0.5)")


def test_measure_the_candidate_again_when_promising_but_unproven():
    v = decide({0: 2.49}, INC, NOISE, CFG, SEEDS)  # t = -1: better, not yet proven
    assert (v.action, v.side, v.seed) == ("measure", "candidate", 1)
    assert v.reason.startswith("measure the candidate at seed 1: -0.0100 ± 0.0100 bpb over 1 paired seed")
    assert _json(v)["stopped"] == "continue"


def test_next_candidate_seed_prefers_seeds_the_incumbent_has():
    v = decide({0: 2.49}, {0: 2.50, 3: 2.51}, NOISE, CFG, SEEDS)
    assert (v.side, v.seed) == ("candidate", 3)
    v = decide({0: 2.49, 1: 2.51}, {0: 2.50, 1: 2.515}, NOISE, CFG, SEEDS)
    assert (v.side, v.seed) == ("candidate", 2)  # the incumbent lacks 2: it will be paired after


def test_measure_the_incumbent_on_a_seed_the_candidate_has():
    cand = {0: 2.49, 1: 2.51, 2: 2.47, 3: 2.50}
    v = decide(cand, INC, NOISE, CFG, SEEDS)
    assert (v.action, v.side, v.seed) == ("measure", "incumbent", 3)
    assert _json(v)["stopped"] == "pairing"


def test_max_runs_then_discard_as_a_near_miss():
    inc = {**INC, 3: 2.50}
    cand = {s: inc[s] - 0.004 for s in range(4)}  # t = -0.8 at n = 4
    v = decide(cand, inc, NOISE, CFG, SEEDS)
    assert v.action == "discard" and "after 4 runs" in v.reason
    f = _json(v)
    assert f["stopped"] == "max runs" and f["near_miss"] is True and f["n"] == 4


def test_keep_after_several_runs():
    inc = {**INC, 3: 2.50}
    cand = {s: inc[s] - 0.013 for s in range(4)}  # t = -2.6 at n = 4, bound -2.4
    v = decide(cand, inc, NOISE, CFG, SEEDS)
    assert v.action == "keep" and "over 4 paired seeds" in v.reason


def test_no_seed_left_is_a_discard():
    v = decide({0: 2.49}, {0: 2.50}, NOISE, CFG, [0])
    assert v.action == "discard" and _json(v)["stopped"] == "no seeds left"


def test_zero_noise_decides_by_the_sign():
    zero = Noise(0.0, 0.0, 5)
    assert decide({0: 2.4999}, INC, zero, CFG, SEEDS).action == "keep"
    assert decide({0: 2.50}, INC, zero, CFG, SEEDS).action == "discard"
    _json(decide({0: 2.4999}, INC, zero, CFG, SEEDS))  # no inf in the stored figures


def test_without_noise_the_sign_decides_then_its_own_spread():
    # noise None (baseline-seeds = 1, nothing repeated yet): a worse run is discarded,
    # a better one measured again; with two pairs the comparison's own spread is the noise.
    inc = {0: 2.50, 1: 2.50}
    assert decide({0: 2.51}, inc, None, CFG, SEEDS).action == "discard"
    v = decide({0: 2.40}, inc, None, CFG, SEEDS)
    assert (v.action, v.side, v.seed) == ("measure", "candidate", 1)
    assert "no noise measured yet" in v.reason
    v = decide({0: 2.40, 1: 2.41}, inc, None, CFG, SEEDS)
    f = _json(v)
    assert f["noise_source"] == "own" and f["df"] == 3
    assert v.action == "keep"  # spread 0.007 over 3 df vs a 0.095 mean


def test_strict_rule():
    strict = DecisionConfig(rule="strict")
    v = decide({}, INC, None, strict, SEEDS)
    assert (v.action, v.side, v.seed) == ("measure", "candidate", 0)
    assert decide({0: 2.499}, INC, None, strict, SEEDS).action == "keep"
    assert decide({0: 2.501}, INC, None, strict, SEEDS).action == "discard"
    v = decide({0: 2.49}, {1: 2.6}, None, strict, SEEDS)
    assert (v.action, v.side, v.seed) == ("measure", "incumbent", 0)
    margin = DecisionConfig(rule="strict", margin=0.02)
    assert decide({0: 2.49}, INC, None, margin, SEEDS).action == "discard"
    assert decide({0: 2.47}, INC, None, margin, SEEDS).action == "keep"
    assert _json(decide({0: 2.47}, INC, None, margin, SEEDS))["mean_diff"] == pytest.approx(-0.03)


def test_decide_by_margin():
    assert decide_by_margin(2.0, None).keep
    assert decide_by_margin(1.9, 2.0).keep and not decide_by_margin(2.0, 2.0).keep
    assert not decide_by_margin(1.95, 2.0, margin=0.1).keep
    assert "by more than 0.1" in decide_by_margin(1.95, 2.0, margin=0.1).reason


def test_defaults_are_the_documented_ones():
    d = DecisionConfig()
    assert (d.rule, d.baseline_seeds, d.max_runs, d.alpha, d.futility, d.margin, d.level) == (
        "paired", 3, 5, 0.05, -0.5, 0.0, 0.95)
    assert sequential_bound(0.05, 5, -0.5) == pytest.approx(2.04, abs=0.01)


@pytest.mark.parametrize("kwargs", [
    {"rule": "bayes"}, {"baseline_seeds": 0}, {"max_runs": 0}, {"alpha": 0.0}, {"alpha": 0.7},
    {"level": 1.0}, {"margin": -1.0},
])
def test_config_errors_are_one_line(kwargs):
    with pytest.raises(AutoloopError) as err:
        DecisionConfig(**kwargs)
    assert "\n" not in str(err.value)


def test_false_keeps_of_a_null_candidate_stay_below_alpha_with_estimated_noise():
    # The bound's promise, checked directly: a null candidate (true difference 0) paired
    # with an incumbent, the noise estimated from just the baseline's 3 runs and the
    # comparison's own runs (the least the loop ever has), is kept at most alpha of the time.
    rng = np.random.default_rng(3)
    kept, trials = 0, 4000
    for _ in range(trials):
        b = rng.normal(0, 0.7, 8)
        base = list(b[:3] + rng.normal(0, 0.7, 3))
        inc = {s: base[s] for s in range(3)}
        cand: dict[int, float] = {}
        while True:
            shared = [s for s in cand if s in inc]
            noise = pool_noise([list(inc.values()), list(cand.values())], [[cand[s] - inc[s] for s in shared]])
            v = decide(cand, inc, noise, CFG, SEEDS)
            if v.action != "measure":
                break
            side = cand if v.side == "candidate" else inc
            side[v.seed] = float(b[v.seed] + rng.normal(0, 0.7))
        kept += v.action == "keep"
    assert kept / trials <= 0.05
