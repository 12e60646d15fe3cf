"""The scale ladder (issue 34): the spec and the tag rule on known inputs, and a whole run
of the real controller on a fake training script whose two kept changes have KNOWN
effects at two scales: one holds, one reverses; finalize --holds-at-scale keeps the first."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autoloop.cli import app
from autoloop.decide.ladder import (
    FADES, HOLDS, REVERSES, level_of, parse_spec, runs_needed, seconds_needed, tag_of,
)
from autoloop.errors import AutoloopError

from conftest import copy_run, make_repo

runner = CliRunner()


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


# ---------------------------------------------------------------------------- the spec, the tags, the cost


def test_a_spec_names_constants_and_a_budget_factor():
    spec = parse_spec("DEPTH=8  MODEL_DIM=512 budget=4x")
    assert spec.overrides == {"DEPTH": "8", "MODEL_DIM": "512"} and spec.budget_factor == 4.0
    assert spec.text == "DEPTH=8 MODEL_DIM=512 budget=4x"
    assert parse_spec("budget=2.5x").overrides == {} and parse_spec("budget=2.5x").budget_factor == 2.5
    assert parse_spec(None) is None and parse_spec("  ") is None
    for bad, words in (("depth=8", "neither NAME=VALUE"), ("DEPTH", "neither NAME=VALUE"),
                       ("DEPTH=8 DEPTH=9", "sets DEPTH twice"), ("budget=1x", "the night's own scale"),
                       ("budget=0x", "must be above 0")):
        with pytest.raises(AutoloopError, match=words):
            parse_spec(bad)


def test_the_tag_reads_the_interval_at_the_decisions_confidence():
    assert level_of(0.05) == pytest.approx(0.90) and level_of(0.2) == pytest.approx(0.60)
    assert tag_of(-0.05, -0.06, -0.04) == HOLDS
    assert tag_of(0.04, 0.03, 0.05) == REVERSES
    assert tag_of(-0.01, -0.03, 0.01) == FADES
    assert tag_of(-0.2, None, None) == FADES  # one pair: an unbounded interval establishes nothing
    assert tag_of(-0.2, -math.inf, math.inf) == FADES


def test_the_cost_is_runs_times_run_times_budget_times_slowdown():
    assert runs_needed(2, 3) == 12  # baseline, best and two leave-one-out commits, three seeds each
    assert seconds_needed(2, 3, run_seconds=10.0, budget_factor=4.0, slowdown=1.5) == pytest.approx(720.0)


# ---------------------------------------------------------------------------- a whole run at two scales

# val_bpb = 2.0 - 0.05 * SCHEDULE - (0.04 if WIDTH == 1 else -0.04) * (LR == 0.02) + noise.
# SCHEDULE (a better schedule) helps at both widths; LR = 0.02 is right for the small width and too
# high for the larger one. The noise is one draw per seed (the init and data stream, common to
# every commit at that seed) plus a small one per commit and seed, so pairs are tight but not exact.
KNOWN = '''"""A fake train.py whose kept changes have known effects at two scales (tests/test_ladder.py)."""
import json
import os
import random

WIDTH = 1  # the scale: 1 for the night, larger on the ladder
SCHEDULE = 0  # a better schedule: helps at every width
LR = 0.01  # 0.02 is right at WIDTH 1 and too high above it


def true_bpb():
    lr_effect = (0.04 if WIDTH == 1 else -0.04) * (LR == 0.02)
    return 2.0 - 0.05 * SCHEDULE - lr_effect


if __name__ == "__main__":
    seed = int(os.environ.get("AUTOLOOP_SEED", "0"))
    steps = int(os.environ.get("AUTOLOOP_MAX_STEPS", "1"))
    own = random.Random(f"{seed}-{WIDTH}-{SCHEDULE}-{LR}").gauss(0.0, 0.002)
    value = true_bpb() + random.Random(seed).gauss(0.0, 0.01) + own
    result = {"val_bpb": value, "training_seconds": 0.0, "total_seconds": 0.0, "compile_seconds": 0.0,
              "eval_seconds": 0.0, "num_steps": steps, "total_tokens": 1, "num_params": WIDTH, "mfu_percent": None,
              "peak_memory_mb": 0.0, "device": "cpu", "seed": seed, "curve": []}
    if os.environ.get("AUTOLOOP_RESULT"):
        with open(os.environ["AUTOLOOP_RESULT"], "w") as handle:
            json.dump(result, handle)
    print("---")
    print(f"val_bpb: {value:.6f}")
    print(f"num_steps: {steps}")
'''
IDEAS = [("a better schedule", {"SCHEDULE": "1"}), ("a higher learning rate", {"LR": "0.02"})]


@pytest.fixture(scope="module")
def known_run_once(tmp_path_factory, session_cache) -> Path:
    """A run of the real controller over KNOWN: the baseline, then both ideas, kept."""
    return known_night(tmp_path_factory.mktemp("ladder") / "repo", KNOWN, session_cache)


def known_night(repo: Path, source: str, cache: Path) -> Path:
    """A serial night of the real controller over `source` (KNOWN or a variant of it) in a
    new repo at `repo`: the baseline, then both IDEAS, kept (tests/test_ladder_workers.py
    and bench/ladder_workers.py start from it too)."""
    with pytest.MonkeyPatch.context() as mp:  # what conftest's autouse fixture does per test
        mp.setenv("AUTOLOOP_CACHE_DIR", str(cache))
        for name in ("AUTOLOOP_TIME_BUDGET", "AUTOLOOP_MAX_STEPS", "AUTOLOOP_TAG", "AUTOLOOP_FAULT", "AUTOLOOP_SEED"):
            mp.delenv(name, raising=False)
        return _known_run(repo, source)


def _known_run(repo: Path, source: str) -> Path:
    from autoloop.config import resolve
    from autoloop.loop.controller import Controller
    from autoloop.store import Store

    repo = make_repo(repo, source)
    config = resolve(repo, {"tag": "k", "proposers": "ideas", "max_steps": 2, "grace_seconds": 30, "seed": 1,
                            "max_trials": 3, "decision_rule": "paired", "reserve_seeds": 0})
    with Store(repo / config.db) as store:
        for text, sets in IDEAS:
            store.add_idea(text, sets=sets, source="human")
    Controller(config, repo, verifier=None).run()
    rows = trials(repo)
    assert [(t["kind"], t["status"]) for t in rows] == [("baseline", "keep")] + [("proposal", "keep")] * 2, \
        [(t["number"], t["status"], t["reason"]) for t in rows]
    return repo


@pytest.fixture
def known_run(known_run_once, tmp_path) -> Path:
    return copy_run(known_run_once, tmp_path / "repo")


def trials(repo: Path) -> list[dict]:
    from autoloop.store import Store

    with Store(repo / "experiments.db") as store:
        return store.trials(store.runs()[-1]["id"])


def ladder_known(repo: Path, spec: str, **options):
    """`autoloop ladder --tag k SPEC` as the command runs it, with the verifier off (the fake
    script has no model for the harness to evaluate)."""
    from autoloop.review.ladder import ladder_run
    from autoloop.store import Store

    with Store(repo / "experiments.db") as store:
        run = store.get_run("k")
    return ladder_run(repo, run, spec, verifier=None, **options)


def cli(repo: Path, *args: str):
    result = runner.invoke(app, [*args, "--repo", str(repo)])
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


def test_the_ladder_tags_the_change_that_holds_and_the_one_that_reverses(known_run):
    from autoloop.store import Store

    repo = known_run
    best_commit = git(repo, "rev-parse", "autoloop/k").strip()
    said: list[str] = []
    rung = ladder_known(repo, "WIDTH=4 budget=2x", seeds=3, say=said.append)
    assert rung.status == "done" and rung.seeds == [2_000_001, 2_000_002, 2_000_003]
    rows = {r.trial: r for r in rung.rows}
    assert list(rows) == [2, 3]
    # The schedule (trial 2): -0.05 at both widths: holds, its interval excludes 0 and holds the truth.
    assert rows[2].tag == "holds" and rows[2].high < 0 and rows[2].low <= -0.05 <= rows[2].high
    assert rows[2].effect == pytest.approx(-0.05, abs=0.006)
    # The learning rate (trial 3): -0.04 at the night's width, +0.04 at width 4: reverses.
    assert rows[3].tag == "reverses" and rows[3].low > 0 and rows[3].low <= 0.04 <= rows[3].high
    assert rows[3].small_effect == pytest.approx(-0.04, abs=0.006)
    # The headline: best minus baseline at width 4 is -0.05 + 0.04 = -0.01.
    assert rung.headline["delta"] == pytest.approx(-0.01, abs=0.006) and rung.headline["n"] == 3
    assert rung.plan["runs"] == 12 and rung.plan["budget_factor"] == 2.0
    # The slowdown: the baseline's first run at the rung against the night's median run x the budget factor.
    assert rung.plan["slowdown"] > 0 and rung.plan["seconds"] == pytest.approx(
        12 * rung.plan["run_seconds"] * 2.0 * rung.plan["slowdown"])
    assert said[1].startswith("the ladder at WIDTH=4 budget=2x: 12 runs x ") and "not measured yet" not in said[1]
    assert said[0].startswith("the ladder at WIDTH=4 budget=2x: 12 runs x ")

    with Store(repo / "experiments.db") as store:
        run = store.get_run("k")
        rungs = store.rungs(run["id"])
        assert [(r["spec"], r["status"]) for r in rungs] == [("WIDTH=4 budget=2x", "done")]
        tags = {t["kept_trial_id"]: t["tag"] for t in store.ladder_tags(rungs[0]["id"])}
        by_number = {t["number"]: t for t in store.trials(run["id"])}
        assert tags == {by_number[2]["id"]: "holds", by_number[3]["id"]: "reverses"}
        ladder_trials = [t for t in by_number.values() if t["kind"] == "ladder"]
        assert len(ladder_trials) == 4 and {t["status"] for t in ladder_trials} == {"discard"}
        for t in ladder_trials:
            measured = store.measurements(t["id"])
            assert sorted(m["seed"] for m in measured) == rung.seeds and {m["role"] for m in measured} == {"ladder"}
            # The rung's commit: the constant set, the budget doubled (the fake prints the steps it was given).
            assert "WIDTH = 4" in git(repo, "show", f"{t['trial_commit']}:train.py")
            assert {m["num_steps"] for m in measured} == {4}
        # Never in the run's noise: the ladder's runs are of another scale.
        assert run["noise_pair_sd"] == store.get_run("k")["noise_pair_sd"]
    # The run's branch and worktree are back on the best commit, at the night's scale.
    assert git(repo, "rev-parse", "HEAD").strip() == best_commit and git(repo, "status", "--porcelain") == ""
    assert "WIDTH = 1" in (repo / "train.py").read_text()

    # finalize --holds-at-scale: a branch with only the change that held (the schedule).
    result = json.loads(cli(repo, "finalize", "--tag", "k", "--holds-at-scale", "--json"))
    assert result["trials"] == [2] and result["dropped"] == [3]
    final = git(repo, "show", "final/k:train.py")
    assert "SCHEDULE = 1" in final and "LR = 0.01" in final and "WIDTH = 1" in final
    message = git(repo, "log", "-1", "--format=%B", "final/k")
    assert "did not hold at a larger scale" in message and "at WIDTH=4 budget=2x: reverses" in message

    # The report: a table per rung and its chart (small-scale effect against the large one).
    page = Path(cli(repo, "report", "--tag", "k", "--no-remeasure", "--out", str(repo / "r")).split()[1]).read_text()
    table = page.split('<table class="ladder" id="ladder">')[1].split("</table>")[0]
    assert '<tr data-trial="2" class="holds">' in table and '<tr data-trial="3" class="reverses">' in table
    chart = page.split('<div class="ladder-chart">')[1].split("</svg>")[0]
    assert 'class="holds" data-trial="2"' in chart and 'class="reverses" data-trial="3"' in chart
    # The ladder's trials are of another scale: not points of the progress chart, not discarded ideas.
    from autoloop.review.queries import discarded_trials, progress_points

    with Store(repo / "experiments.db") as store:
        assert [p["number"] for p in progress_points(store, store.get_run("k"))] == [1, 2, 3]
        assert discarded_trials(store, store.get_run("k"), 10) == ([], 0)
        from autoloop.review.queries import headline

        counts = headline(store, store.get_run("k"))
        assert (counts["discarded"], counts["ladder"], counts["kept"]) == (0, 4, 2)
    # The live page's summary: a card per rung.
    from autoloop.serve.queries import summary
    from autoloop.serve.readonly import ReadOnlyStore

    reader = ReadOnlyStore(repo / "experiments.db")
    try:
        card = summary(reader, reader.get_run("k"))["ladder"]
    finally:
        reader.close()
    assert [c["spec"] for c in card] == ["WIDTH=4 budget=2x"] and card[0]["tags"] == "trial 2 holds · trial 3 reverses"
    assert "best minus baseline (3 paired runs)" in card[0]["headline"]

    # A second call trains nothing: the rung is done for this best commit, its figures stand.
    again = ladder_known(repo, "WIDTH=4 budget=2x", seeds=3)
    assert {r.trial: r.tag for r in again.rows} == {2: "holds", 3: "reverses"} and again.rung_id == rung.rung_id
    with Store(repo / "experiments.db") as store:
        assert len(store.trials(store.get_run("k")["id"], kind="ladder")) == 4 and len(store.rungs(run["id"])) == 1


# ---------------------------------------------------------------------------- `autoloop run --ladder`, killed and resumed


def autoloop(repo: Path, *args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "AUTOLOOP_DECISION_RULE": "strict", "AUTOLOOP_BASELINE_SEEDS": "1",
           "AUTOLOOP_DRIFT_EVERY": "0"}
    env.pop("AUTOLOOP_FAULT", None)
    if fault:
        env["AUTOLOOP_FAULT"] = fault
    return subprocess.run(["autoloop", *args], cwd=repo, env=env, capture_output=True, text=True, timeout=300)


NIGHT = ("run", "--tag", "t", "--max-steps", "2", "--grace-seconds", "30", "--no-verify", "--no-sandbox", "--no-check",
         "--proposers", "ideas", "--reserve-seeds", "0", "--ladder", "WIDTH=4", "--ladder-seeds", "3")


@pytest.mark.slow  # about 40 s: three `autoloop` processes, 3 trials and 12 ladder runs
def test_run_with_a_ladder_killed_mid_rung_resumes_it_and_shows_the_tags_everywhere(tmp_path):
    from autoloop.store import Store

    repo = make_repo(tmp_path / "repo", KNOWN)
    with Store(repo / "experiments.db") as store:
        for text, sets in IDEAS:
            store.add_idea(text, sets=sets, source="human")
    # The controller dies (SIGKILL) at the fifth point where a run is recorded and another
    # follows: inside the ladder, the night's own few such points come first.
    killed = autoloop(repo, *NIGHT, "--max-trials", "3", fault="between_measurements:5")
    assert killed.returncode == -9, killed.stdout + killed.stderr
    assert "the ladder at WIDTH=4: 12 runs x" in killed.stdout
    with Store(repo / "experiments.db") as store:
        run = store.get_run("t")
        assert [r["status"] for r in store.rungs(run["id"])] == ["running"]
        ladder_trials = store.trials(run["id"], kind="ladder")
        assert 0 < sum(len(store.measurements(t["id"])) for t in ladder_trials) < 12

    # The next `autoloop run` recovers, finds the unfinished rung and goes on where it stopped.
    done = autoloop(repo, *NIGHT, "--max-trials", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resuming its unfinished rung" in done.stdout
    with Store(repo / "experiments.db") as store:
        run = store.get_run("t")
        assert [r["status"] for r in store.rungs(run["id"])] == ["done"]
        ladder_trials = store.trials(run["id"], kind="ladder")
        assert len(ladder_trials) == 4 and {t["status"] for t in ladder_trials} == {"discard"}
        ok = [(m["trial_id"], m["seed"]) for t in ladder_trials for m in store.measurements(t["id"])
              if m["status"] == "ok"]
        assert len(ok) == 12 == len(set(ok))  # every commit at every seed once: none measured twice

    log = autoloop(repo, "log", "--tag", "t").stdout
    holds = next(line for line in log.splitlines() if "⤒ at WIDTH=4: holds" in line)
    reverses = next(line for line in log.splitlines() if "⤒ at WIDTH=4: reverses" in line)
    assert float(holds.split("effect ")[1].split()[0]) == pytest.approx(-0.05, abs=0.006)
    assert float(reverses.split("effect ")[1].split()[0]) == pytest.approx(0.04, abs=0.006)
    shown = autoloop(repo, "show", "3", "--tag", "t", "--no-diff").stdout
    assert "scale ladder" in shown and "at WIDTH=4: reverses" in shown and "at the night's scale" in shown
    best = autoloop(repo, "best", "--tag", "t", "--no-remeasure").stdout
    assert "at WIDTH=4: " in best and "best minus baseline (3 paired runs" in best
    assert "holds     trial 2" in best and "reverses  trial 3" in best


@pytest.mark.slow  # about 20 s: a whole night of the fake script in-process
def test_a_stop_during_the_nights_re_measurement_starts_no_ladder(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM while the reserve re-measures the best at the night's end: the run
    stops there, and the ladder (hours of larger runs) does not start after it."""
    import signal

    from autoloop.loop import reserve
    from autoloop.store import Store

    repo = make_repo(tmp_path / "repo", KNOWN)
    with Store(repo / "experiments.db") as store:
        for text, sets in IDEAS:
            store.add_idea(text, sets=sets, source="human")
    measure = reserve.measure

    def stopped_meanwhile(c, **kwargs):
        c.on_signal(signal.SIGTERM, None)  # what the signal does, as it arrives
        return measure(c, **kwargs)

    monkeypatch.setattr(reserve, "measure", stopped_meanwhile)
    for name, value in (("AUTOLOOP_DECISION_RULE", "strict"), ("AUTOLOOP_BASELINE_SEEDS", "1"),
                        ("AUTOLOOP_DRIFT_EVERY", "0")):
        monkeypatch.setenv(name, value)
    args = [a if a != "0" else "2" for a in NIGHT]  # --reserve-seeds 2
    result = runner.invoke(app, [*args, "--max-trials", "3", "--repo", str(repo)])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "stopping:" in result.output and "the ladder at" not in result.output, result.output
    with Store(repo / "experiments.db") as store:
        run = store.get_run("t")
        assert store.rungs(run["id"]) == [] and store.trials(run["id"], kind="ladder") == []
        assert run["status"] == "stopped"


