"""The built-in `search` proposer: hint grammar, moves, order of attack, and whole runs of
the real controller on fake training scripts whose val_bpb is a known function."""

from __future__ import annotations

import hashlib
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from autoloop.config import resolve
from autoloop.loop.controller import Controller
from autoloop.errors import AutoloopError
from autoloop.gitops import GitRepo
from autoloop.proposers.seeding import seed_idea
from autoloop.proposers.base import build_chain
from autoloop.proposers.search import SearchProposer
from autoloop.proposers.search_space import build_space, parse_hints
from autoloop.pyconst import read_constants
from autoloop.store import Store

from conftest import FAKE_TRAIN, REPO_ROOT, make_repo

# Optimum 1.0 at LR = 0.01, WEIGHT_DECAY = 0.05, WARMUP_RATIO = 0.2, WIDTH = 256, DEPTH = 5,
# USE_NORM = True. UNUSED has no effect; SALT is fixed. TEST_NOISE (env) adds Gaussian
# noise seeded by the evaluation's index, counted in the file named by TEST_COUNTER.
OBJECTIVE = '''"""A fake train.py for the search tests: val_bpb is a known function of its constants."""
import json
import math
import os
import random

LR = 0.0005  # learning rate; range 0.0001..0.5 log
WEIGHT_DECAY = 0.5  # decoupled weight decay
WARMUP_RATIO = 0.0  # linear warm-up, as a fraction of the budget
WIDTH = 2**5  # model width; power of two
DEPTH = 3  # blocks; range 1..6 int
USE_NORM = False  # normalise the residual stream
SALT = 7  # changes nothing, must never change; fixed
UNUSED = 1.5  # has no effect at all


def true_bpb():
    return (1.0 + (math.log10(LR) + 2.0) ** 2 + 0.05 * math.log10(WEIGHT_DECAY / 0.05) ** 2
            + 0.5 * (WARMUP_RATIO - 0.2) ** 2 + 0.1 * (math.log2(WIDTH) - 8.0) ** 2
            + 0.05 * (DEPTH - 5) ** 2 + (0.0 if USE_NORM else 0.05))


if __name__ == "__main__":
    noise = 0.0
    if os.environ.get("TEST_NOISE"):
        counter = os.environ["TEST_COUNTER"]
        index = int(open(counter).read()) if os.path.exists(counter) else 0
        with open(counter, "w") as handle:
            handle.write(str(index + 1))
        noise = random.Random(index).gauss(0.0, float(os.environ["TEST_NOISE"]))
    value = true_bpb() + noise
    result = {"val_bpb": value, "true_bpb": true_bpb(), "training_seconds": 0.0, "total_seconds": 0.0,
              "compile_seconds": 0.0, "eval_seconds": 0.0, "num_steps": 1, "total_tokens": 1,
              "num_params": 1, "mfu_percent": None, "peak_memory_mb": 0.0, "device": "cpu",
              "seed": 0, "curve": []}
    with open(os.environ["AUTOLOOP_RESULT"], "w") as handle:
        json.dump(result, handle)
    print("---")
    print(f"val_bpb: {value:.6f}")
'''


def run_search(repo: Path, tag: str = "t", **flags):
    flags = {"tag": tag, "proposers": "search", "time_budget": 30, "grace_seconds": 30, **flags}
    return Controller(resolve(repo, flags), repo, verifier=None).run()


def rows_of(repo: Path, tag: str = "t") -> list[dict]:
    store = Store(repo / "experiments.db")
    try:
        return store.trials(store.get_run(tag)["id"])
    finally:
        store.close()


def sets_of(row: dict) -> dict:
    edits = (row.get("edits") or {}).get("edits") or []
    return {name: value for edit in edits for name, value in (edit.get("sets") or {}).items()}


def signature(rows: list[dict]) -> list[tuple]:
    """What a run did, without commit shas or timings (they differ between repos)."""
    return [(r["kind"], r["proposer"], r["description"], str(sets_of(r)), r["status"], r["metric"])
            for r in rows if r["status"] != "interrupted"]


# ---------------------------------------------------------------------------------- hints


