"""The fixture run of the review tests: a real tiny CPU run, made by the real Controller.

The repository's train.py is the fake training script (tests/fakes/fake_train.py) plus
a few lines that save a "checkpoint" (its constants, as JSON), so finalize has weights
to keep. Ideas are seeded so that the run has every outcome, in a known order:

    1 baseline keep        LR=0.02: 1.0906
    2 lr 0.015        keep     1.0310
    3 crash it        crash    (RuntimeError: CUDA error: an illegal memory access was encountered (pretend))
    4 lr 0.01         keep     1.0000
    5 wider           discard  1.1000
    6 broken constant invalid  (syntax error)
    7 hang            timeout  (killed at the 1+2 s deadline)
    8 lr 0.012        discard  1.0063
    9 crash again     crash    (the same reason as 3)

plus one text-only idea that the ideas proposer leaves pending.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
from pathlib import Path

from conftest import FAKE_TRAIN, copy_run, make_repo

TAG = "night"
CHECKPOINTING = '''

if __name__ == "__main__" and os.environ.get("AUTOLOOP_CHECKPOINT"):
    # The fake's "weights": enough to tell which trial's checkpoint was kept.
    with open(os.environ["AUTOLOOP_CHECKPOINT"], "w") as handle:
        json.dump({"LR": LR, "WIDTH": WIDTH}, handle)
'''
IDEAS = [
    ("lr 0.015", {"LR": "0.015"}),
    ("crash it", {"MODE": "'crash'"}),
    ("lr 0.01", {"LR": "0.01"}),
    ("wider", {"WIDTH": "128"}),
    ("broken constant", {"WIDTH": "(64"}),
    ("hang", {"MODE": "'hang'"}),
    ("lr 0.012", {"LR": "0.012"}),
    ("crash again", {"MODE": "'crash'", "LR": "0.03"}),
    ("try rotary embeddings", None),
]
EXPECTED = {  # number: (kind, status)
    1: ("baseline", "keep"), 2: ("proposal", "keep"), 3: ("proposal", "crash"), 4: ("proposal", "keep"),
    5: ("proposal", "discard"), 6: ("proposal", "invalid"), 7: ("proposal", "timeout"), 8: ("proposal", "discard"),
    9: ("proposal", "crash"),
}
GIT_ENV = {"GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "t@example.com"}


def build_run(root: Path) -> Path:
    """Make the repository and run the real controller over it; returns the repo path."""
    from autoloop.config import resolve
    from autoloop.loop.controller import Controller
    from autoloop.store import Store

    repo = make_repo(root / "repo", FAKE_TRAIN.read_text() + CHECKPOINTING)
    config = resolve(repo, {"tag": TAG, "time_budget": 1, "grace_seconds": 2, "max_trials": 30,
                            "proposers": "ideas"})
    store = Store(repo / config.db)
    try:
        for text, sets in IDEAS:
            store.add_idea(text, sets=sets, source="human")
    finally:
        store.close()
    # verifier=None: the fake has no model to rebuild; its metric is the harness kind.
    summary = Controller(config, repo, verifier=None).run()
    assert summary.trials_run == len(EXPECTED), summary
    return repo


WRITER = """
import sys
from autoloop.config import resolve
from autoloop.loop.controller import Controller

repo = sys.argv[1]
config = resolve(repo, {"tag": sys.argv[2], "time_budget": 1, "grace_seconds": 2, "max_trials": int(sys.argv[3]),
                        "proposers": "ideas", "allow_env_change": True})  # the harness may change meanwhile
Controller(config, repo, verifier=None).run()
"""


def db_rows(repo: Path, sql: str, params=()) -> list[dict]:
    """Read the db with plain sqlite3: the tests' independent view of the truth."""
    conn = sqlite3.connect(repo / "experiments.db")
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(sql, params).fetchall()]
    finally:
        conn.close()


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout


# ---------------------------------------------------------------------------- a noise-aware run

NOISY_TAG = "noisy"
NOISE = {"noise_sd": 0.006, "noise_pair_sd": 0.004, "noise_df": 8, "decision_rule": "paired"}
DRIFT_MESSAGE = "the incumbent shifted by +0.0150 (noise: paired sd 0.0040): another process on the GPU?"
NOISE_MESSAGE = "noise estimate updated: one run sd 0.0060, paired sd 0.0040 (8 df)"


