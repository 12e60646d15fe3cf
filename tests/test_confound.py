"""Which runs pair (autoloop.decide.confound): pure rules on measurement rows with known answers."""

from __future__ import annotations

import math

import pytest

from autoloop.decide.confound import (
    FIRST_KEEP_CHECK, MAX_FRESH, SPEED_TOLERANCE, comparable, decide_pairs, guard_keep, needs_first_keep_check,
    pair_runs,
)
from autoloop.decide.rule import DecisionConfig, Noise, Verdict

CAND, INC = 9, 1  # trial ids


def run(seed, metric, speed=None, *, role="candidate", for_trial=None):
    return {"seed": seed, "metric": metric, "status": "ok", "role": role, "machine_speed": speed,
            "for_trial_id": for_trial, "device": None}


def test_the_tolerance_lies_between_the_probes_noise_and_a_burner():
    assert comparable(10.0, 10.0 * math.exp(SPEED_TOLERANCE * 0.99))
    assert not comparable(10.0, 10.0 * math.exp(SPEED_TOLERANCE * 1.01))
    assert not comparable(10.0, 5.0) and not comparable(5.0, 10.0)  # a machine at half its speed
    assert comparable(None, 5.0) and comparable(5.0, None)  # step mode, old rows: unknown pairs with anything


def test_runs_at_one_speed_pair_as_before():
    p = pair_runs([run(1, 2.0, 10.0), run(2, 2.1, 10.2)], [run(1, 2.2, 9.9, role="baseline"),
                                                             run(2, 2.3, 10.1, role="baseline"),
                                                             run(3, 2.4, 10.0, role="baseline")], for_trial=CAND)
    assert p.candidate == {1: 2.0, 2: 2.1} and p.incumbent == {1: 2.2, 2: 2.3, 3: 2.4}
    assert p.confounded == [] and p.dropped == [] and p.fresh == []


def test_step_mode_runs_without_speeds_pair_first_with_first():
    p = pair_runs([run(1, 2.0), run(1, 2.5)], [run(1, 2.2, role="baseline"), run(1, 2.9, role="incumbent", for_trial=5)],
                  for_trial=CAND)
    assert (p.candidate, p.incumbent) == ({1: 2.0}, {1: 2.2})


def test_a_pair_at_half_the_speed_is_left_out_and_the_incumbent_asked_for_again():
    p = pair_runs([run(1, 2.0, 5.0)], [run(1, 2.2, 10.0, role="baseline"), run(2, 2.3, 10.0, role="baseline")],
                  for_trial=CAND)
    assert p.candidate == {1: 2.0} and 1 not in p.incumbent and p.incumbent == {2: 2.3}
    assert p.confounded == [{"seed": 1, "candidate_speed": 5.0, "incumbent_speed": 10.0,
                             "log_ratio": round(math.log(0.5), 3), "resolved": False}]
    verdict = decide_pairs(p, Noise(0.01, 0.014, 10), DecisionConfig(), [1, 2, 3, 4], first_keep=False)
    assert (verdict.action, verdict.side, verdict.seed) == ("measure", "incumbent", 1)
    # Measured again next to the candidate, at its speed: now the pair is the fresh run.
    p = pair_runs([run(1, 2.0, 5.0)], [run(1, 2.2, 10.0, role="baseline"), run(2, 2.3, 10.0, role="baseline"),
                                       run(1, 2.05, 5.1, role="incumbent", for_trial=CAND)], for_trial=CAND)
    assert p.incumbent[1] == 2.05 and p.fresh == [1] and p.confounded[0]["resolved"] is True


def test_a_seed_still_confounded_after_the_re_measurements_is_given_up():
    fresh = [run(1, 2.0 + k, 20.0 * (k + 1), role="incumbent", for_trial=CAND) for k in range(MAX_FRESH)]
    p = pair_runs([run(1, 2.0, 5.0)], [run(1, 2.2, 10.0, role="baseline"), *fresh], for_trial=CAND)
    assert p.dropped == [1] and 1 not in p.candidate and p.usable([1, 2, 3]) == [2, 3]
    verdict = decide_pairs(p, Noise(0.01, 0.014, 10), DecisionConfig(), [1, 2, 3], first_keep=False)
    assert (verdict.action, verdict.side, verdict.seed) == ("measure", "candidate", 2)
    none_left = decide_pairs(p, None, DecisionConfig(), [1], first_keep=False)
    assert none_left.action == "discard" and "no pair could be compared" in none_left.reason


def test_a_comparable_fresh_incumbent_run_is_preferred_to_an_older_one():
    p = pair_runs([run(1, 2.0, 10.0)], [run(1, 2.2, 10.0, role="baseline"),
                                        run(1, 2.1, 11.0, role="incumbent", for_trial=CAND)], for_trial=CAND)
    assert p.incumbent[1] == 2.1 and p.fresh == [1]


def test_a_fresh_run_off_the_old_one_at_one_speed_means_drift_and_only_fresh_runs_pair():
    incumbent = [run(1, 2.2, 10.0, role="baseline"), run(2, 2.3, 10.0, role="baseline"),
                 run(1, 2.0, 10.0, role="incumbent", for_trial=CAND)]
    p = pair_runs([run(1, 1.9, 10.0), run(2, 2.0, 10.0)], incumbent, for_trial=CAND, drift_limit=0.05)
    assert p.drifted == {"seed": 1, "shift": pytest.approx(-0.2)}
    assert p.incumbent == {1: 2.0} and p.candidate == {1: 1.9, 2: 2.0}  # seed 2 waits for a fresh incumbent run
    # Within the limit: no drift, the old runs pair as before.
    p = pair_runs([run(1, 1.9, 10.0), run(2, 2.0, 10.0)], incumbent, for_trial=CAND, drift_limit=0.5)
    assert p.drifted is None and p.incumbent == {1: 2.0, 2: 2.3}


def test_the_first_keep_waits_for_a_fresh_incumbent_run():
    keep = Verdict("keep", None, None, "keep: -0.1", {"stopped": "keep bound"})
    p = pair_runs([run(1, 2.0, 10.0)], [run(1, 2.2, 10.0, role="baseline")], for_trial=CAND)
    guarded = guard_keep(keep, p, first_keep=True)
    assert (guarded.action, guarded.side, guarded.seed, guarded.figures["stopped"]) == (
        "measure", "incumbent", 1, FIRST_KEEP_CHECK)
    assert guard_keep(keep, p, first_keep=False) is keep
    p = pair_runs([run(1, 2.0, 10.0)], [run(1, 2.2, 10.0, role="baseline"),
                                        run(1, 2.15, 10.0, role="incumbent", for_trial=CAND)], for_trial=CAND)
    assert guard_keep(keep, p, first_keep=True) is keep


def test_the_first_keep_is_behind_the_run_after_a_kept_change_or_a_drift_check():
    assert needs_first_keep_check([{"kind": "baseline", "status": "keep"}, {"kind": "proposal", "status": "discard"}])
    assert not needs_first_keep_check([{"kind": "baseline", "status": "keep"}, {"kind": "proposal", "status": "keep"}])
    assert not needs_first_keep_check([{"kind": "baseline", "status": "keep"}, {"kind": "drift", "status": "discard"}])
    assert needs_first_keep_check([{"kind": "baseline", "status": "keep"}, {"kind": "drift", "status": "crash"}])