def test_hint_grammar_reads_hint_clauses_and_ignores_prose():
    assert parse_hints("learning rate; range 0.0001..1 log").lo == 0.0001
    hints = parse_hints("learning rate; range 0.0001..1 log")
    assert (hints.lo, hints.hi, hints.scale) == (0.0001, 1.0, "log")
    assert parse_hints("model width; power of two").pow2
    assert parse_hints("2**4..2**12, pow2").hi == 4096
    assert parse_hints("fixed").fixed
    assert parse_hints("iterations; range 1..5 int; step 2") == parse_hints("range 1..5, integer, step 2")
    # Prose that contains hint words is not a hint: every word of a clause must be a term.
    for prose in ("the coefficient table has 5", "an int, the number of heads", "range of the rotary base",
                  "keep it fixed at the paper's value", "(head_dim = MODEL_DIM // N_HEAD = 128)", ""):
        assert not parse_hints(prose).given, prose


@pytest.mark.parametrize("comment, problem", [
    ("range 1..0", "is empty"),
    ("range 0..1 log", "above 0"),
    ("range 0.5..64 pow2", "start at 1"),
    ("log; step 1", "does not move"),
])
def test_contradictory_hint_is_an_error_naming_the_line(comment, problem):
    source = f"LR = 0.02  # {comment}\n"
    with pytest.raises(AutoloopError, match=problem) as info:
        build_space(source, step_mode=False)
    assert "train.py line 1" in str(info.value) and "LR" in str(info.value) and "fix the comment" in str(info.value)


def test_contradictory_hint_stops_the_run_after_recording_the_baseline(tmp_path):
    repo = make_repo(tmp_path / "repo", OBJECTIVE.replace("range 0.0001..0.5 log", "range 0.5..0.0001 log"))
    with pytest.raises(AutoloopError, match=r"train.py line \d+: the search hint for LR .* new run"):
        run_search(repo, max_trials=5)
    rows = rows_of(repo)
    assert [(r["kind"], r["status"]) for r in rows] == [("baseline", "keep")]
    # In a commit that a proposal wrote, the user cannot fix the comment: the constant is skipped.
    names = [p.name for p in build_space(OBJECTIVE.replace("0.0001..0.5", "0.5..0.0001"), step_mode=False,
                                         strict=False)]
    assert "LR" not in names and "WIDTH" in names


# ---------------------------------------------------------------------------------- moves


def space_of(source: str, step_mode: bool = False) -> dict:
    return {p.name: p for p in build_space(source, step_mode=step_mode)}


def test_default_moves_without_hints():
    space = space_of(
        "LR = 0.02\nUSE_X = True\nDEPTH = 8\nTOTAL_BATCH_TOKENS = 2**19\nSTEPS = 300\nWARMUP_RATIO = 0.0\n"
        "MOMENTUM = 0.95\nZERO = 0.0\nNEG = -0.5\n"
    )
    assert space["LR"].move(1, 0) == {"LR": 0.04} and space["LR"].move(-1, 0) == {"LR": 0.01}
    assert space["LR"].move(1, 1) == {"LR": 0.08} and space["LR"].move(1, -1) == {"LR": 0.0283}
    assert space["USE_X"].move(1, 0) == {"USE_X": False}
    assert space["DEPTH"].move(1, 0) == {"DEPTH": 9} and space["DEPTH"].move(-1, 1) == {"DEPTH": 6}
    # Written back the way it was written: 2**k.
    up = space["TOTAL_BATCH_TOKENS"].move(1, 0)["TOTAL_BATCH_TOKENS"]
    assert str(up) == "2**20"
    assert space["STEPS"].move(1, 0) == {"STEPS": 600} and space["STEPS"].move(-1, -2) == {"STEPS": 252}
    # Fractions: never more than halfway to 0 or 1; a move that cannot happen is None.
    assert space["WARMUP_RATIO"].move(1, 0) == {"WARMUP_RATIO": 0.1}
    assert space["WARMUP_RATIO"].move(-1, 0) is None
    assert space["MOMENTUM"].move(1, 0) == {"MOMENTUM": 0.975}
    assert space["ZERO"].move(1, 0) == {"ZERO": 0.1} and space["ZERO"].move(-1, 0) is None
    assert space["NEG"].move(1, 0) == {"NEG": -1.0}


