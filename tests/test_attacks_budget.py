"""Attacks on the training budget, through the real loop (split from tests/test_attacks.py,
whose helpers they use, so that two CI workers share the attack tests): a clock fed half of
each step, training the feed does not see (after the last tick or inside a long last step),
and an honest baseline kept beside two CPU burners."""

from __future__ import annotations

import subprocess
import sys

import pytest

from autoloop.loop.controller import Controller
from tests.conftest import make_repo
from tests.test_attacks import (
    AFTER_LOOP_ANCHOR, LOOP_ANCHOR, TRAIN_PY, _assert_no_secret_anywhere, _patched, _plant_canaries, _run,
    _seed_attacks, _trials, needs_bwrap,
)

HALF_CLOCK = _patched(LOOP_ANCHOR, "        clock.step_finished(dt / 2)\n")


# 4. Training the feed does not see: hoard one extra batch per step (the feed allows a step
#    twice the median's batches), then train on the hoard after the last tick, before the
#    checkpoint; or inside a last step made long on purpose.
_HOARD = (
    "        if clock.steps == 1:\n"
    "            _hoard, _extra = [], H.TokenLoader(ds, 'train', DEVICE_BATCH_SIZE, seq_len, device, seed=spec.seed + 7)\n"
    "        _hoard.append(next(_extra))\n"
)
_TRAIN_ON_HOARD = (
    "def _train_on(model, optimizers, batches):\n"
    "    for x, y in batches:\n"
    "        model(x, y).backward()\n"
    "        for opt in optimizers:\n"
    "            opt.step()\n"
    "        model.zero_grad(set_to_none=True)\n\n\n"
)
# Two passes over the hoard: twice the budget's training again (a hoard is one batch a
# step), dozens of steps' worth however few steps a busy machine left the run, where the
# rules allow a few (docs/verification.md). Each attack runs twice (the tail rules'
# verdicts are measured again), so eight passes made this the suite's second-slowest test
# and four its third.
TAIL_TRAINING = _patched(AFTER_LOOP_ANCHOR, "    _train_on(model, optimizers, _hoard * 2)\n" + AFTER_LOOP_ANCHOR,
                         _patched(LOOP_ANCHOR, LOOP_ANCHOR + _HOARD, _patched("def fail(reason):", _TRAIN_ON_HOARD + "def fail(reason):")))
LONG_LAST_STEP = _patched(LOOP_ANCHOR, (
    "        if clock.steps >= clock.warmup_steps and clock.training_seconds + dt >= clock.time_budget:\n"
    "            _train_on(model, optimizers, _hoard * 2)\n"
    "            _hoard = []\n") + LOOP_ANCHOR + _HOARD,
    _patched("def fail(reason):", _TRAIN_ON_HOARD + "def fail(reason):"))


@pytest.mark.slow
def test_feeding_the_clock_half_of_each_step_is_over_budget(tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo", TRAIN_PY.read_text())
    # A budget several steps long even on a busy machine: within one step of the budget an
    # honest run and one that feeds its clock half the time cannot be told apart.
    config = _run(repo, monkeypatch, time_budget=20, max_trials=2)
    _seed_attacks(repo, config, ["half clock"], {"half clock": HALF_CLOCK})
    Controller(config, repo).run()
    trials = _trials(repo)
    assert trials["baseline"]["status"] == "keep", trials["baseline"]["reason"]
    trial = trials["half clock"]
    assert trial["status"] == "invalid" and "budget" in trial["reason"], trial["reason"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["time", "steps"])
def test_the_baseline_is_kept_beside_two_cpu_burners(tmp_path, monkeypatch, mode):
    repo = make_repo(tmp_path / "repo", TRAIN_PY.read_text())
    flags = {"time_budget": 8} if mode == "time" else {"max_steps": 8}
    config = _run(repo, monkeypatch, max_trials=1, decision_rule="paired", baseline_seeds=2, **flags)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        summary = Controller(config, repo).run()
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    baseline = _trials(repo)["baseline"]
    assert baseline["status"] == "keep", baseline["reason"]
    assert baseline["n_runs"] == 2 and not summary.paused


@pytest.mark.slow
@needs_bwrap
def test_training_the_feed_does_not_see_is_over_budget(tmp_path, monkeypatch):
    """Issue 23, item 4, time mode: extra optimizer steps on hoarded batches after the last
    clock tick (before the checkpoint), or inside a last step made long on purpose."""
    repo = make_repo(tmp_path / "repo", TRAIN_PY.read_text())
    _plant_canaries(repo, monkeypatch)
    attacks = {"tail training": TAIL_TRAINING, "long last step": LONG_LAST_STEP}
    config = _run(repo, monkeypatch, time_budget=8, max_trials=1 + len(attacks))
    _seed_attacks(repo, config, list(attacks), attacks)
    Controller(config, repo).run()
    trials = _trials(repo)
    assert trials["baseline"]["status"] == "keep", trials["baseline"]["reason"]
    for name in attacks:
        trial = trials[name]
        # Caught by the budget, not by luck: on the old rules both passed it (-0.31 and -0.35
        # bpb), and only the held-out guard's margin happened to refuse them.
        assert trial["status"] == "invalid", (name, trial["status"], trial["metric"], trial["reason"])
        # (which of the budget's tail rules fires first depends on how long the extra training
        # took: the last step, the checkpoint's CPU time, or the time after the last batch)
        assert "held-out" not in trial["reason"] and any(
            words in trial["reason"] for words in ("last step", "checkpoint", "after its last training batch")), \
            (name, trial["reason"])
    _assert_no_secret_anywhere(repo)
