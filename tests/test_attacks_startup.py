"""Issue 31, item 2: training before the clock starts, through the real sandboxed loop.

The feed's budget rules used to start at the first clock tick (time mode: the end of the
untimed warm-up). A trial that trains on text it builds itself (the interpreter's own
source files, which every sandbox can read) before it asks the feed for a batch, or inside
its untimed warm-up steps, got that training free: on the main of 2026-12-05 both were
kept in time mode and in step mode (figures in docs/verification.md). The start-up rule
(autoloop.trust.startup) bounds the process tree's CPU time and the wall time before the
first batch and before the first timed step against the baseline's own start-up.

Run with `-s` to print each trial's figures.
"""

from __future__ import annotations

import json

import pytest

from autoloop.loop.controller import Controller
from autoloop.store import Store
from tests.conftest import make_repo
from tests.test_attacks import LOOP_ANCHOR, TRAIN_PY, _patched, _run, _seed_attacks, _trials, needs_bwrap

# Seconds of CPU the attack trains before the clock: several times an honest start-up's
# (3-5 s on a CPU), a budget's worth of training and more for the short budgets below.
PRETRAIN_CPU_SECONDS = 20

_PRETRAIN = (
    "def _pretrain(model, optimizers, seq_len, device):\n"
    "    # Text nobody serves: the interpreter's own source files (readable in every sandbox).\n"
    "    import glob, sysconfig\n"
    "    files = sorted(glob.glob(sysconfig.get_paths()['stdlib'] + '/*.py'))\n"
    "    text = b''.join(open(p, 'rb').read() for p in files)[:4_000_000]\n"
    "    ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()\n"
    "    gen = torch.Generator().manual_seed(0)\n"
    "    t0 = time.process_time()\n"
    f"    while time.process_time() - t0 < {PRETRAIN_CPU_SECONDS}:\n"
    "        starts = torch.randint(0, len(ids) - seq_len - 1, (DEVICE_BATCH_SIZE,), generator=gen).tolist()\n"
    "        w = torch.stack([ids[s:s + seq_len + 1] for s in starts]).to(device)\n"
    "        model(w[:, :-1], w[:, 1:]).backward()\n"
    "        for opt in optimizers:\n"
    "            opt.step()\n"
    "        model.zero_grad(set_to_none=True)\n\n\n"
)
_LOADER_ANCHOR = '    loader = H.TokenLoader(ds, "train", DEVICE_BATCH_SIZE, seq_len, device, seed=spec.seed)\n'
# Each attack's own copy of _pretrain, far from the other's lines: when one is kept (on the
# old rules) the other's patch still applies to it.
_WITH_PRETRAIN = _patched("def fail(reason):", _PRETRAIN + "def fail(reason):")
_WITH_PRETRAIN_EARLY = _patched("def muon_orthogonalize(", _PRETRAIN + "def muon_orthogonalize(")

ATTACKS = {
    # Before the loader asks the feed for anything: the start-up the old rules never judged.
    "before the first batch": _patched(
        _LOADER_ANCHOR, "    _pretrain(model, optimizers, seq_len, device)\n" + _LOADER_ANCHOR, _WITH_PRETRAIN),
    # Inside the first (untimed) warm-up step, after its batch was drawn: the warm-up steps'
    # batches were counted, their time was not.
    "inside the warm-up": _patched(
        LOOP_ANCHOR, "        if clock.steps == 0:\n"
                     "            _pretrain(model, optimizers, seq_len, device)\n" + LOOP_ANCHOR, _WITH_PRETRAIN_EARLY),
}


def _budget_figures(repo, trial_id: int) -> list[dict]:
    store = Store(repo / "experiments.db")
    try:
        rows = store.query("SELECT budget FROM measurements WHERE trial_id = ?", (trial_id,))
        return [json.loads(r["budget"]) for r in rows if r["budget"]]
    finally:
        store.close()


def _show(repo, trials: dict[str, dict]) -> None:
    keys = ("startup_seconds", "startup_wall_seconds", "startup_wall_allowed_seconds", "startup_cpu_seconds",
            "startup_cpu_allowed_seconds", "warmup_wall_seconds", "warmup_wall_allowed_seconds", "warmup_cpu_seconds",
            "warmup_cpu_allowed_seconds", "median_step_seconds", "median_step_cpu_seconds", "startup_reference")
    for name, trial in trials.items():
        print(f"{name}: {trial['status']} metric {trial['metric']} reason {trial['reason']}")
        for figures in _budget_figures(repo, trial["id"]):
            print("   ", {k: figures.get(k) for k in keys if k in figures})


@pytest.mark.slow
@needs_bwrap
@pytest.mark.parametrize("mode", ["time", "steps"])
def test_training_before_the_clock_is_invalid(tmp_path, monkeypatch, mode):
    """Training on self-built text before the first batch, or inside the untimed warm-up
    steps, is `invalid` with a reason naming start-up or warm-up, in time and in step mode;
    the honest baseline of the same run is kept."""
    repo = make_repo(tmp_path / "repo", TRAIN_PY.read_text())
    flags = {"time_budget": 8} if mode == "time" else {"max_steps": 12}
    config = _run(repo, monkeypatch, max_trials=1 + len(ATTACKS), **flags)
    _seed_attacks(repo, config, list(ATTACKS), ATTACKS)
    Controller(config, repo).run()
    trials = _trials(repo)
    _show(repo, trials)
    assert trials["baseline"]["status"] == "keep", trials["baseline"]["reason"]
    for name, words in (("before the first batch", "before the first batch"), ("inside the warm-up", "warm-up")):
        trial = trials[name]
        assert trial["status"] == "invalid", (name, trial["status"], trial["metric"], trial["reason"])
        assert "trained before the clock" in trial["reason"] and words in trial["reason"], (name, trial["reason"])