def test_hints_are_honoured_by_moves():
    space = space_of(
        "LR = 0.5  # range 0.001..0.6 log\n"
        "WIDTH = 48  # power of two\n"
        "HEADS = 3  # range 1..4 int\n"
        "RATIO = 0.4  # range 0..0.5 linear\n"
        "EPS = 1e-08  # fixed\n"
        "BIG = 100  # range 10..1000 log; step 1.5\n"
        "LOG_EVERY = 10\n"
        "EVAL_EVERY = 50  # range 10..100 int\n"
    )
    assert "EPS" not in space  # fixed
    assert "LOG_EVERY" not in space  # logging is not searched without a hint ...
    assert space["EVAL_EVERY"].move(1, 0) == {"EVAL_EVERY": 100}  # ... but a hint asks for it
    assert space["LR"].move(1, 0) == {"LR": 0.6}  # clamped to the range
    assert space["LR"].move(1, 0) and space_of("LR = 0.6  # range 0.001..0.6 log\n")["LR"].move(1, 0) is None
    assert space["WIDTH"].move(1, 0) == {"WIDTH": 128} and space["WIDTH"].move(-1, 0) == {"WIDTH": 32}
    assert space["HEADS"].move(1, 0) == {"HEADS": 4} and space["HEADS"].move(1, 1) == {"HEADS": 4}
    assert space_of("HEADS = 4  # range 1..4 int\n")["HEADS"].move(1, 0) is None
    assert space["RATIO"].move(1, 0) == {"RATIO": 0.4625}  # linear: an eighth of the range
    assert space["RATIO"].move(1, 1) == {"RATIO": 0.5}  # clamped to the range
    assert space["BIG"].move(1, 0) == {"BIG": 150}


def test_order_of_attack_on_the_real_train_py():
    source = (REPO_ROOT / "train.py").read_text()
    params = build_space(source, step_mode=False)
    groups = [p.group for p in params]
    assert groups == sorted(groups, key=["lr", "batch", "weight_decay", "schedule", "other", "speed",
                                         "architecture"].index)
    by_name = {p.name: p.group for p in params}
    for name in ("MATRIX_LR", "EMBEDDING_LR", "UNEMBEDDING_LR", "SCALAR_LR"):
        assert by_name[name] == "lr"
    assert params[0].group == "lr"
    assert by_name["TOTAL_BATCH_TOKENS"] == "batch"
    assert by_name["WEIGHT_DECAY"] == "weight_decay"
    assert by_name["WARMDOWN_RATIO"] == by_name["FINAL_LR_FRAC"] == "schedule"
    assert by_name["DEPTH"] == by_name["MODEL_DIM"] == by_name["N_HEAD"] == "architecture"
    # The per-device batch only splits the total batch differently: a speed knob.
    assert by_name["DEVICE_BATCH_SIZE"] == "speed"
    for name in ("LOG_EVERY", "CURVE_POINTS", "EVAL_BATCH_SIZE", "ADAM_BETAS"):
        assert name not in by_name
    # In step mode a speed knob cannot change val_bpb: not searched.
    assert "DEVICE_BATCH_SIZE" not in {p.name for p in build_space(source, step_mode=True)}


def test_per_device_batch_and_accumulation_move_together():
    space = space_of("DEVICE_BATCH_SIZE = 16\nGRAD_ACCUM_STEPS = 8\nLR = 0.1\n")
    speed = space["DEVICE_BATCH_SIZE"]
    assert speed.group == "speed"
    assert speed.move(1, 0) == {"DEVICE_BATCH_SIZE": 32, "GRAD_ACCUM_STEPS": 4}
    assert speed.move(-1, 0) == {"DEVICE_BATCH_SIZE": 8, "GRAD_ACCUM_STEPS": 16}
    assert speed.move(1, 2) is None  # x16 would need a fractional accumulation
    assert space["GRAD_ACCUM_STEPS"].group == "batch"  # alone, it changes the total batch
    # Without an accumulation or total constant, the per-device batch IS the batch size.
    assert space_of("DEVICE_BATCH_SIZE = 16\n")["DEVICE_BATCH_SIZE"].group == "batch"


