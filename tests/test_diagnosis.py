"""Tests of autoloop/decide/diagnosis.py: synthetic curves with known answers, and real short runs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from autoloop.decide import diagnosis as D


def curve(losses, grad_norms=None, lrs=None):
    n = len(losses)
    grad_norms = grad_norms if grad_norms is not None else [1.0] * n
    lrs = lrs if lrs is not None else [1.0] * n
    return [{"step": i + 1, "seconds": 0.1 * (i + 1), "loss": float(loss), "lr": float(lr), "grad_norm": float(g)}
            for i, (loss, g, lr) in enumerate(zip(losses, grad_norms, lrs))]


def noisy(values, sd=0.03, seed=0):
    return np.asarray(values) + np.random.default_rng(seed).normal(0, sd, len(values))


def flag_names(c):
    return [f["flag"] for f in D.diagnose(c)]


T = np.arange(1, 501)


def test_a_healthy_curve_has_no_flags():
    # Power-law decay: still improving at the end, but slowly (3% of the drop in the last fifth).
    for seed in range(3):
        losses = noisy(2.0 + 3.5 / np.sqrt(1 + T / 20), seed=seed)
        assert flag_names(curve(losses)) == [], D.diagnose(curve(losses))


def test_converged_early_is_a_plateau():
    losses = noisy(2.0 + 3.5 * np.exp(-T / 40))
    flags = D.diagnose(curve(losses))
    assert [f["flag"] for f in flags] == ["plateau"]
    assert flags[0]["message"].startswith("plateau: no progress over the last 40% of the run")


def test_still_falling_steeply_is_too_short():
    losses = noisy(5.5 - 3.0 * T / 500)
    flags = D.diagnose(curve(losses))
    assert [f["flag"] for f in flags] == ["too_short"]
    assert flags[0]["share"] == pytest.approx(0.2, abs=0.05)  # linear: the last fifth did a fifth of the drop
    assert "the budget, not the change, limits this result" in flags[0]["message"]


def test_loss_climbing_back_is_divergence():
    down = 5.5 - 3.0 * np.minimum(T, 200) / 200  # 5.5 -> 2.5 by step 200
    up = np.where(T > 250, 2.5 + 2.5 * (T - 250) / 250, 0)  # then back up to 5 by the end
    losses = noisy(np.maximum(down, up))
    flags = D.diagnose(curve(losses))
    assert [f["flag"] for f in flags] == ["divergence"]
    assert 190 <= flags[0]["step"] <= 260 and flags[0]["end"] > 4.5
    assert "lower the learning rate" in flags[0]["message"]


def test_a_bump_that_recovers_is_not_divergence():
    base = 2.0 + 3.5 / np.sqrt(1 + T / 20)
    bump = np.where((T > 200) & (T < 230), 1.0, 0.0)
    assert "divergence" not in flag_names(curve(noisy(base + bump)))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), None])
def test_nan_loss_is_divergence_even_in_a_short_curve(bad):
    c = curve([5.5, 4.0, 3.5])
    c[2]["loss"] = bad
    flags = D.diagnose(c)
    assert [f["flag"] for f in flags] == ["divergence"] and flags[0]["step"] == 3


def test_grad_spike_found_where_it_is():
    losses = noisy(2.0 + 3.5 / np.sqrt(1 + T / 20))
    norms = list(noisy(np.ones(500), sd=0.05, seed=1))
    norms[300] = 20.0  # step 301
    norms[5] = 50.0  # in the first tenth: early norms swing on their own, ignored
    flags = D.diagnose(curve(losses, norms))
    assert [f["flag"] for f in flags] == ["grad_spike"]
    assert flags[0]["step"] == 301 and flags[0]["ratio"] == pytest.approx(20, rel=0.1)
    norms[300] = 5.0  # 5x is within the ordinary swing of a noisy run
    assert flag_names(curve(losses, norms)) == []


def test_too_few_points_say_nothing():
    assert D.diagnose([]) == [] and D.diagnose(None) == []
    assert D.diagnose(curve([5.5, 5.0, 6.0, 7.0])) == []


def test_messages_and_names_of_stored_flags():
    flags = D.diagnose(curve(noisy(5.5 - 3.0 * T / 500)))
    stored = json.loads(json.dumps(flags))  # as the trials.flags JSON column returns them
    assert D.names(stored) == "too_short"
    assert D.messages(stored) == [flags[0]["message"]]
    assert D.names(None) == "" and D.messages([]) == []


def test_every_message_is_one_line():
    curves = [noisy(2.0 + 3.5 * np.exp(-T / 40)), noisy(5.5 - 3.0 * T / 500)]
    for c in curves:
        for f in D.diagnose(curve(c)):
            assert "\n" not in f["message"] and f["message"].startswith(f["flag"] + ":")


# ---------------------------------------------------------------------------- real runs


def _run(tmp_path, session_cache, name, replacements, steps):
    from tests.test_train import TRAIN_PY, explain, run_train, variant

    script = variant(tmp_path, name, replacements) if replacements else TRAIN_PY
    out = tmp_path / f"{name}.json"
    progress = tmp_path / f"{name}.jsonl"
    proc = run_train(script, session_cache, AUTOLOOP_MAX_STEPS=steps, AUTOLOOP_SEED=1, AUTOLOOP_RESULT=out,
                     AUTOLOOP_PROGRESS=progress)
    return proc, out, progress, explain(proc)


@pytest.mark.slow
def test_real_run_with_an_absurd_learning_rate_is_flagged_divergence(tmp_path, session_cache, embedded_dataset):
    # 100x every LR: the loss blows up to ~4x the untrained model's at the second step,
    # then sits at the unigram level; the soft-capped logits keep it finite, so the run
    # finishes (a NaN would stop it: then the progress lines are the curve).
    lrs = {"MATRIX_LR": "100 * 0.04", "EMBEDDING_LR": "100 * 0.6", "UNEMBEDDING_LR": "100 * 0.004"}
    proc, out, progress, why = _run(tmp_path, session_cache, "train_absurd_lr", lrs, 60)
    if proc.returncode == 0:
        points = json.loads(out.read_text())["curve"]
    else:  # a NaN stops the run: the progress lines are what the controller has
        assert proc.returncode == 1 and "FAIL:" in proc.stdout, why
        points = [json.loads(line) for line in progress.read_text().splitlines()]
        points.append({"step": points[-1]["step"] + 1, "loss": math.nan, "grad_norm": None})
    assert "divergence" in flag_names(points), (D.diagnose(points), [p["loss"] for p in points])


@pytest.mark.slow
def test_real_run_at_the_default_learning_rate_is_not_divergence(tmp_path, session_cache, embedded_dataset):
    proc, out, _, why = _run(tmp_path, session_cache, "train_default", None, 60)
    assert proc.returncode == 0, why
    assert "divergence" not in flag_names(json.loads(out.read_text())["curve"])


def test_flags_are_shown_by_log_and_show(tmp_path):
    from autoloop.review.queries import log_rows, trial_detail
    from autoloop.review.text import format_log, format_trial
    from autoloop.store import Store

    store = Store(tmp_path / "experiments.db")
    run = store.create_run("t", branch="autoloop/t", base_commit="0" * 40)
    trial = store.new_trial(run["id"], "baseline", description="baseline")
    flags = D.diagnose(curve(noisy(5.5 - 3.0 * T / 500)))
    store.update_trial(trial["id"], status="keep", metric=2.5, flags=flags)
    rows = log_rows(store, run)
    assert rows[0]["flags"] == flags
    assert "⚑ too_short" in format_log(run, rows)
    detail = trial_detail(store, run, 1)
    assert f"flag           {flags[0]['message']}" in format_trial(detail, with_diff=False)
    store.close()


def test_a_blow_up_early_is_divergence_even_if_the_loss_recovers():
    losses = list(noisy(2.0 + 3.5 / np.sqrt(1 + T / 20)))
    losses[1] = 3 * losses[0]
    flags = D.diagnose(curve(losses))
    assert [f["flag"] for f in flags] == ["divergence"] and flags[0]["step"] == 2
