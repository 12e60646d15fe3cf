"""The decision's statistics on inputs with known answers, and every branch of decide()."""

from __future__ import annotations

import json
import math
from statistics import NormalDist

import numpy as np
import pytest

from autoloop.decide.rule import (
    RULES, DecisionConfig, Noise, NoiseSums, Verdict, confirm_constant, decide, decide_by_margin, estimate, keep_bound,
    noise_sums, paired_effect, pool_noise, sequential_bound, t_cdf, t_quantile,
)
from autoloop.errors import AutoloopError

SEEDS = [0, 1, 2, 3, 4, 5, 6]
CFG = DecisionConfig(rule="confirmed-only", max_runs=4)  # baseline 3, alpha 0.05, futility -0.5
TWO = DecisionConfig(max_runs=4, promising=-1.0)  # two-tier with a second look at t < -1
ONE = DecisionConfig()  # two-tier as by default: adopt on the first pair
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
    assert v.reason == (f"keep (confirmed): -0.1000 ± 0.0100 bpb over 1 paired seed (t = -10.0, "
                        f"bound {keep_bound(CFG, 20):.1f})")
    f = _json(v)
    assert f["stopped"] == "keep bound" and f["n"] == 1 and f["t"] == pytest.approx(-10.0)
    assert f["tier"] == "confirmed" and f["confirmed"] is True
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
    v = decide({}, {}, None, strict, SEEDS)
    assert (v.action, v.seed) == ("measure", 0)
    v = decide({0: 2.5}, {}, None, strict, SEEDS)
    assert v.action == "keep" and "over 1 seed" in v.reason  # the controller measures a strict baseline once
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
    assert (d.rule, d.baseline_seeds, d.max_runs, d.alpha, d.futility, d.promising, d.adopt, d.margin, d.level,
            d.reserve_seeds) == ("two-tier", 3, 5, 0.05, -0.5, None, 0.0, 0.0, 0.95, 4)
    assert sequential_bound(0.05, 5, -0.5) == pytest.approx(2.04, abs=0.01)
    assert confirm_constant(d) == pytest.approx(1.644854, abs=1e-6)  # one look
    assert confirm_constant(TWO) == pytest.approx(sequential_bound(0.05, 4, -1.0))
    assert confirm_constant(DecisionConfig(rule="strict")) == pytest.approx(1.644854, abs=1e-6)
    assert DecisionConfig(rule="paired").sequential == "confirmed-only"
    assert DecisionConfig(rule="strict").baseline_runs == 1 and d.baseline_runs == 3