def test_search_plan_command_shows_the_order_and_what_is_left_out(tmp_path):
    import typer
    from typer.testing import CliRunner

    from autoloop.cli.search import search_plan

    app = typer.Typer()
    app.command()(search_plan)
    repo = make_repo(tmp_path / "repo", OBJECTIVE.replace("DEPTH = 3  # blocks; range 1..6 int",
                                                          "DEPTH = 3  # blocks; range 6..1 int"))
    result = CliRunner().invoke(app, ["--repo", str(repo)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("search plan for train.py (time budget)")
    assert lines[1].split()[:3] == ["1.", "LR", "0.0005"] and "range 0.0001..0.5" in lines[1]
    assert "WIDTH" in result.output and "powers of two" in result.output
    assert "SALT: fixed by its hint" in result.output
    assert "DEPTH: train.py line" in result.output and "is empty" in result.output  # a broken hint, named
    missing = CliRunner().invoke(app, ["--repo", str(tmp_path)])
    assert missing.exit_code != 0 and "does not exist" in str(missing.exception)


# ---------------------------------------------------------------------------------- whole runs


def test_search_finds_the_optimum_and_honours_hints(tmp_path):
    repo = make_repo(tmp_path / "repo", OBJECTIVE)
    summary = run_search(repo, max_trials=60)
    rows = rows_of(repo)
    search = [r for r in rows if r["proposer"] == "search"]
    # Every proposal is the search's; the rest are the baseline and the controller's drift checks.
    assert search == [r for r in rows if r["kind"] == "proposal"]
    assert {r["kind"] for r in rows} - {"proposal"} <= {"baseline", "drift"}

    # The neighbourhood of the optimum, within a bounded number of trials.
    first_close = next(i for i, r in enumerate(rows, 1) if r["status"] == "keep" and r["metric"] < 1.02)
    assert first_close <= 50, first_close
    best = read_constants(GitRepo.open(repo).show_file(summary.best_commit, "train.py"))
    assert 0.007 <= best["LR"].value <= 0.014
    assert best["WIDTH"].value == 256 and best["DEPTH"].value == 5 and best["USE_NORM"].value is True
    assert 0.1 <= best["WARMUP_RATIO"].value <= 0.3 and 0.02 <= best["WEIGHT_DECAY"].value <= 0.12
    assert summary.best_metric < 1.005

    # Hints: ranges, integers, powers of two; a fixed constant is never touched.
    for row in search:
        sets = sets_of(row)
        assert len(sets) == 1, sets  # one constant per trial
        assert "SALT" not in sets
        if "LR" in sets:
            assert 0.0001 <= sets["LR"] <= 0.5
        if "WIDTH" in sets:
            assert sets["WIDTH"].startswith("2**")  # written back the way it was written
            width = read_constants(GitRepo.open(repo).show_file(row["trial_commit"], "train.py"))["WIDTH"].value
            assert width & (width - 1) == 0
        if "DEPTH" in sets:
            assert isinstance(sets["DEPTH"], int) and 1 <= sets["DEPTH"] <= 6
        diff = [line for line in row["diff"].splitlines()
                if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))]
        assert len(diff) == 2  # a one-line diff
    # A constant with no effect gives exactly the parent's val_bpb: after two such ties
    # (one could be a coincidence) it is set aside for the rest of the run.
    assert len([r for r in search if "UNUSED" in sets_of(r)]) == 2


def test_search_never_repeats_a_configuration(tmp_path):
    repo = make_repo(tmp_path / "repo", OBJECTIVE)
    run_search(repo, max_trials=45)
    rows = rows_of(repo)
    git = GitRepo.open(repo)
    tried = [(r["parent_commit"], str(sets_of(r))) for r in rows if r["proposer"] == "search"]
    assert len(tried) == len(set(tried))  # no (constant, value, parent) twice
    # Nor any train.py evaluated before (drift checks re-measure the incumbent on purpose).
    contents = [hashlib.sha256(git.show_file(r["trial_commit"], "train.py").encode()).hexdigest() for r in rows
                if r["kind"] != "drift"]
    assert len(contents) == len(set(contents))


