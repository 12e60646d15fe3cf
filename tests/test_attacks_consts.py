"""Issue 31, item 5: the controller evaluated a trial's arithmetic.

A constant `8 + 0*(3**3**15)` in a block the trial itself skips costs the trial nothing,
but autoloop read it with `eval`: the out-of-memory repair after a faked OOM line froze
the controller 3 to 15 s per constant per read (9**9**9: hours), and the search,
`seed --set` and `search-plan` read constants the same way. Each attack here must leave
the controller prompt, the constant unread with its cap named, and nothing kept. Two more
readers of a trial's text held the controller the same way, by a regex that backtracked
quadratically: the LLM brief's summary of the diffs, and the printed `---` block.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autoloop.cli import app
from autoloop.loop.controller import Controller
from autoloop.proposers.search_space import build_space, explain_space
from autoloop.pyconst import current_device
from autoloop.store import Store
from tests.conftest import make_repo
from tests.test_attacks import _patched, _run, _seed_attacks, _trials, needs_bwrap

TRAIN_PY = Path(__file__).resolve().parents[1] / "train.py"
BOMB = "3**3**15"  # 22.7 million bits: 3 to 15 s of CPU per evaluation; 9**9**9 takes hours
CONSTANTS_ANCHOR = 'COMPILE = DEVICE_TYPE == "cuda"'
MAIN_ANCHOR = "    spec = H.RunSpec.from_env()\n"

# A block on the controller's own device that the trial never runs: the trial changes
# DEVICE_TYPE around it, which the reader (reasonably) does not follow.
SKIPPED_BOMBS = (
    "_DEVICE = DEVICE_TYPE\n"
    "DEVICE_TYPE = 'none'\n"
    f"if DEVICE_TYPE == {current_device()!r}:\n"
    f"    DEVICE_BATCH_SIZE = 8 + 0*({BOMB})\n"
    f"    EVAL_BATCH_SIZE = 16 + 0*({BOMB})\n"
    f"    MATRIX_LR = 0.04 + 0*({BOMB})  # range 0.001..0.5 log\n"
    "DEVICE_TYPE = _DEVICE\n"
)
FAKE_OOM = (
    "    print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB', file=sys.stderr, flush=True)\n"
    "    raise SystemExit(1)\n"
)
BOMBED = _patched(CONSTANTS_ANCHOR, SKIPPED_BOMBS + CONSTANTS_ANCHOR)
OOM_BOMB = _patched(MAIN_ANCHOR, MAIN_ANCHOR + FAKE_OOM, BOMBED)


def _seconds(later: str, earlier: str) -> float:
    return (datetime.fromisoformat(later) - datetime.fromisoformat(earlier)).total_seconds()


@pytest.mark.slow
@needs_bwrap
def test_a_faked_oom_does_not_make_the_controller_evaluate_a_skipped_constant(attacked_repo, monkeypatch):
    # The shared sandboxed baseline's run, ours to run on: the attack crashes before training,
    # and room for the repair trial it must not get.
    repo = attacked_repo
    config = _run(repo, monkeypatch, max_steps=6, max_trials=2)
    _seed_attacks(repo, config, ["oom bomb"], {"oom bomb": OOM_BOMB})
    started = time.monotonic()
    Controller(config, repo).run()
    loop_seconds = time.monotonic() - started
    trials = _trials(repo)
    assert trials["baseline"]["status"] == "keep", trials["baseline"]["reason"]
    attack = trials["oom bomb"]
    assert attack["status"] == "crash", attack["reason"]
    assert [name for name, t in trials.items() if t["status"] == "keep"] == ["baseline"]
    assert not any(t.get("derived_from") == attack["id"] for t in trials.values()), "repaired with an unread batch"
    store = Store(repo / "experiments.db")
    try:
        events = [e for e in store.events(store.get_run("a")["id"], kind="oom") if e["trial_id"] == attack["id"]]
    finally:
        store.close()
    assert len(events) == 1, events
    assert "not repaired" in events[0]["message"] and "3**14348907" in events[0]["message"], events[0]["message"]
    # The controller reads the constants between the crash and this event: on main, two reads
    # of three bombs held it 74 s before the repair trial started (a loaded 2-core box).
    read = _seconds(events[0]["created_at"], attack["finished_at"])
    print(f"from the faked OOM to the controller's verdict: {read:.2f} s; the whole loop {loop_seconds:.0f} s")
    assert read < 2.0, read


def test_the_search_reads_a_bombed_source_at_once():
    """The search's space and its hints (the comment `range 1..3**3**15`) come from a trial's
    train.py once it is kept: bounded, and the bombs named as not searched."""
    hinted = BOMBED.replace("  # range 0.001..0.5 log\n", f"  # range 0.001..{BOMB} log\n", 1)
    started = time.process_time()
    params = build_space(hinted, step_mode=True, strict=False)
    params, skipped = explain_space(hinted, step_mode=True)
    seconds = time.process_time() - started
    assert seconds < 1.0, seconds
    names = {p.name for p in params}
    assert not names & {"DEVICE_BATCH_SIZE", "EVAL_BATCH_SIZE", "MATRIX_LR"}
    why = dict(skipped)
    assert "not evaluated" in why["DEVICE_BATCH_SIZE"] and "4,096 bits" in why["DEVICE_BATCH_SIZE"], why
    assert "MODEL_DIM" in names  # the honest constants are still searched


def test_search_plan_and_seed_on_a_bombed_source_answer_at_once(tmp_path):
    repo = make_repo(tmp_path / "repo", BOMBED)
    runner = CliRunner()
    started = time.process_time()
    plan = runner.invoke(app, ["search-plan", "--repo", str(repo), "--max-steps", "4"])
    seconds = time.process_time() - started
    assert plan.exit_code == 0, plan.output
    assert "DEVICE_BATCH_SIZE: not evaluated: a power 3**14348907" in plan.output, plan.output
    assert seconds < 2.0, seconds
    # seed --set reads the file's constants (to check the value fits) and the value itself.
    for value, words in ((f"4 + 0*({BOMB})", "4,096 bits"), ("9**9**9", "4,096 bits"), ("'a'*10**9", "characters"),
                         ("-" * 100_000 + "1", "characters")):
        started = time.process_time()
        seeded = runner.invoke(app, ["seed", "bomb", "--set", f"DEPTH={value}", "--repo", str(repo)])
        seconds = time.process_time() - started
        assert seeded.exit_code != 0 and not isinstance(seeded.exception, Exception), seeded.output  # no traceback
        assert "not a" in seeded.output and words in seeded.output, (value[:20], seeded.output)
        assert len(seeded.output.strip().splitlines()) == 1, seeded.output
        assert seconds < 2.0, (value[:20], seconds)
    # A value that fits still seeds, against a file whose other constants are bombs.
    fine = runner.invoke(app, ["seed", "deeper", "--set", "DEPTH=2**2", "--repo", str(repo)])
    assert fine.exit_code == 0, fine.output


def test_the_llm_brief_reads_a_trial_diff_at_once():
    """Every LLM brief summarises the trials' diffs by the constants they assign; a diff line
    with a long run of spaces made that regex backtrack quadratically (20,000 spaces: 5 s)."""
    from autoloop.proposers.brief import diff_themes

    diff = ("diff --git a/train.py b/train.py\n--- a/train.py\n+++ b/train.py\n@@ -1,3 +1,3 @@\n"
            "-LR = 0.02  # lr\n+LR = 0.01  # lr\n+NAME: str = \"a#b\"\n"
            f"+PAD = 1{' ' * 100_000}2\n")
    started = time.process_time()
    themes = diff_themes(diff)
    assert time.process_time() - started < 0.5
    assert themes == {"LR": "0.01", "NAME": '"a', "PAD": "1" + " " * 100_000 + "2"}


def test_a_reported_summary_block_is_read_at_once():
    """A script without the harness's result JSON is judged on its printed `---` block: a
    value line with a long run of spaces backtracked quadratically, and 5,000 digits made
    int() raise (CPython refuses 4,300) inside the controller."""
    from autoloop.measure.judge import parse_summary_block

    started = time.process_time()
    block = parse_summary_block(f"---\nval_bpb: 1{' ' * 100_000}x\ntraining_seconds: {'1' * 5000}\nnum_steps:  12  \n")
    assert time.process_time() - started < 0.5
    assert block["val_bpb"] == "1" + " " * 100_000 + "x" and block["num_steps"] == 12
    assert block["training_seconds"] == float("inf")


def test_the_oom_repair_names_the_cap_on_the_fake_script(tmp_path):
    """The same attack on the fake training script, fast: the incumbent holds the skipped
    bombs (so seeding `--set LR=0.5` and applying it read them too), the proposal fakes an
    out-of-memory error, and the repair refuses with the cap named, at once."""
    from tests.conftest import FAKE_TRAIN
    from tests.test_decision_loop import rows, run_loop, seed

    bombs = SKIPPED_BOMBS.replace("_DEVICE = DEVICE_TYPE\n", "_DEVICE = DEVICE_TYPE = 'cpu'\n")
    source = FAKE_TRAIN.read_text().replace('MODE = "ok"', bombs + 'MODE = "ok"', 1).replace(
        '    if MODE == "crash":',
        '    if LR > 0.1:\n        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")\n'
        '    if MODE == "crash":', 1)
    repo = make_repo(tmp_path / "repo", source)
    started = time.monotonic()
    seed(repo, "huge lr", "LR=0.5")
    assert time.monotonic() - started < 5.0
    run_loop(repo, max_trials=3, decision_rule="strict", baseline_seeds=1)
    run, trials, _ = rows(repo)
    assert [(t["kind"], t["status"]) for t in trials] == [("baseline", "keep"), ("proposal", "crash")], trials
    assert "not repaired" in trials[1]["reason"] and "not evaluated: a power 3**14348907" in trials[1]["reason"]
    store = Store(repo / "experiments.db")
    try:
        event = next(e for e in store.events(run["id"], kind="oom") if e["trial_id"] == trials[1]["id"])
    finally:
        store.close()
    assert _seconds(event["created_at"], trials[1]["finished_at"]) < 2.0