def _decision(action: str, mean_diff: float, se: float, n: int, *, near_miss: bool = False, why: str) -> dict:
    low, high = mean_diff - 2.306 * se, mean_diff + 2.306 * se  # t(0.975, 8 df)
    return {"action": action, "reason": why, "rule": "paired", "n": n, "mean_diff": mean_diff, "se": se,
            "low": low, "high": high, "statistic": mean_diff / se, "bound": 2.306, "stopped_because": why,
            "near_miss": near_miss, "distinguishable": not low <= 0.0 <= high}


def build_noisy_db(repo: Path) -> dict[str, dict]:
    """An experiments.db written through the Store API the way the noise-aware
    controller writes it: trials that own several measurements (at seeds 1, 2, 3),
    incumbent re-measurements for a candidate, decisions with their figures, a near
    miss, a diagnosis flag, a drift check with its event, an ablation trial. Returns
    {name: trial row} for the tests' expectations.

        1 baseline  keep     2.6000 ± 0.0029 (3)
        2 proposal  keep     2.5431 ± 0.0023 (3)   -0.0569, distinguishable
        3 proposal  discard  2.5420 ± 0.0040 (2)   near miss (flag slow_start)
        4 proposal  discard  2.7000 (1 run)        clearly worse after one run
        5 drift     discard  2.5581                the incumbent re-measured: drift event
        6 proposal  discard  2.5451 ± 0.0017 (3)   not distinguishable, not a near miss (decide's names)
        7 ablation  discard  2.6000 ± 0.0020 (3)   trial 2 reverted: effect -0.0569
    """
    from autoloop.store import Store

    repo.mkdir(parents=True, exist_ok=True)
    store = Store(repo / "experiments.db")
    try:
        run = store.create_run(NOISY_TAG, branch=f"autoloop/{NOISY_TAG}", base_commit="a" * 40, best_commit="b" * 40,
                               config={"seed": 1, "max_steps": 100, "keep_margin": 0.0}, status="finished", **NOISE)
        rid = run["id"]
        made: dict[str, dict] = {}

        def trial(name, kind, status, runs, *, role="candidate", seeds=(1, 2, 3), **fields):
            t = store.new_trial(rid, kind, **fields)
            for seed, value in zip(seeds, runs):
                store.add_measurement(t["id"], value, seed=seed, role=role, status="ok", num_steps=100,
                                      training_seconds=1.5, wall_seconds=2.0, eval_seconds=0.2,
                                      heldout_metric=value + 0.01 if fields.get("heldout_metric") else None,
                                      verified=1 if status == "keep" else 0)
            mean = sum(runs) / len(runs)
            n = len(runs)
            sd = (sum((v - mean) ** 2 for v in runs) / (n - 1)) ** 0.5 if n > 1 else None
            store.update_trial(t["id"], status=status, metric=mean, metric_sd=sd / n ** 0.5 if sd is not None else None,
                               n_runs=n, metric_source="verified" if status == "keep" else "harness",
                               wall_seconds=6.0 * n)
            made[name] = store.trial_by_id(t["id"])
            return made[name]

        base = trial("baseline", "baseline", "keep", [2.595, 2.600, 2.605], role="baseline", description="baseline",
                     trial_commit="a" * 40, reason="first result", heldout_metric=2.61)
        kept = trial("kept", "proposal", "keep", [2.5391, 2.5431, 2.5471], description="lr 0.02",
                     parent_commit="a" * 40, trial_commit="b" * 40, best_before=base["metric"], heldout_metric=2.553,
                     decision=_decision("keep", -0.0569, 0.0023, 3, why="interval excludes 0"),
                     reason="kept: -0.0569 ± 0.0023 (95% CI -0.0622..-0.0516)")
        store.update_trial(kept["id"], delta=kept["metric"] - base["metric"])
        near = trial("near", "proposal", "discard", [2.5380, 2.5460], seeds=(1, 2), description="warmup 0.1",
                     parent_commit="b" * 40, trial_commit="c" * 40, best_before=kept["metric"],
                     decision=_decision("discard", -0.0011, 0.0040, 2, near_miss=True, why="max runs reached"),
                     flags=[{"flag": "slow_start", "message": "spent 40% of its budget before the first step"}],
                     reason="not distinguishable from the incumbent after 2 runs (near miss)")
        # The incumbent re-measured at seed 2 for trial 3's comparison: a row of trial 2.
        store.add_measurement(kept["id"], 2.5429, seed=2, role="incumbent", for_trial_id=near["id"], status="ok",
                              num_steps=100, training_seconds=1.5, wall_seconds=2.0)
        worse = trial("worse", "proposal", "discard", [2.7000], seeds=(1,), description="depth 12",
                      parent_commit="b" * 40, trial_commit="d" * 40, best_before=kept["metric"],
                      decision=_decision("discard", 0.1569, 0.0040, 1, why="clearly worse after one run"),
                      reason="clearly worse: +0.1569")
        drift = trial("drift", "drift", "discard", [2.5581], role="drift", seeds=(1,), description="drift check",
                      parent_commit="b" * 40, trial_commit="b" * 40, best_before=kept["metric"],
                      reason="the incumbent shifted by +0.0150")
        store.add_event(rid, "drift", DRIFT_MESSAGE, trial_id=drift["id"])
        store.add_event(rid, "noise", NOISE_MESSAGE)
        null = trial("null", "proposal", "discard", [2.5421, 2.5451, 2.5481], description="init seed only",
                     parent_commit="b" * 40, trial_commit="e" * 40, best_before=kept["metric"],
                     # As autoloop.decide.rule's Verdict.figures name them (t, interval, keep_bound, stopped).
                     decision={"action": "discard", "rule": "paired", "n": 3, "seeds": [1, 2, 3], "mean_diff": 0.0020,
                               "se": 0.0018, "t": 1.111, "keep_bound": -3.2, "df": 8, "level": 0.95,
                               "interval": [0.0020 - 0.00415, 0.0020 + 0.00415], "stopped": "futility",
                               "near_miss": False, "reason": "discard: not better than the incumbent"},
                     reason="not distinguishable from the incumbent")
        ablation = trial("ablation", "ablation", "discard", [2.5980, 2.6000, 2.6020], role="ablation",
                         description="ablation: trial 2 reverted (lr 0.02)", derived_from=kept["id"],
                         parent_commit="b" * 40, trial_commit="f" * 40, best_before=kept["metric"],
                         decision={"effect": -0.0569, "low": -0.0612, "high": -0.0526, "n": 3, "null": False,
                                   "drop": False, "level": 0.95, "kept_trial": 2, "seeds": [1, 2, 3]},
                         reason="effect of trial 2: -0.0569 (95% CI -0.0612..-0.0526): helps")
        del null, worse, ablation
        return {name: store.trial_by_id(t["id"]) for name, t in made.items()}
    finally:
        store.close()


