"""The telemetry in the proposers' brief and in `show` (issue 33): a trial's run beside its
incumbent's at the same seed, on recorded curves with known answers (a real SQLite db and
a real git repo; nothing trains)."""

from __future__ import annotations

from typer.testing import CliRunner

from autoloop.cli import app
from autoloop.config import resolve
from autoloop.gitops import GitRepo
from autoloop.proposers import ProposalContext
from autoloop.proposers.brief import render_context
from autoloop.proposers.telemetry import QUARTERS, budget_of, telemetry_line, trial_telemetry
from autoloop.store import Store
from tests.conftest import REPO_ROOT, bench_module

# The candidate's loss minus the incumbent's, by quarter of the run: the known answer.
OFFSETS = {0.25: 0.04, 0.5: 0.01, 0.75: -0.01, 1.0: -0.03}
BUDGET = 100.0  # seconds (time mode: the candidate runs fewer steps in the same time)


def _offset(q: float) -> float:
    return next(OFFSETS[p] for p in QUARTERS if q <= p + 1e-9)


def recorded_night(repo_dir):
    """A run in time mode: the baseline (50 steps in 100 s, loss 3.0 flat) and trial 2 (40
    steps in the same 100 s, loss 3.0 + a known offset per quarter), both at seed 1."""
    store = Store(repo_dir / "experiments.db")
    repo = GitRepo.open(repo_dir)
    run = store.create_run("t", branch="autoloop/t", base_commit=repo.head(), best_commit=repo.head(),
                           config={"time_budget": BUDGET, "max_steps": None})
    base = store.new_trial(run["id"], "baseline", description="baseline", seed=1, trial_commit=repo.head())
    store.add_measurement(base["id"], 3.0, seed=1, role="baseline", status="ok", num_steps=50,
                          tokens_per_second=1000.0,
                          curve=[{"step": k, "seconds": 2.0 * (k + 1), "loss": 3.0} for k in range(50)])
    store.update_trial(base["id"], status="keep", tier="baseline", metric=3.0, num_steps=50, peak_memory_mb=1000.0,
                       training_seconds=100.0, wall_seconds=120.5, compile_seconds=5.0, eval_seconds=4.0,
                       result={"eval_seconds": 0.5})
    cand = store.new_trial(run["id"], "proposal", description="wider MLP", seed=1, parent_commit=repo.head())
    curve = [{"step": k, "seconds": 2.5 * (k + 1), "loss": 3.0 + _offset(2.5 * (k + 1) / BUDGET)} for k in range(40)]
    store.add_measurement(cand["id"], 2.98, seed=1, role="candidate", status="ok", num_steps=40,
                          tokens_per_second=800.0, curve=curve)
    store.update_trial(cand["id"], status="discard", metric=2.98, best_before=3.0, delta=-0.02, num_steps=40,
                       mfu_percent=12.5, peak_memory_mb=1200.0, training_seconds=100.0, wall_seconds=129.5,
                       compile_seconds=10.0, eval_seconds=8.0, result={"eval_seconds": 0.5},
                       decision={"incumbent_id": base["id"], "mean_diff": -0.02})
    return store, repo, run


def test_a_trials_telemetry_reads_its_curve_against_the_incumbents_at_the_same_seed(tmp_path):
    from conftest import FAKE_TRAIN, make_repo

    repo_dir = make_repo(tmp_path / "repo", FAKE_TRAIN.read_text())
    store, _, run = recorded_night(repo_dir)
    try:
        trial = store.get_trial(run["id"], 2)
        t = trial_telemetry(store, trial, budget_of({"time_budget": BUDGET}))
    finally:
        store.close()
    assert t.incumbent == 1 and t.seed == 1
    assert {p: round(d, 6) for p, d in t.quarters.items()} == OFFSETS
    assert (t.steps, t.incumbent_steps) == (40, 50)
    assert (t.tokens_per_second, t.incumbent_tokens_per_second) == (800.0, 1000.0)
    # start-up = wall - training - untimed warm-up - the script's own evaluation: 129.5 - 100 - 10 - 0.5
    assert t.time == {"start-up": 19.0, "compile": 10.0, "training": 100.0, "evaluation": 8.0}
    assert telemetry_line(t) == (
        "#2 (seed 1): loss vs #1 at 25/50/75/100%: +0.0400/+0.0100/-0.0100/-0.0300; steps 40 vs 50 (-20%); "
        "tok/s 800 vs 1.0k (-20%); MFU 12.5%; peak mem 1,200 MB vs 1,000 MB (+20%); "
        "time 137 s: start-up 19, compile 10, training 100, evaluation 8")