def test_a_bad_spec_is_one_line_and_records_nothing(known_run):
    from autoloop.store import Store

    repo = known_run
    for spec, message in (
        ("MODEL_DIM=512", "error: --ladder: MODEL_DIM: train.py has no UPPER_CASE constant MODEL_DIM: its constants are "
                          "LR, SCHEDULE, WIDTH; `autoloop search-plan` lists them with their values"),
        ("width=4", "error: --ladder 'width=4': 'width=4' is neither NAME=VALUE (an UPPER_CASE constant of train.py) "
                    "nor budget=Kx: write it like --ladder \"DEPTH=8 MODEL_DIM=512 budget=4x\""),
    ):
        for args in (["ladder", spec, "--tag", "k"], ["run", "--tag", "k", "--ladder", spec]):
            result = runner.invoke(app, [*args, "--repo", str(repo)])
            assert result.exit_code == 1 and result.output.strip() == message, result.output
    with Store(repo / "experiments.db") as store:
        run = store.get_run("k")
        assert store.rungs(run["id"]) == [] and store.trials(run["id"], kind="ladder") == []
        assert len(store.trials(run["id"])) == 3  # the night did not go on either
    result = runner.invoke(app, ["finalize", "--tag", "k", "--holds-at-scale", "--repo", str(repo)])
    assert result.exit_code == 1 and result.output.strip() == (
        "error: run 'k' has no finished ladder rung, so nothing is known to hold at scale: run `autoloop ladder SPEC "
        "--tag k` first, or finalize without --holds-at-scale")