def test_resumed_run_proposes_what_an_uninterrupted_run_would(tmp_path, monkeypatch):
    """With noise, so no trial is a tie: the search state must come from the db alone."""
    monkeypatch.setenv("TEST_NOISE", "0.003")
    one = make_repo(tmp_path / "one", OBJECTIVE)
    monkeypatch.setenv("TEST_COUNTER", str(tmp_path / "one.counter"))
    run_search(one, max_trials=30)

    two = make_repo(tmp_path / "two", OBJECTIVE)
    monkeypatch.setenv("TEST_COUNTER", str(tmp_path / "two.counter"))
    first = run_search(two, max_trials=11)
    assert "max-trials" in first.stop_reason
    run_search(two, max_trials=19)  # a new controller and proposer: only the db carries the state

    expected, resumed = signature(rows_of(one)), signature(rows_of(two))
    assert len(expected) == 30 and resumed == expected
    assert len({s[2] for s in expected}) > 20  # the runs did search: many different moves
    # Both runs replay the same way, so check the replay itself too: a fresh proposer
    # recognises every recorded search trial as its own move.
    assert replayed_state(two).unmatched == 0


def replayed_state(repo: Path, **flags):
    config = resolve(repo, {"tag": "t", "proposers": "search", **flags})
    controller = Controller(config, repo, verifier=None)
    controller.open()
    try:
        proposer = SearchProposer(config)
        proposer.propose(controller.proposal_context(controller.best_commit()))
        return proposer.replayed
    finally:
        controller.close()


def test_resume_after_the_controller_is_killed_mid_trial(tmp_path):
    """SIGKILL during a search trial's training: the resumed run re-proposes that move and
    goes on exactly as a run that was never killed."""
    # No drift checks: their timing counts the interrupted trial; this is about the search's moves.
    one = make_repo(tmp_path / "one", OBJECTIVE)
    run_search(one, max_trials=16, drift_every=0)

    two = make_repo(tmp_path / "two", OBJECTIVE)
    # The controller in its own process (as `autoloop run` runs it, without the harness
    # verifier: the fake has no model), killed by the fault point.
    code = ("import sys\nfrom autoloop.config import resolve\nfrom autoloop.loop.controller import Controller\n"
            "flags = {'tag': 't', 'proposers': 'search', 'time_budget': 30, 'grace_seconds': 30, 'max_trials': 16,\n"
            "         'drift_every': 0}\n"
            "Controller(resolve(sys.argv[1], flags), sys.argv[1], verifier=None).run()\n")
    died = subprocess.run([sys.executable, "-c", code, str(two)], cwd=two, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "AUTOLOOP_FAULT": "during_training:7"})
    assert died.returncode == -signal.SIGKILL, died.stdout + died.stderr
    # The fault fires at the 7th training run (a trial can be several runs): resume for the rest of the 16 trials.
    done = [r for r in rows_of(two) if r["status"] != "interrupted"]
    assert 3 <= len(done) < 7
    run_search(two, max_trials=16 - len(done), drift_every=0)
    rows = rows_of(two)
    interrupted = [r for r in rows if r["status"] == "interrupted"]
    assert len(interrupted) == 1 and interrupted[0]["proposer"] == "search"
    again = next(r for r in rows if r["number"] == interrupted[0]["number"] + 1)
    assert sets_of(again) == sets_of(interrupted[0])  # the same move, proposed again
    # The same moves in the same order (how many trials an invocation counts around a
    # recovery is the controller's business: compare what both runs did).
    resumed, straight = signature(rows), signature(rows_of(one))
    n = min(len(resumed), len(straight))
    assert n >= 14 and resumed[:n] == straight[:n]
    assert replayed_state(two).unmatched == 0


