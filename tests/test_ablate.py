"""`autoloop ablate` and `finalize --drop-null`: reverting kept changes from the best
commit, the paired effect of each on known inputs, and a whole run of the real
controller on a fake training script whose kept changes have KNOWN effects."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autoloop.review.ablate import (
    AblationRow, Ablation, NotRevertible, ablation_ref, effect_figures, format_ablation, reverse_applied,
)
from autoloop.cli import app
from autoloop.decide.rule import Noise
from autoloop.decide.effects import ablation_effect
from autoloop.gitops import GitRepo

from conftest import copy_run, make_repo

runner = CliRunner()


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def commit_all(repo: Path, message: str) -> str:
    git(repo, "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qam", message)
    return git(repo, "rev-parse", "HEAD").strip()


# ---------------------------------------------------------------------------- reverting a change


def test_a_change_is_reverse_applied_to_a_later_commit(tmp_path):
    repo = make_repo(tmp_path / "r", "A = 0\nB = 0\nC = 0\n", {"notes.txt": "one\n"})
    base = git(repo, "rev-parse", "HEAD").strip()
    (repo / "train.py").write_text("A = 1\nB = 0\nC = 0\n")
    first = commit_all(repo, "A")
    (repo / "train.py").write_text("A = 1\nB = 1\nC = 0\n")
    (repo / "notes.txt").write_text("one\ntwo\n")
    second = commit_all(repo, "B")
    (repo / "train.py").write_text("A = 1\nB = 2\nC = 0\n")
    third = commit_all(repo, "B again")
    g = GitRepo.open(repo)
    head_before, status_before = git(repo, "rev-parse", "HEAD"), git(repo, "status", "--porcelain")

    tree, files = reverse_applied(g, third, [g.diff(base, first)])
    assert files == {"train.py": b"A = 0\nB = 2\nC = 0\n"}
    assert git(repo, "show", f"{tree}:train.py") == "A = 0\nB = 2\nC = 0\n"
    sha = g.commit_files(third, files, "without A")
    assert git(repo, "show", f"{sha}:train.py") == "A = 0\nB = 2\nC = 0\n"
    assert git(repo, "show", f"{sha}:notes.txt") == "one\ntwo\n"
    # Nothing moved: the worktree, the index and the branch are as they were.
    assert (git(repo, "rev-parse", "HEAD"), git(repo, "status", "--porcelain")) == (head_before, status_before)

    # B's line was rewritten later: its change no longer reverts, and git says why.
    with pytest.raises(NotRevertible, match="no longer reverts cleanly"):
        reverse_applied(g, third, [g.diff(first, second)])
    with pytest.raises(NotRevertible, match="no diff"):
        reverse_applied(g, third, [""])
    # Several changes at once, latest first.
    _tree, files = reverse_applied(g, third, [g.diff(second, third), g.diff(first, second)])
    assert files == {"train.py": b"A = 1\nB = 0\nC = 0\n", "notes.txt": b"one\n"}
    assert ablation_ref("night", 7) == "refs/autoloop/night/ablations/7"


# ---------------------------------------------------------------------------- the effect, on known inputs


def test_effect_of_a_change_that_helps_with_the_pooled_noise():
    best = {1: 1.90, 2: 1.91, 3: 1.92}
    ablated = {1: 1.95, 2: 1.96, 3: 1.97}  # every pair: -0.05
    f = effect_figures(best, ablated, Noise(run_sd=0.01, pair_sd=0.01, df=10), kept_trial=4)
    half = 2.228138851986 * 0.01 / math.sqrt(3)  # t(0.975, 10 df) * pair_sd / sqrt(n)
    assert f["effect"] == pytest.approx(-0.05)
    assert (f["low"], f["high"]) == (pytest.approx(-0.05 - half, abs=1e-9), pytest.approx(-0.05 + half, abs=1e-9))
    assert f["n"] == 3 and f["seeds"] == [1, 2, 3] and f["null"] is False and f["drop"] is False
    assert f["kept_trial"] == 4 and f["level"] == 0.95


def test_effect_indistinguishable_from_zero_is_null_and_a_harmful_one_is_dropped_too():
    best = {1: 2.00, 2: 2.01, 3: 2.02}
    # Differences +0.01, -0.01, 0: mean 0, sd 0.01 (2 df): t(0.975, 2) = 4.303.
    f = effect_figures(best, {1: 1.99, 2: 2.02, 3: 2.02}, None, kept_trial=2)
    assert f["effect"] == pytest.approx(0.0, abs=1e-12)
    assert f["high"] == pytest.approx(4.302652729911 * 0.01 / math.sqrt(3), rel=1e-6)
    assert f["null"] is True and f["drop"] is True
    harmful = effect_figures(best, {1: 1.95, 2: 1.96, 3: 1.97}, Noise(0.01, 0.01, 10), kept_trial=2)
    assert harmful["effect"] == pytest.approx(0.05) and harmful["null"] is False and harmful["drop"] is True
    # One pair and no noise yet: the interval is unbounded, stored as null, and nothing is claimed.
    one = effect_figures({1: 2.0}, {1: 2.1}, None, kept_trial=2)
    assert one["low"] is None and one["high"] is None and one["null"] is True and one["n"] == 1
    json.dumps(one, allow_nan=False)  # storable as JSON
    a = ablation_effect({"decision": harmful})
    assert a.drop is True and a.null is False


def test_the_table():
    result = Ablation(run="night", best_trial=5, best_commit="f" * 40, seeds=[1, 2, 3], rows=[
        AblationRow(trial=2, description="lr 0.02", ablation=6, status="discard", effect=-0.05, low=-0.06,
                    high=-0.04, n=3, null=False, drop=False),
        AblationRow(trial=3, description="warmup", ablation=7, status="discard", effect=0.0, low=-0.01, high=0.01,
                    n=3, null=True, drop=True),
        AblationRow(trial=4, description="rewritten later", reason="it no longer reverts cleanly (error: ...)"),
    ])
    lines = format_ablation(result).splitlines()
    assert lines[2].split() == ["2", "-0.0500", "-0.0600..-0.0400", "3", "6", "lr", "0.02:", "helps"]
    assert lines[3].endswith("warmup: candidate to drop")
    assert "rewritten later: skipped: it no longer reverts cleanly" in lines[4]
    assert lines[-1].startswith("candidates to drop: trial 3;")


# ---------------------------------------------------------------------------- a whole run

# val_bpb = 2.0 - 0.05 * FEATURE_B * (1 - FEATURE_A) - 0.1 * FEATURE_A - 0.02 * FEATURE_C + seed noise.
# The ideas are kept in this order:
#   B (2.0 -> 1.95: real when kept), A (-> 1.90: it makes B redundant), C = 1 (-> 1.88), C = 2 (-> 1.86).
# In the best commit (A = B = 1, C = 2): reverting B changes nothing (effect exactly 0: null, to drop);
# reverting A gives 1.95 (effect -0.05: helps); C = 1 cannot be reverted (C = 2 rewrote its line);
# reverting C = 2 gives C = 1, 1.88 (effect -0.02: helps). The seed noise is the same for every
# commit at one seed (the init and data stream of that seed), so it cancels in every pair.
KNOWN = '''"""A fake train.py whose kept changes have known effects (tests/test_ablate.py)."""
import json
import os
import random

FEATURE_A = 0  # the real improvement
FEATURE_B = 0  # helps alone, redundant once FEATURE_A is on
FEATURE_C = 0  # a small improvement per unit


def true_bpb():
    return 2.0 - 0.05 * FEATURE_B * (1 - FEATURE_A) - 0.1 * FEATURE_A - 0.02 * FEATURE_C


if __name__ == "__main__":
    seed = int(os.environ.get("AUTOLOOP_SEED", "0"))
    value = true_bpb() + random.Random(seed).gauss(0.0, 0.01)
    result = {"val_bpb": value, "training_seconds": 0.0, "total_seconds": 0.0, "compile_seconds": 0.0,
              "eval_seconds": 0.0, "num_steps": 1, "total_tokens": 1, "num_params": 1, "mfu_percent": None,
              "peak_memory_mb": 0.0, "device": "cpu", "seed": seed, "curve": []}
    if os.environ.get("AUTOLOOP_RESULT"):
        with open(os.environ["AUTOLOOP_RESULT"], "w") as handle:
            json.dump(result, handle)
    print("---")
    print(f"val_bpb: {value:.6f}")
'''
IDEAS = [("B", {"FEATURE_B": "1"}), ("A", {"FEATURE_A": "1"}), ("C one", {"FEATURE_C": "1"}),
         ("C two", {"FEATURE_C": "2"})]


@pytest.fixture(scope="module")
def known_run_once(tmp_path_factory, session_cache) -> Path:
    """A run of the real controller over KNOWN: baseline, then the four ideas, all kept."""
    with pytest.MonkeyPatch.context() as mp:  # what conftest's autouse fixture does per test
        mp.setenv("AUTOLOOP_CACHE_DIR", str(session_cache))
        for name in ("AUTOLOOP_TIME_BUDGET", "AUTOLOOP_MAX_STEPS", "AUTOLOOP_TAG", "AUTOLOOP_FAULT", "AUTOLOOP_SEED"):
            mp.delenv(name, raising=False)
        return _known_run(tmp_path_factory.mktemp("known"))


def _known_run(root: Path) -> Path:
    from autoloop.config import resolve
    from autoloop.loop.controller import Controller
    from autoloop.store import Store

    repo = make_repo(root / "repo", KNOWN)
    # The paired rule: its repeated pairs measure the (exactly cancelling) paired noise the
    # ablation intervals are read against; the default's one pair per trial would not.
    config = resolve(repo, {"tag": "k", "proposers": "ideas", "max_steps": 1, "grace_seconds": 30, "seed": 1,
                            "max_trials": 5, "decision_rule": "paired"})
    store = Store(repo / config.db)
    try:
        for text, sets in IDEAS:
            store.add_idea(text, sets=sets, source="human")
    finally:
        store.close()
    Controller(config, repo, verifier=None).run()
    rows = trials(repo)
    assert [(t["kind"], t["status"]) for t in rows] == [("baseline", "keep")] + [("proposal", "keep")] * 4, \
        [(t["number"], t["status"], t["reason"]) for t in rows]
    return repo


@pytest.fixture
def known_run(known_run_once, tmp_path) -> Path:
    """A private copy of the run (git, db, .autoloop/) for a test that writes."""
    return copy_run(known_run_once, tmp_path / "repo")


def trials(repo: Path) -> list[dict]:
    from autoloop.store import Store

    store = Store(repo / "experiments.db")
    try:
        return store.trials(store.runs()[-1]["id"])
    finally:
        store.close()


def ablate_known(repo: Path, **options):
    """`autoloop ablate --tag k` as the command runs it, with the verifier off: the fake
    script has no model for the harness to evaluate (the one thing the CLI cannot do)."""
    from autoloop.review.ablate import ablate_run
    from autoloop.store import Store

    store = Store(repo / "experiments.db")
    try:
        run = store.get_run("k")
    finally:
        store.close()
    return ablate_run(repo, run, verifier=None, **options)


def cli(repo: Path, *args: str):
    result = runner.invoke(app, [*args, "--repo", str(repo)])
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


def test_ablate_finds_the_known_effects_and_finalize_drops_the_null_change(known_run):
    repo = known_run
    before = {t["number"]: t for t in trials(repo)}
    best_commit = git(repo, "rev-parse", "autoloop/k").strip()
    out = ablate_known(repo, seeds=3).to_dict()
    assert out["best_trial"] == 5 and out["best_commit"] == best_commit and out["seeds"] == [1, 2, 3]
    rows = {r["trial"]: r for r in out["rows"]}
    assert list(rows) == [2, 3, 4, 5]  # the kept changes, in order

    # B (trial 2): redundant in the best commit: exactly no effect, a candidate to drop.
    assert rows[2]["effect"] == pytest.approx(0.0, abs=1e-12)
    assert rows[2]["null"] is True and rows[2]["drop"] is True
    # A (trial 3): its interval excludes 0 and holds the true effect.
    assert rows[3]["effect"] == pytest.approx(-0.05, abs=1e-9)
    assert rows[3]["high"] < 0 and rows[3]["low"] <= -0.05 <= rows[3]["high"] and rows[3]["null"] is False
    # C = 1 (trial 4) was rewritten by C = 2: skipped, with the reason.
    assert rows[4]["ablation"] is None and "no longer reverts cleanly" in rows[4]["reason"]
    # C = 2 (trial 5): reverting it gives C = 1.
    assert rows[5]["effect"] == pytest.approx(-0.02, abs=1e-9) and rows[5]["null"] is False

    # The ablation trials: recorded, measured at the same seeds as the best, reachable, shown.
    after = {t["number"]: t for t in trials(repo)}
    for kept, row in ((2, rows[2]), (3, rows[3]), (5, rows[5])):
        t = after[row["ablation"]]
        assert t["kind"] == "ablation" and t["status"] == "discard"
        assert t["derived_from"] == before[kept]["id"] and t["parent_commit"] == best_commit
        assert git(repo, "rev-parse", ablation_ref("k", t["number"])).strip() == t["trial_commit"] == row["commit"]
        assert t["decision"]["effect"] == pytest.approx(row["effect"]) and t["decision"]["n"] == 3
        assert t["n_runs"] == 3
    from autoloop.store import Store

    store = Store(repo / "experiments.db")
    try:
        best_runs = {m["seed"] for m in store.measurements(before[5]["id"]) if m.get("status") in (None, "ok")}
        ablated = [m for m in store.measurements(after[rows[3]["ablation"]]["id"])]
    finally:
        store.close()
    assert {1, 2, 3} <= best_runs
    assert sorted(m["seed"] for m in ablated) == [1, 2, 3] and {m["role"] for m in ablated} == {"ablation"}
    # A's reverted commit has FEATURE_A = 0 and nothing else changed.
    reverted = git(repo, "show", f"{rows[3]['commit']}:train.py")
    assert "FEATURE_A = 0" in reverted and "FEATURE_B = 1" in reverted and "FEATURE_C = 2" in reverted
    # The run's branch and worktree are back on the best commit.
    assert git(repo, "rev-parse", "HEAD").strip() == best_commit and git(repo, "status", "--porcelain") == ""

    shown = cli(repo, "show", str(rows[2]["ablation"]), "--no-diff")
    assert "reverts the change of trial 2 in the best commit" in shown and "candidate to drop" in shown
    assert f"trial {rows[3]['ablation']}: effect -0.0500" in cli(repo, "show", "3", "--no-diff")

    # finalize --drop-null leaves B out; the tree is the best commit's without it.
    done = cli(repo, "finalize", "--tag", "k", "--drop-null", "--json")
    result = json.loads(done)
    assert result["dropped"] == [2] and result["trials"] == [3, 4, 5]
    final = git(repo, "show", "final/k:train.py")
    assert "FEATURE_B = 0" in final and "FEATURE_A = 1" in final and "FEATURE_C = 2" in final
    assert git(repo, "show", "final/k:train.py") == git(repo, "show", f"{rows[2]['commit']}:train.py")
    message = git(repo, "log", "-1", "--format=%B", "final/k")
    assert "Left out" in message and "trial 2: B" in message and "Autoloop-Dropped: 2" in message
    assert result["checkpoint"] is None and "leaves out" in result["checkpoint_note"]
    per_trial = json.loads(cli(repo, "finalize", "--tag", "k", "--drop-null", "--per-trial", "--branch", "f2", "--json"))
    assert git(repo, "show", "f2:train.py") == final and len(per_trial["commits"]) == 3
    # Without --drop-null: every kept change, the best commit's tree.
    plain = json.loads(cli(repo, "finalize", "--tag", "k", "--branch", "f3", "--json"))
    assert plain["dropped"] == [] and git(repo, "show", "f3:train.py") == git(repo, "show", f"{best_commit}:train.py")

    page = Path(cli(repo, "report", "--tag", "k", "--out", str(repo / "r")).split()[1]).read_text()
    table = page.split('<table id="ablation">')[1].split("</table>")[0]
    assert 'class="drop"' in table and "candidate to drop" in table and "-0.0500" in table


def test_drop_null_needs_a_current_ablation(known_run):
    result = runner.invoke(app, ["finalize", "--tag", "k", "--drop-null", "--repo", str(known_run)])
    assert result.exit_code == 1
    assert result.output.strip() == ("error: run 'k' has no ablation yet, so nothing is known to be null: run "
                                     "`autoloop ablate --tag k` first, or finalize without --drop-null")


def test_ablate_says_in_one_line_when_there_is_nothing_to_ablate(fake_repo):
    from autoloop.config import resolve
    from autoloop.loop.controller import Controller

    Controller(resolve(fake_repo, {"tag": "b", "max_trials": 1, "time_budget": 5}), fake_repo, verifier=None).run()
    for args, message, status in (
        (["--seeds", "3"], "run 'b' tried no change yet (only its baseline ran), so there is nothing to ablate: "
                           "`autoloop run --tag b --max-trials 10` resumes it with more trials, and `autoloop seed` "
                           "queues your own ideas first", 0),  # an answer, not an error (tests/test_nothing_kept.py)
        (["--seeds", "0"], "error: --seeds 0 measures nothing: give 1 or more (3 by default)", 1),
    ):
        result = runner.invoke(app, ["ablate", "--tag", "b", *args, "--repo", str(fake_repo)])
        assert result.exit_code == status and result.output.strip() == message, result.output
    assert [t["kind"] for t in trials(fake_repo)] == ["baseline"]  # nothing was recorded
    assert git(fake_repo, "status", "--porcelain") == ""
    from autoloop.store import Store

    with Store(fake_repo / "experiments.db") as store:
        assert store.get_run("b")["status"] == "finished"  # ablating did not make it look active
