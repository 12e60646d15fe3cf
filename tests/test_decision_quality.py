"""The night simulator on known answers, and the issue's targets at a fixed seed (fast).

The targets are asserted on the mechanistic realistic mix (`Landscape`); the known
answers cover both worlds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from autoloop.decide.rule import DecisionConfig
from autoloop.decide.simulate import ALL_NULL, CODE, HP, Landscape, Mix, World, draw_nights, simulate, targets

STRICT = DecisionConfig(rule="strict")
OURS = DecisionConfig()
N_SEEDS = OURS.baseline_seeds + OURS.max_runs


def test_all_null_nights_do_not_change_the_true_quality():
    world = World(runs=60)
    for cfg in (STRICT, OURS):
        s = simulate(cfg, nights=100, world=world, mix=ALL_NULL, seed=1)
        assert s.quality == 0.0 and s.null == s.decided > 0
        assert s.harmful == s.helpful == 0
    # ... yet the strict rule reports a best that is better than it is (the winner's curse).
    assert simulate(STRICT, nights=100, world=world, mix=ALL_NULL, seed=1).winners_curse < -1.0


def test_strict_false_keeps_on_null_nights_follow_the_record_count():
    # With no shared seed component every null run at seed 0 is an independent N(0, 1) draw,
    # and the strict rule keeps exactly the draws that beat every earlier one: the k-th
    # proposal is a new record with probability 1/(k+1), so m proposals give H(m+1) - 1 keeps.
    world = World(runs=53, shared=0.0)  # 3 baseline runs, then 50 proposals of one run each
    s = simulate(STRICT, nights=1500, world=world, mix=ALL_NULL, seed=2)
    m = 50
    expected = (sum(1 / k for k in range(1, m + 2)) - 1) / m
    assert s.decided == 1500 * m
    se = math.sqrt(expected / (1500 * m))  # keeps within a night are independent events
    assert s.false_keep_rate == pytest.approx(expected, abs=4 * se)


def test_without_noise_the_strict_rule_is_perfect():
    world, mix = World(runs=60), Mix()
    draws = draw_nights(200, world, mix, N_SEEDS, 3)
    draws["own"][:] = 0.0
    draws["lineage"][:] = 0.0
    s = simulate(STRICT, nights=200, world=world, mix=mix, draws=draws)
    assert s.null_kept == s.harmful_kept == 0
    assert s.helpful_kept == s.helpful > 0 and s.big_kept_share == 1.0
    assert s.winners_curse == 0.0
    # the best reachable: every helpful effect among the decided proposals, and nothing else
    helpful = draws["effects"][:, : world.runs - 3][draws["kinds"][:, : world.runs - 3] == 3]
    assert s.quality == pytest.approx(-helpful.sum() / 200)
    # ours too, at one run a proposal: the sign of one paired difference is the answer
    p = simulate(OURS, nights=200, world=world, mix=mix, draws=draws)
    assert p.quality == pytest.approx(s.quality) and p.runs_per_proposal == 1.0


def test_ours_keeps_no_more_null_proposals_than_alpha():
    for shared in (0.0, 0.9):
        s = simulate(OURS, nights=150, world=World(runs=100, shared=shared), mix=ALL_NULL, seed=4)
        assert s.false_keep_rate <= OURS.alpha
        assert s.redraw_keep_rate <= OURS.alpha


def test_equal_compute_and_clearly_worse_costs_one_run():
    # A night of only badly harmful proposals: each is discarded after its one run.
    bad = Mix(null=0.0, redraw=0.0, harmful=1.0, helpful=0.0, harmful_range=(20.0, 30.0))
    s = simulate(OURS, nights=20, world=World(runs=50), mix=bad, seed=5)
    assert s.runs_per_proposal == 1.0 and s.decided == 20 * 47 and s.harmful_kept == 0


def _greedy(draws: dict, j: int, proposals: int) -> tuple[float, float]:
    """Night j without noise, written out independently: keep exactly the proposals whose
    true effect, from the current incumbent, is negative. -> (final true value, final excess)."""
    k, x = draws["curvature"][j], draws["start"][j].copy()
    mu = 0.0
    for i in range(proposals):
        kind = draws["kinds"][j, i]
        if kind == HP:
            c, step = draws["coord"][j, i], draws["step"][j, i]
            effect = k[c] * ((x[c] + step) ** 2 - x[c] ** 2)
            if effect < 0:
                x[c] += step
                mu += effect
        elif kind == CODE and draws["code_effect"][j, i] < 0:
            mu += draws["code_effect"][j, i]
    return mu, float(np.sum(k * x * x))


def test_landscape_without_noise_both_rules_descend_greedily():
    world, land = World(runs=60), Landscape()
    draws = draw_nights(100, world, land, N_SEEDS, 8)
    draws["own"][:] = 0.0
    draws["lineage"][:] = 0.0
    for cfg in (STRICT, OURS):
        s = simulate(cfg, nights=100, world=world, mix=land, draws=draws)
        assert s.null_kept == s.harmful_kept == 0 and s.runs_per_proposal == 1.0
        assert s.helpful_kept == s.helpful > 0 and s.winners_curse == 0.0
        for j in range(100):
            mu, excess = _greedy(draws, j, world.runs - 3)
            assert s.final_true[j] == pytest.approx(mu, abs=1e-9)
            assert s.excess[j] == pytest.approx(excess, abs=1e-9)


def test_a_step_is_judged_from_the_incumbent_it_starts_from():
    # One bowl, k = 1, the night starts 1 (log2) above the optimum, steps of exactly 1:
    # the first step down gains 1 and reaches the bottom; every step after it, and every
    # step up before it, costs (2 or 1 up: 3 from the start, 1 from the bottom).
    world = World(runs=23)  # 3 baseline runs, 20 proposals
    land = Landscape(hyperparameters=1, curvature=(1.0, 1.0), steps=(1.0,), hp=1.0, redraw=0.0, code=0.0)
    draws = draw_nights(300, world, land, N_SEEDS, 9)
    draws["own"][:] = 0.0
    draws["lineage"][:] = 0.0
    draws["start"][:] = 1.0
    s = simulate(STRICT, nights=300, world=world, mix=land, draws=draws)
    down = (draws["step"][:, :20] < 0).any(axis=1)
    assert s.final_true == [-1.0 if d else 0.0 for d in down]
    assert s.excess == [0.0 if d else 1.0 for d in down]
    assert s.helpful_kept == s.helpful == int(down.sum()) and s.harmful_kept == 0


def test_landscape_nights_of_re_draws_only_stay_where_they_started():
    land = Landscape(hp=0.0, redraw=1.0, code=0.0)
    for cfg in (STRICT, OURS):
        s = simulate(cfg, nights=60, world=World(runs=60), mix=land, seed=10)
        assert s.quality == 0.0 and s.null == s.redraw == s.decided > 0
        assert s.excess == s.start_excess


def test_the_landscape_is_calibrated_to_reported_keep_rates():
    # Loops that keep any lower number report keeping ~15% of ~100 proposals a night and a
    # few percent late in long runs (docs/decisions.md): the strict rule in this world.
    s = simulate(STRICT, nights=200, world=World(), mix=Landscape(), seed=11)
    assert 0.08 <= s.keep_rate <= 0.20
    assert s.late_keep_rate < 0.7 * s.keep_rate


@pytest.fixture(scope="module")
def realistic():
    nights, world, land = 250, World(), Landscape()
    draws = draw_nights(nights, world, land, N_SEEDS, 6)
    return (simulate(STRICT, nights=nights, world=world, mix=land, draws=draws),
            simulate(OURS, nights=nights, world=world, mix=land, draws=draws))


@pytest.mark.parametrize("target", [
    "false keeps <= 5% per null proposal",
    ">= 80% of improvements of 2 sigma or more kept",
    "winner's curse <= 1/3 of strict's",
])
def test_targets_on_the_realistic_mix(realistic, target):
    figures, met = targets(*realistic)[target]
    assert met, f"{target}: {figures}"


@pytest.mark.xfail(strict=True, reason="not met, in the mechanistic world either: at equal compute the strict rule's "
                                        "one noisy look per proposal descends further (docs/decisions.md, 'What it costs')")
def test_target_final_quality_beats_strict(realistic):
    figures, met = targets(*realistic)["final true quality better than strict's"]
    assert met, figures