def test_interrupted_trial_is_not_evidence(fake_repo):
    """Marking a finished search trial interrupted makes the search propose it again."""
    run_search(fake_repo, max_trials=4)  # baseline, LR x2, SLEEP +0.1, WIDTH x2: the last is discarded
    config = resolve(fake_repo, {"tag": "t", "proposers": "search"})
    controller = Controller(config, fake_repo, verifier=None)
    controller.open()
    try:
        last = controller.store.trials(controller.run_row["id"])[-1]
        assert last["proposer"] == "search" and last["status"] == "discard"
        before = SearchProposer(config).propose(controller.proposal_context(controller.best_commit()))
        controller.store.update_trial(last["id"], status="interrupted")
        again = SearchProposer(config).propose(controller.proposal_context(controller.best_commit()))
        # Running (another worker trains it now): not evidence, and not proposed a second time.
        controller.store.update_trial(last["id"], status="running")
        beside = SearchProposer(config).propose(controller.proposal_context(controller.best_commit()))
    finally:
        controller.close()
    assert before.edits[0].sets != sets_of(last)
    assert again.edits[0].sets == sets_of(last) and again.description == last["description"]
    assert beside.edits[0].sets != sets_of(last), beside.description


def test_default_chain_is_ideas_then_search(fake_repo):
    config = resolve(fake_repo, {"tag": "t"})
    # Without an LLM or agent configured, the default chain is the human's ideas, then search.
    assert build_chain(config).names == ["ideas", "search"]
    seed_idea(config, fake_repo, "a much higher lr", sets=["LR=0.1"], patch=None)
    Controller(resolve(fake_repo, {"tag": "t", "max_trials": 6, "time_budget": 30}), fake_repo,
               verifier=None).run()
    rows = rows_of(fake_repo)
    assert [r["proposer"] for r in rows[1:]] == ["human"] + ["search"] * 4
    # The human's LR=0.1 was discarded on the base commit; the search's first move is LR x2
    # there (0.04), and it never proposes LR=0.1 on that parent.
    assert all(sets_of(r) != {"LR": 0.1} for r in rows[2:])
    assert sets_of(rows[2]) == {"LR": 0.04}


def test_human_keep_between_search_trials_moves_the_parent(fake_repo):
    """A kept idea in the middle of a search: the search's next trial starts from the new best."""
    run_search(fake_repo, max_trials=4, proposers="ideas,search")
    config = resolve(fake_repo, {})
    seed_idea(config, fake_repo, "the known-good lr", sets=["LR=0.01"], patch=None)
    run_search(fake_repo, max_trials=4, proposers="ideas,search")
    rows = rows_of(fake_repo)
    human = next(r for r in rows if r["proposer"] == "human")
    assert human["status"] == "keep"
    after = [r for r in rows if r["number"] > human["number"]]
    assert after and all(r["parent_commit"] == human["trial_commit"] for r in after[:1])
    assert all(r["proposer"] == "search" for r in after)


def test_search_converges_and_stops(tmp_path):
    # Every constant of the fake but LR is fixed (whatever knobs the fake grows).
    source = re.sub(r"^((?!LR )[A-Z][A-Z0-9_]* = [^#\n]*)#.*$", r"\1# fixed", FAKE_TRAIN.read_text(), flags=re.MULTILINE)
    assert "LR = 0.02  # learning rate" in source and "WIDTH = 64  # fixed" in source
    repo = make_repo(tmp_path / "repo", source)
    summary = run_search(repo, max_trials=40)
    assert "no more proposals" in summary.stop_reason
    assert summary.trials_run < 40
    assert summary.best_metric < 1.002  # LR near 0.01
    rows = rows_of(repo)
    assert all(set(sets_of(r)) == {"LR"} for r in rows if r["kind"] == "proposal")