def test_the_proposers_brief_leaves_out_the_ladders_runs_of_another_scale(known_run):
    """A ladder trial's val_bpb is of the larger scale (here twice the steps): in the brief's
    table a model would read it as the night's, and its diff (the rung's constants) is no
    idea the night tried, so a proposal setting them is no duplicate."""
    from autoloop.config import resolve
    from autoloop.gitops import GitRepo
    from autoloop.proposers.base import ProposalContext
    from autoloop.proposers.brief import find_duplicate, render_context
    from autoloop.store import Store

    repo = known_run
    ladder_known(repo, "WIDTH=4 budget=2x", seeds=2)
    git_repo = GitRepo.open(repo)
    with Store(repo / "experiments.db") as store:
        run = store.get_run("k")
        every = store.trials(run["id"])
        ladders = [t for t in every if t["kind"] == "ladder"]
        assert len(ladders) == 4 and all(t.get("diff") for t in ladders)
        ctx = ProposalContext(config=resolve(repo, {"tag": "k"}), store=store, run=run, repo=git_repo,
                              parent_commit=git_repo.head(), read_parent_file=git_repo.file_reader(git_repo.head()))
        assert [t["number"] for t in ctx.history()] == [t["number"] for t in every if t["kind"] != "ladder"]
        text = render_context(ctx)
        assert "| ladder |" not in text and "WIDTH=4" not in text, text
        assert find_duplicate(ladders[0]["diff"], ctx.history()) is None