def build_old_db(repo: Path) -> None:
    """An experiments.db as autoloop wrote it before noise-aware decisions: single runs,
    no measurements (but one re-run's), no decisions, no noise estimate."""
    from autoloop.store import Store

    repo.mkdir(parents=True, exist_ok=True)
    store = Store(repo / "experiments.db")
    try:
        run = store.create_run("old", branch="autoloop/old", base_commit="a" * 40, best_commit="b" * 40,
                               config={"seed": 1, "time_budget": 1}, status="finished")
        rid = run["id"]
        for kind, status, metric, best_before, desc, reason in [
            ("baseline", "keep", 1.0906, None, "baseline", "first result: val_bpb 1.090600"),
            ("proposal", "keep", 1.031, 1.0906, "lr 0.015", "improved"),
            ("proposal", "crash", None, 1.031, "crash it", "RuntimeError: pretend"),
            ("proposal", "discard", 1.1, 1.031, "wider", "1.100000 is not better than the best 1.031000 (+0.069000)"),
            ("rerun", "discard", 1.0312, 1.031, "re-run of the incumbent", "re-run of the incumbent"),
        ]:
            t = store.new_trial(rid, kind, description=desc, best_before=best_before)
            fields = dict(status=status, reason=reason, metric=metric, wall_seconds=30.0,
                          metric_source="harness" if metric is not None else None)
            if metric is not None and best_before is not None:
                fields["delta"] = metric - best_before
            store.update_trial(t["id"], **fields)
            if kind == "rerun":
                store.add_measurement(t["id"], metric, seed=1)
    finally:
        store.close()


def noisy_report(repo: Path, copy: Path, out: Path, change=None) -> Path:
    """The report of the noisy run in `repo`, rendered from a copy of it (`copy`) after
    `change(conn)` edited the copy's db; returns the report.html written under `out`."""
    from typer.testing import CliRunner

    from autoloop.cli import app

    copy_run(repo, copy)
    if change is not None:
        conn = sqlite3.connect(copy / "experiments.db")
        try:
            change(conn)
            conn.commit()
        finally:
            conn.close()
    result = CliRunner().invoke(app, ["report", "--repo", str(copy), "--tag", NOISY_TAG, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out / "report.html"