@pytest.mark.slow
def test_real_train_py_in_step_mode(tmp_path, embedded_dataset):
    """Search proposals on the real train.py: committed, trained on the CPU, kept or archived."""
    repo = make_repo(tmp_path / "repo", (REPO_ROOT / "train.py").read_text())
    summary = Controller(resolve(repo, {"tag": "t", "proposers": "search", "max_steps": 3, "max_trials": 4,
                                        "grace_seconds": 600}), repo, verifier=None).run()
    rows = rows_of(repo)
    assert [r["proposer"] for r in rows[1:]] == ["search"] * 3
    git = GitRepo.open(repo)
    archived = git.archived("t")
    for row in rows[1:]:
        assert row["status"] in ("keep", "discard"), row["reason"]
        assert row["metric"] is not None and math.isfinite(row["metric"])
        assert row["num_steps"] == 3
        assert "_LR" in next(iter(sets_of(row)))  # learning rates come first
        assert git.show_file(row["trial_commit"], "train.py") != git.show_file(row["parent_commit"], "train.py")
        if row["status"] == "keep":
            assert git.is_ancestor(row["trial_commit"], summary.best_commit)
        else:
            assert archived[row["number"]] == row["trial_commit"]
    assert git.branch_commit("autoloop/t") == summary.best_commit


# ---------------------------------------------------------------------------- noise-aware reading of results


def _noisy_trial(diff: float, se: float, *, status: str = "discard", n: int = 3, near_miss: bool = False) -> dict:
    """A trial row as the noise-aware controller stores it (see autoloop.decide.effects)."""
    low, high = diff - 2.3 * se, diff + 2.3 * se
    return {"status": status, "metric": 2.5 + diff, "best_before": 2.5, "delta": diff, "n_runs": n,
            "metric_sd": se, "decision": {"mean_diff": diff, "se": se, "low": low, "high": high, "n": n,
                                          "near_miss": near_miss, "distinguishable": not low <= 0 <= high}}


def test_a_difference_within_the_noise_moved_nothing():
    from autoloop.proposers.search import FAILURE, INERT, SUCCESS, observed_change, outcome_of

    # Large but inside the noise: no evidence the constant matters.
    assert observed_change(_noisy_trial(0.030, 0.020)) == 0.0
    assert observed_change(_noisy_trial(-0.004, 0.001)) == pytest.approx(0.004)  # small but real
    assert observed_change(_noisy_trial(-0.004, 0.001, status="keep")) == pytest.approx(0.004)
    # A trial of one run from an old database: the bare delta, as before.
    assert observed_change({"status": "discard", "metric": 2.53, "best_before": 2.5, "delta": 0.03}) == \
        pytest.approx(0.03)
    assert outcome_of(_noisy_trial(0.0, 0.0)) == INERT  # identical runs at every shared seed
    assert outcome_of(_noisy_trial(0.001, 0.002, near_miss=False)) == FAILURE
    assert outcome_of(_noisy_trial(-0.02, 0.001, status="keep")) == SUCCESS
    assert outcome_of({"status": "discard", "metric": 2.5, "best_before": 2.5}) == INERT


@pytest.mark.parametrize("noise_aware", [True, False])
def test_the_next_sweep_follows_real_effects_not_noise(noise_aware):
    """LR's trial moved val_bpb by 0.030, DEPTH's by 0.004. With one run each (an old
    run) the search goes back to LR first; measured with uncertainty, LR's 0.030 is
    within the noise and DEPTH's 0.004 is real, so DEPTH goes first."""
    from autoloop.proposers.search import FAILURE, SearchState, observed_change

    source = "LR = 0.02\nDEPTH = 8\n"
    params = build_space(source, step_mode=False)
    assert [p.name for p in params] == ["LR", "DEPTH"]  # the order of attack
    results = {"LR": _noisy_trial(0.030, 0.020), "DEPTH": _noisy_trial(0.004, 0.001)}
    if not noise_aware:
        results = {k: {"status": "discard", "delta": v["delta"], "metric": v["metric"], "best_before": 2.5}
                   for k, v in results.items()}
    state, seen = SearchState(), set()
    for expected in ("LR", "DEPTH"):  # the screen: one trial per constant
        move = state.next_move(params, "p", source, seen)
        assert move.param.name == expected
        seen.add(move.digest)
        state.observe(FAILURE, observed_change(results[expected]))
    following = state.next_move(params, "p", source, seen)
    assert following.param.name == ("DEPTH" if noise_aware else "LR")