def ten_second_runs(repo: Path):
    """Run 'k' as if every run of its night took 10 s, and its config with the ladder
    WIDTH=4 budget=2x at 3 seeds: what --hours plans from."""
    import dataclasses
    import sqlite3

    from autoloop.config import resolve

    conn = sqlite3.connect(repo / "experiments.db")
    conn.execute("UPDATE measurements SET wall_seconds = 10")
    conn.commit()
    conn.close()
    return dataclasses.replace(resolve(repo, {"tag": "k"}), ladder="WIDTH=4 budget=2x", ladder_seeds=3)


def test_the_ladder_is_planned_into_hours(known_run):
    """runs x the night's median run x the budget factor x the slowdown an earlier rung measured."""
    import dataclasses
    from types import SimpleNamespace

    from autoloop.loop.reserve import ladder_seconds_needed
    from autoloop.store import Store

    repo = known_run
    config = ten_second_runs(repo)
    with Store(repo / "experiments.db") as store:
        host = SimpleNamespace(config=config, store=store, run_row=store.get_run("k"))
        assert ladder_seconds_needed(host) == pytest.approx(12 * 10 * 2.0)  # 2 kept: 3 seeds x 4 commits
        store.add_rung(host.run_row["id"], "WIDTH=4 budget=2x", plan={"slowdown": 1.5}, status="interrupted")
        assert ladder_seconds_needed(host) == pytest.approx(12 * 10 * 2.0 * 1.5)
        host.config = dataclasses.replace(config, ladder=None)
        assert ladder_seconds_needed(host) == 0.0