def test_the_brief_and_show_carry_the_telemetry_line(tmp_path):
    from conftest import FAKE_TRAIN, make_repo

    repo_dir = make_repo(tmp_path / "repo", FAKE_TRAIN.read_text())
    store, repo, run = recorded_night(repo_dir)
    try:
        ctx = ProposalContext(config=resolve(repo_dir, {"tag": "t", "time_budget": BUDGET}), store=store,
                              run=store.get_run("t"), repo=repo, parent_commit=repo.head(),
                              read_parent_file=repo.file_reader(repo.head()))
        text = render_context(ctx)
    finally:
        store.close()
    section = text.split("# How the recent trials ran (beside the incumbent at the same seed)\n", 1)[1]
    section = section.split("\n\n# ", 1)[0]
    assert "- #2 (seed 1): loss vs #1 at 25/50/75/100%: +0.0400/+0.0100/-0.0100/-0.0300; steps 40 vs 50" in section
    # The baseline has no incumbent: its own figures only.
    assert "- #1: steps 50; tok/s 1.0k; peak mem 1,000 MB; time 124 s: start-up 15, compile 5, training 100, evaluation 4" in section
    shown = CliRunner().invoke(app, ["show", "2", "--repo", str(repo_dir), "--tag", "t", "--no-diff"])
    assert shown.exit_code == 0, shown.output
    assert "telemetry      #2 (seed 1): loss vs #1 at 25/50/75/100%: +0.0400/+0.0100/-0.0100/-0.0300" in shown.output


def test_the_brief_with_telemetry_and_memory_fits_its_budget_after_100_trials(tmp_path):
    """bench/brief_size.py's night of 100 trials with an earlier tag of 100 in the same db:
    the whole prompt (program.md, the brief, train.py, the answer format) stays within
    BRIEF_BUDGET_TOKENS at characters / 4, with one telemetry line for each of the last
    TELEMETRY_TRIALS trials and the memory cut to MEMORY_CHARS."""
    from autoloop.proposers.brief import BRIEF_BUDGET_TOKENS
    from autoloop.proposers.memory import MEMORY_CHARS
    from autoloop.proposers.telemetry import TELEMETRY_TRIALS

    bench = bench_module("brief_size")  # it imports its bench_repo helper by name
    messages = bench.prompt((REPO_ROOT / "train.py").read_text(), (REPO_ROOT / "program.md").read_text(), tmp_path, 100)
    user = messages[1]["content"]
    telemetry = bench.section(user, "# How the recent trials ran")
    memory = bench.section(user, "# What earlier runs of this project established")
    assert [line.split()[1] for line in telemetry.splitlines() if line.startswith("- #")] == \
        [f"#{n}" for n in range(101 - TELEMETRY_TRIALS + 1, 102)]
    assert "- run 'earlier': 101 trials, 25 kept; baseline 1.8000 -> best 1.7960" in memory
    assert len(memory) <= MEMORY_CHARS + len("# What earlier runs of this project established\n")
    total = sum(len(m["content"]) for m in messages)
    assert total // 4 <= BRIEF_BUDGET_TOKENS, f"the prompt after 100 trials is ~{total // 4:,} tokens"


def test_a_run_stopped_early_shows_its_curve_up_to_the_stop(tmp_path):
    """A clear loser stopped at 50%: its run has no recorded curve, its progress lines (the
    curves table) reach 50%, so the quarters after it read '?'."""
    from conftest import FAKE_TRAIN, make_repo

    repo_dir = make_repo(tmp_path / "repo", FAKE_TRAIN.read_text())
    store, _, run = recorded_night(repo_dir)
    try:
        base = store.get_trial(run["id"], 1)
        t = store.new_trial(run["id"], "proposal", description="a clear loser", seed=1, parent_commit=base["trial_commit"])
        store.add_measurement(t["id"], None, seed=1, role="candidate", status="stopped", num_steps=25)
        store.add_curve(t["id"], [{"step": k, "seconds": 2.0 * (k + 1), "loss": 3.5} for k in range(25)])
        store.update_trial(t["id"], status="discard", stopped_at=0.5, decision={"incumbent_id": base["id"]})
        line = telemetry_line(trial_telemetry(store, store.get_trial(run["id"], 3), budget_of({"time_budget": BUDGET})))
    finally:
        store.close()
    assert line.startswith("#3 (seed 1): loss vs #1 at 25/50/75/100%: +0.5000/+0.5000/?/?; steps 25 vs 50 (-50%)")