def test_the_lr_range_test_places_the_first_learning_rate_step(tmp_path):
    repo = make_repo(tmp_path / "repo", FAKE_TRAIN.read_text())
    run_search(repo, max_trials=1, drift_every=0)
    store = Store(repo / "experiments.db")
    try:
        run = store.get_run("t")
        store.update_run(run["id"], check_result={"lr": {
            "status": "ok", "message": "diverges at x10 the current LRs: suggested peak x0.5",
            "suggested_multiplier": 0.5, "suggested_constants": {"LR": 0.01}}})
    finally:
        store.close()
    run_search(repo, max_trials=2, drift_every=0)
    rows = rows_of(repo)
    first = rows[1]
    assert first["description"].startswith("LR range test's suggestion") and sets_of(first) == {"LR": 0.01}
    assert not rows[2]["description"].startswith("LR range test")  # once per run


def test_the_search_never_proposes_a_move_that_breaks_an_assert_of_train_py():
    """N_KV_HEAD 4 -> 8 with N_HEAD = 4 would crash as an AssertionError: blocked like a
    bound, so the visit goes the other way (4 -> 2), and no move breaks the assert."""
    from autoloop.proposers.search import FAILURE, SearchState
    from autoloop.pyconst import set_constants

    source = ("N_HEAD = 4  # query heads; range 1..16 pow2\nN_KV_HEAD = 4  # key/value heads; range 1..16 pow2\n\n"
              "def config():\n    return {'n_head': N_HEAD, 'n_kv_head': N_KV_HEAD}\n\n"
              "def attention(cfg):\n    assert cfg['n_head'] % cfg['n_kv_head'] == 0\n")
    params = build_space(source, step_mode=False)
    state, seen, moves = SearchState(), set(), []
    for _ in range(30):
        move = state.next_move(params, "p", source, seen)
        if move is None:
            break
        moves.append(move.sets)
        seen.add(move.digest)
        state.observe(FAILURE)
    values = [read_constants(set_constants(source, sets)) for sets in moves]
    assert all(v["N_HEAD"].value % v["N_KV_HEAD"].value == 0 for v in values), moves
    assert {"N_KV_HEAD": 2} in moves and {"N_KV_HEAD": 8} not in moves
    assert {"N_HEAD": 8} in moves and {"N_HEAD": 2} not in moves


def test_speed_and_memory_knobs_are_not_searched_in_step_mode():
    """LOSS_CHUNK_BYTES (the loss's working memory) and ATTENTION_AUTO_MARGIN (which kernel
    runs attention) change how fast the same maths runs, never what is learned: in step
    mode a trial of either can only tie, so neither is searched; on a time budget they are
    speed knobs, after the quality constants."""
    from autoloop.proposers.search_space import explain_space

    source = (REPO_ROOT / "train.py").read_text()
    searched, skipped = explain_space(source, step_mode=True)
    names = {p.name for p in searched}
    why = dict(skipped)
    for knob in ("LOSS_CHUNK_BYTES", "ATTENTION_AUTO_MARGIN", "DEVICE_BATCH_SIZE"):
        assert knob not in names
        assert why[knob] == "a speed or memory knob: it cannot change val_bpb in step mode"
    assert {"MATRIX_LR", "LOGIT_SOFTCAP", "MUON_NS_STEPS"} <= names  # what is learned still is
    by_name = {p.name: p.group for p in build_space(source, step_mode=False)}
    assert by_name["LOSS_CHUNK_BYTES"] == by_name["ATTENTION_AUTO_MARGIN"] == "speed"
    # The hint is the mechanism: any constant can be marked so, its moves unchanged.
    marked = space_of("CHUNK = 2**20  # bytes per chunk; speed\nLR = 0.1\n")
    assert marked["CHUNK"].group == "speed" and marked["CHUNK"].move(1, 0) == {"CHUNK": "2**21"}
    assert parse_hints("bytes per chunk; speed").speed and not parse_hints("the speed of light").speed