@pytest.mark.parametrize("kwargs", [
    {"rule": "bayes"}, {"baseline_seeds": 0}, {"max_runs": 0}, {"alpha": 0.0}, {"alpha": 0.7},
    {"level": 1.0}, {"margin": -1.0}, {"promising": 0.5}, {"adopt": 0.1}, {"reserve_seeds": -1},
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


# ---------------------------------------------------------------------------------------
# Two tiers: adopted on the paired mean, confirmed by the sequential test


def test_two_tier_confirms_a_clear_gain_on_one_run():
    v = decide({0: 2.40}, INC, NOISE, TWO, SEEDS)
    f = _json(v)
    assert v.action == "keep" and f["tier"] == "confirmed" and f["confirmed"] is True
    assert v.reason.startswith("keep (confirmed): -0.1000")


def test_two_tier_by_default_adopts_on_the_first_pair():
    for x, tier in ((2.485, "adopted"), (2.499, "adopted"), (2.47, "confirmed")):  # t = -1.5, -0.1, -3
        v = decide({0: x}, INC, NOISE, ONE, SEEDS)
        assert v.action == "keep" and _json(v)["tier"] == tier
    assert decide({0: 2.50}, INC, NOISE, ONE, SEEDS).action == "discard"
    # An adoption margin (adopt = -0.25 standard errors): a hair lower is not enough.
    assert decide({0: 2.499}, INC, NOISE, DecisionConfig(adopt=-0.25), SEEDS).action == "discard"
    assert decide({0: 2.497}, INC, NOISE, DecisionConfig(adopt=-0.25), SEEDS).action == "keep"


def test_two_tier_adopts_a_small_gain_without_confirming_it():
    v = decide({0: 2.495}, INC, NOISE, TWO, SEEDS)  # t = -0.5: lower, not promising enough to look again
    f = _json(v)
    assert v.action == "keep" and f["tier"] == "adopted" and f["confirmed"] is False
    assert f["stopped"] == "paired mean" and v.reason.startswith("adopt: -0.0050 ± 0.0100 bpb over 1 paired seed")


def test_two_tier_looks_again_at_what_looks_too_good():
    v = decide({0: 2.485}, INC, NOISE, TWO, SEEDS)  # t = -1.5: better than it may be
    assert (v.action, v.side, v.seed) == ("measure", "candidate", 1)
    assert "better than it may be" in v.reason
    # The second pair pulls the mean back: adopted (lower on average), not confirmed.
    v = decide({0: 2.485, 1: 2.52}, INC, NOISE, TWO, SEEDS)  # mean -0.0075, t = -1.06 at n = 2
    assert (v.action, v.seed) == ("measure", 2)
    v = decide({0: 2.485, 1: 2.52, 2: 2.49}, INC, NOISE, TWO, SEEDS)  # mean -0.005, t = -0.87
    assert v.action == "keep" and _json(v)["tier"] == "adopted" and _json(v)["n"] == 3
    # ... or ends it worse on average: discarded.
    v = decide({0: 2.485, 1: 2.56}, INC, NOISE, TWO, SEEDS)
    assert v.action == "discard" and _json(v)["stopped"] == "not better" and _json(v)["tier"] is None


def test_two_tier_discards_what_is_not_lower_and_adopts_at_max_runs():
    v = decide({0: 2.50}, INC, NOISE, TWO, SEEDS)
    assert v.action == "discard" and _json(v)["confirmed"] is False and _json(v)["near_miss"] is False
    inc = {**INC, 3: 2.50}
    cand = {s: inc[s] - 0.009 for s in range(4)}  # t = -1.8 at n = 4 = max_runs: not confirmed (bound -2.2)
    v = decide(cand, inc, NOISE, TWO, SEEDS)
    assert v.action == "keep" and _json(v)["tier"] == "adopted"
    v = decide({0: 2.485}, {0: 2.50}, NOISE, TWO, [0])  # promising, no seed left: adopted on the mean
    assert v.action == "keep" and _json(v)["tier"] == "adopted"


def test_two_tier_without_noise_adopts_on_the_sign():
    assert _json(decide({0: 2.49}, {0: 2.50}, None, TWO, SEEDS))["tier"] == "adopted"
    assert decide({0: 2.51}, {0: 2.50}, None, TWO, SEEDS).action == "discard"


def test_strict_rule_reports_a_confirmed_tier_when_noise_is_known():
    strict = DecisionConfig(rule="strict")
    v = decide({0: 2.40}, INC, NOISE, strict, SEEDS)  # t = -10 against the one-look bound -1.72 (df 20)
    assert v.action == "keep" and _json(v)["tier"] == "confirmed" and v.reason.startswith("keep (confirmed)")
    v = decide({0: 2.495}, INC, NOISE, strict, SEEDS)
    assert v.action == "keep" and _json(v)["tier"] == "adopted"
    v = decide({0: 2.495}, INC, None, strict, SEEDS)
    assert _json(v)["confirmed"] is False and _json(v)["tier"] == "adopted"
    assert _json(decide({0: 2.6}, INC, NOISE, strict, SEEDS))["tier"] is None


@pytest.mark.parametrize("rule", RULES)
def test_every_decided_verdict_carries_both_tiers(rule):
    cfg = DecisionConfig(rule=rule, max_runs=4)
    for cand in ({0: 2.40}, {0: 2.495}, {0: 2.60}, {0: 2.49, 1: 2.51, 2: 2.47, 3: 2.49}):
        inc = {**INC, 3: 2.50}
        v = decide(cand, inc, NOISE, cfg, SEEDS)
        if v.action == "measure":
            continue
        f = _json(v)
        assert f["confirmed"] in (True, False) and f["tier"] in ("adopted", "confirmed", None)
        assert (f["tier"] is None) == (v.action == "discard")
        assert f["confirmed"] == (f["tier"] == "confirmed")


def test_two_tier_confirmation_bound_by_simulation():
    # Known noise, null paths, the two-tier continuation region (-c, promising): the chance
    # of ever confirming is alpha; the chance of adopting at all is what the sign gives.
    rng = np.random.default_rng(5)
    looks, f = 5, -1.0
    c = sequential_bound(0.05, looks, f)
    z = np.cumsum(rng.standard_normal((200_000, looks)), axis=1) / np.sqrt(np.arange(1, looks + 1))
    alive = np.ones(len(z), bool)
    confirmed = 0
    for n in range(looks):
        confirmed += int(np.sum(alive & (z[:, n] <= -c)))
        alive &= (z[:, n] > -c) & (z[:, n] < f)
    assert confirmed / len(z) == pytest.approx(0.05, abs=0.0025)


@pytest.mark.parametrize("cfg", [ONE, DecisionConfig(promising=-1.0)], ids=["default", "second look"])
def test_two_tier_null_candidates_are_confirmed_at_most_alpha_with_estimated_noise(cfg):
    # A null candidate against the baseline, the noise from the baseline's 3 runs and the
    # comparison's own (the least the loop ever has): confirmed <= alpha; adopted about
    # half the time (the sign of a null difference), as the strict rule would.
    rng = np.random.default_rng(6)
    confirmed = kept = 0
    trials = 4000
    seeds = list(range(9))
    for _ in range(trials):
        b = rng.normal(0, 0.7, 9)
        inc = {s: float(b[s] + rng.normal(0, 0.7)) for s in range(3)}
        cand: dict[int, float] = {}
        while True:
            shared = [s for s in cand if s in inc]
            noise = pool_noise([list(inc.values()), list(cand.values())], [[cand[s] - inc[s] for s in shared]])
            v = decide(cand, inc, noise, cfg, seeds)
            if v.action != "measure":
                break
            side = cand if v.side == "candidate" else inc
            side[v.seed] = float(b[v.seed] + rng.normal(0, 0.7))
        kept += v.action == "keep"
        confirmed += bool(v.figures.get("confirmed"))
    assert confirmed / trials <= 0.05
    assert 0.45 < kept / trials < 0.55


def test_two_tier_with_one_look_is_the_sign_rule():
    # max_runs 1: adopt exactly when the one paired difference is negative; confirmed when
    # it also passes the one-look bound: P = Phi(-1.645) = 5% for a null with known noise.
    rng = np.random.default_rng(7)
    cfg = DecisionConfig(max_runs=1, promising=-1.0)
    noise = Noise(run_sd=1.0, pair_sd=1.0, df=10**8)
    d = rng.standard_normal(20000)
    verdicts = [decide({0: float(x)}, {0: 0.0}, noise, cfg, SEEDS) for x in d]
    assert [v.action == "keep" for v in verdicts] == list(d < 0)
    confirmed = np.mean([bool(v.figures["confirmed"]) for v in verdicts])
    assert confirmed == pytest.approx(0.05, abs=0.005)


def test_two_tier_adopts_exactly_when_the_strict_rule_keeps():
    # The default adopts on the sign of the first paired difference, as the strict rule
    # keeps: the same verdict on the same runs, whatever the noise (its harmful adoptions
    # can differ from strict's only through the night's path, never per decision).
    rng = np.random.default_rng(8)
    strict = DecisionConfig(rule="strict")
    for _ in range(3000):
        inc = {s: float(rng.normal(2.5, 0.02)) for s in range(3)}
        cand = {0: float(inc[0] + rng.normal(0, 0.02))}
        noise = Noise(run_sd=float(rng.uniform(0.001, 0.05)), pair_sd=float(rng.uniform(0.001, 0.05)),
                      df=int(rng.integers(2, 60)))
        assert decide(cand, inc, noise, ONE, SEEDS).action == decide(cand, inc, noise, strict, SEEDS).action


# ---------------------------------------------------------------------------------------
# The headline (autoloop/decide/remeasure.py): value and gain from the reserve's fresh seeds

from autoloop.decide.remeasure import RESERVE_OFFSET, headline, reserve_plan, reserve_seeds, reserve_size  # noqa: E402


def test_reserve_size_scales_with_the_night():
    assert [reserve_size(r) for r in (20, 50, 75, 100, 300)] == [2, 2, 3, 4, 4]
    assert reserve_size(300, most=8) == 8 and reserve_size(10, most=1) == 1


def test_reserve_seeds_are_far_from_every_decision_seed_and_the_plan_lists_what_is_missing():
    assert reserve_seeds(1337, 3) == [1337 + RESERVE_OFFSET + k for k in range(3)]
    fresh = reserve_seeds(1337, 2)
    assert reserve_plan({}, {0: 2.5}, 1337, 2) == [("best", fresh[0]), ("best", fresh[1])]
    assert reserve_plan({}, {}, 1337, 2, baseline=True) == [("best", fresh[0]), ("baseline", fresh[0]),
                                                           ("best", fresh[1]), ("baseline", fresh[1])]
    assert reserve_plan({fresh[0]: 2.4}, {fresh[0]: 2.5, fresh[1]: 2.5}, 1337, 2, baseline=True) == [("best", fresh[1])]
    assert reserve_plan({}, {}, 1337, 2, baseline=True, same_commit=True) == [("best", fresh[0]), ("best", fresh[1])]


def test_headline_paired_unpaired_and_same_commit():
    noise = Noise(run_sd=0.02, pair_sd=0.01, df=30)
    best, base = {10: 2.40, 11: 2.42, 12: 2.38, 13: 2.40}, {10: 2.50, 11: 2.51, 12: 2.49, 13: 2.50}
    h = headline(best, base, noise)
    assert h.paired and h.n == 4 and h.df == 30
    assert h.value == pytest.approx(2.40) and h.value_se == pytest.approx(0.01)
    assert h.gain == pytest.approx(0.10) and h.gain_se == pytest.approx(0.005)
    half = t_quantile(0.975, 30) * 0.005
    assert h.interval == (pytest.approx(0.10 - half), pytest.approx(0.10 + half))
    # Unpaired (the baseline's own runs at decision seeds), the runs' own spread (no noise).
    h = headline(best, {0: 2.50, 1: 2.52, 2: 2.48}, None)
    assert not h.paired and h.gain == pytest.approx(0.10)
    ss = sum((v - 2.40) ** 2 for v in best.values()) + sum((v - 2.50) ** 2 for v in (2.50, 2.52, 2.48))
    assert h.gain_se == pytest.approx(math.sqrt(ss / 5 * (1 / 4 + 1 / 3))) and h.df == 5
    # Only the reserve's seeds count when they are given.
    h = headline({**best, 0: 1.0}, base, noise, seeds=list(best))
    assert h.value == pytest.approx(2.40) and 0 not in h.seeds
    h = headline(best, best, noise, same_commit=True)
    assert (h.gain, h.gain_se, h.interval) == (0.0, 0.0, (0.0, 0.0))
    json.dumps(headline(best, {0: 2.5}, None).to_json(), allow_nan=False)  # one run each side: no interval, no inf
    with pytest.raises(ValueError):
        headline({}, base, noise)


def test_headline_takes_the_pairs_own_spread_when_it_is_the_larger():
    # The night's pooled noise says pair sd 0.01; four fresh pairs of a best far from the
    # baseline spread by sd sqrt(0.025 / 3) = 0.0913: the gain's se is that over sqrt(4), at 3 df.
    noise = Noise(run_sd=0.02, pair_sd=0.01, df=30)
    base = {10: 2.50, 11: 2.50, 12: 2.50, 13: 2.50}
    best = {10: 2.50, 11: 2.30, 12: 2.45, 13: 2.35}  # differences 0.0, 0.2, 0.05, 0.15
    h = headline(best, base, noise)
    assert h.gain == pytest.approx(0.10) and h.df == 3
    assert h.gain_se == pytest.approx(math.sqrt(0.025 / 3) / 2)
    half = t_quantile(0.975, 3) * h.gain_se
    assert h.interval == (pytest.approx(0.10 - half), pytest.approx(0.10 + half))


def test_the_paired_interval_still_covers_when_the_best_is_noisier_than_the_night():
    # The night's noise pooled from small changes (pair sd 1, 40 df), but the best's pairs
    # with the baseline spread 4 times as much: on the pooled noise alone the 95% interval
    # would hold the true gain about a third of the time; with the pairs' own spread, at
    # least at its level.
    rng = np.random.default_rng(21)
    true_gain, n, trials, hits, pooled_only = 0.5, 4, 4000, 0, 0
    for _ in range(trials):
        d = true_gain + rng.normal(0, 4.0, n)
        base = {100 + k: 10.0 for k in range(n)}
        best = {100 + k: 10.0 - d[k] for k in range(n)}
        h = headline(best, base, Noise(run_sd=1 / math.sqrt(2), pair_sd=1.0, df=40))
        hits += h.interval[0] <= true_gain <= h.interval[1]
        half = t_quantile(0.975, 40) * 1.0 / math.sqrt(n)
        pooled_only += abs(d.mean() - true_gain) <= half
    assert pooled_only / trials < 0.5
    assert hits / trials >= 0.94


def test_headline_is_unbiased_and_its_interval_covers_at_its_level():
    # A known gain of 0.3 (sd units), seed luck half shared: the value is unbiased and the
    # 95% interval holds the true gain about 95% of the time, paired or not.
    rng = np.random.default_rng(9)
    true_gain, n, trials = 0.3, 4, 4000
    hits = {"paired": 0, "unpaired": 0}
    values = []
    for _ in range(trials):
        b = rng.normal(0, math.sqrt(0.5), 3 + n)
        best = {100 + k: -true_gain + b[3 + k] + rng.normal(0, math.sqrt(0.5)) for k in range(n)}
        fresh_base = {100 + k: b[3 + k] + rng.normal(0, math.sqrt(0.5)) for k in range(n)}
        own_base = {k: b[k] + rng.normal(0, math.sqrt(0.5)) for k in range(3)}
        # the night's pooled noise: 40 df of independent repeats and paired differences
        repeats = [list(rng.normal(0, 1, 3)) for _ in range(10)]
        diffs = [list(rng.normal(0, 1, 3)) for _ in range(10)]
        noise = pool_noise(repeats, diffs)
        for kind, baseline in (("paired", fresh_base), ("unpaired", own_base)):
            h = headline(best, baseline, noise)
            hits[kind] += h.interval[0] <= true_gain <= h.interval[1]
        values.append(headline(best, own_base, noise).value)
    assert np.mean(values) == pytest.approx(-true_gain, abs=0.03)
    assert 0.93 <= hits["unpaired"] / trials <= 0.97
    assert hits["paired"] / trials >= 0.95  # pair_sd is conservative: about 2 run variances, here the truth is 1