def test_ladder_every_k_measures_a_rung_after_every_kth_keep_during_the_night(tmp_path):
    from autoloop.cli import ladder_hook
    from autoloop.config import resolve
    from autoloop.loop.controller import Controller
    from autoloop.store import Store

    repo = make_repo(tmp_path / "repo", KNOWN)
    config = resolve(repo, {"tag": "e", "proposers": "ideas", "max_steps": 1, "grace_seconds": 30, "seed": 1,
                            "max_trials": 3, "decision_rule": "paired", "reserve_seeds": 0, "ladder": "WIDTH=4",
                            "ladder_every": 1, "ladder_seeds": 2})
    with Store(repo / config.db) as store:
        for text, sets in IDEAS:
            store.add_idea(text, sets=sets, source="human")
    controller = Controller(config, repo, verifier=None)
    controller.ladder_hook = ladder_hook(config, None)
    controller.run()
    with Store(repo / config.db) as store:
        run = store.get_run("e")
        by_number = {t["number"]: t for t in store.trials(run["id"])}
        rungs = store.rungs(run["id"])
        # One rung after each keep, each for the best commit of its moment.
        assert [(r["spec"], r["status"]) for r in rungs] == [("WIDTH=4", "done")] * 2
        first = [t for t in by_number.values() if t["kind"] == "proposal"]
        assert [r["best_commit"] for r in rungs] == [t["trial_commit"] for t in first]
        number_of = {t["id"]: n for n, t in by_number.items()}
        tags = [{number_of[t["kept_trial_id"]]: t["tag"] for t in store.ladder_tags(r["id"])} for r in rungs]
    schedule, rate = (t["number"] for t in first)
    assert tags == [{schedule: "holds"}, {schedule: "holds", rate: "reverses"}]
    # The night's own trials went on as without it: the baseline and the two ideas, kept.
    assert [(t["kind"], t["status"]) for t in by_number.values() if t["kind"] != "ladder"] == \
        [("baseline", "keep"), ("proposal", "keep"), ("proposal", "keep")]
