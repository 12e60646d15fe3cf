"""Memory across runs (issue 33): the proposers, `autoloop ideas` and the report know the
project's earlier runs. A real git repo and real SQLite dbs with two tags in tmp_path;
nothing trains (the earlier run's trials are recorded as the controller records them)."""

from __future__ import annotations

import re
import subprocess

import pytest
from typer.testing import CliRunner

from autoloop.cli import app
from autoloop.config import resolve
from autoloop.errors import AutoloopError
from autoloop.gitops import GitRepo
from autoloop.proposers import ProposalContext
from autoloop.proposers.brief import render_context
from autoloop.proposers.memory import (
    MEMORY_CHARS, discarded_elsewhere, earlier_trials, lessons, memory_db_path, memory_section, refused_repeat,
)
from autoloop.proposers.search import SearchProposer
from autoloop.pyconst import set_constants
from autoloop.store import Store
from conftest import FAKE_TRAIN, make_repo

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com"}


def git(repo, *args) -> str:
    import os

    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout.strip()


def commit_beside(repo, parent: str, text: str, ref: str) -> str:
    """A commit of train.py = `text` on `parent`, kept under `ref` (as a discarded trial's is)."""
    blob = subprocess.run(["git", "hash-object", "-w", "--stdin"], cwd=repo, input=text, capture_output=True,
                          text=True, check=True).stdout.strip()
    listing = git(repo, "ls-tree", parent)
    lines = [line if not line.endswith("\ttrain.py") else f"100644 blob {blob}\ttrain.py" for line in listing.splitlines()]
    tree = subprocess.run(["git", "mktree"], cwd=repo, input="\n".join(lines) + "\n", capture_output=True, text=True,
                          check=True).stdout.strip()
    sha = git(repo, "commit-tree", tree, "-p", parent, "-m", "trial")
    git(repo, "update-ref", ref, sha)
    return sha


def record_trial(store, run, repo, number_parent: str, sets: dict, status: str, diff: float, description: str) -> dict:
    """A proposal of constants on `number_parent`, recorded with its commit, diff and decision."""
    source = repo.show_file(number_parent, "train.py")
    sha = commit_beside(repo.project_dir, number_parent, set_constants(source, sets),
                        f"refs/autoloop/{run['tag']}/trials/x{len(store.trials(run['id']))}")
    t = store.new_trial(run["id"], "proposal", description=description, parent_commit=number_parent,
                        trial_commit=sha, diff=repo.diff(number_parent, sha), proposer="search",
                        edits={"edits": [{"path": "train.py", "sets": sets}]}, best_before=2.0)
    store.update_trial(t["id"], status=status, metric=2.0 + diff, metric_sd=0.002, n_runs=3, delta=diff,
                       decision={"mean_diff": diff, "se": 0.002, "low": diff - 0.005, "high": diff + 0.005, "n": 3,
                                 "distinguishable": True, "near_miss": False})
    return store.trial_by_id(t["id"])


def context(repo_dir, store, tag, **flags) -> ProposalContext:
    repo = GitRepo.open(repo_dir)
    return ProposalContext(config=resolve(repo_dir, {"tag": tag, **flags}), store=store, run=store.get_run(tag),
                           repo=repo, parent_commit=repo.head(), read_parent_file=repo.file_reader(repo.head()))


@pytest.fixture
def two_tags(tmp_path):
    """experiments.db with run 'nov28' (the baseline, then on the base commit: LR = 0.04
    discarded at +0.0300, WIDTH = 128 kept at -0.0250) and a new run 'nov29' from the same
    base commit, its baseline only."""
    repo_dir = make_repo(tmp_path / "repo", FAKE_TRAIN.read_text())
    repo = GitRepo.open(repo_dir)
    base = repo.head()
    store = Store(repo_dir / "experiments.db")
    old = store.create_run("nov28", branch="autoloop/nov28", base_commit=base, best_commit=base)
    b = store.new_trial(old["id"], "baseline", description="baseline", trial_commit=base)
    store.update_trial(b["id"], status="keep", tier="baseline", metric=2.0)
    discarded = record_trial(store, old, repo, base, {"LR": 0.04}, "discard", 0.03, "double the learning rate")
    kept = record_trial(store, old, repo, base, {"WIDTH": 128}, "keep", -0.025, "a wider model")
    store.update_trial(kept["id"], tier="confirmed")
    new = store.create_run("nov29", branch="autoloop/nov29", base_commit=base, best_commit=base)
    b = store.new_trial(new["id"], "baseline", description="baseline", trial_commit=base)
    store.update_trial(b["id"], status="keep", tier="baseline", metric=2.0)
    yield repo_dir, store, discarded
    store.close()


def test_the_brief_reports_what_an_earlier_tag_kept_and_discarded_with_effect_sizes(two_tags):
    repo_dir, store, _ = two_tags
    text = render_context(context(repo_dir, store, "nov29"))
    section = text.split("# What earlier runs of this project established\n", 1)[1].split("\n\n# ", 1)[0]
    assert "- run 'nov28': 3 trials, 1 kept; baseline 2.0000 -> best 1.9750" in section
    assert "- nov28#3 \"a wider model\": -0.0250 ± 0.0020" in section
    assert "- LR: 1 discarded: nov28#2 = 0.04 (+0.0300 ± 0.0020)" in section
    # The current run is not its own memory.
    assert "nov29" not in section


def test_an_edit_discarded_on_the_same_parent_in_another_tag_is_not_proposed_again(two_tags):
    repo_dir, store, discarded = two_tags
    ctx = context(repo_dir, store, "nov29")
    # The llm and agent proposers' check: the same diff on the same parent is refused ...
    assert refused_repeat(ctx, discarded["diff"])["number"] == 2
    # ... not on another parent (another tree), and never for a seeded idea.
    assert discarded_elsewhere(discarded["diff"], "0" * 40, earlier_trials(store, ctx.run["id"]), ctx.repo) is None
    ctx.extra["taken_idea"] = 1
    assert refused_repeat(ctx, discarded["diff"]) is None
    # The search: its first move on this base is the one nov28 discarded (LR up) without the
    # memory; with it, that train.py counts as evaluated and the search moves on.
    first = SearchProposer(ctx.config).propose(context(repo_dir, store, "nov29"))
    assert first.edits[0].sets != {"LR": 0.04} and "LR" in first.edits[0].sets
    blank = Store(repo_dir / "blank.db")
    try:
        blank.create_run("nov29", branch="autoloop/nov29", base_commit=ctx.parent_commit,
                         best_commit=ctx.parent_commit)
        forgetful = SearchProposer(ctx.config).propose(context(repo_dir, blank, "nov29"))
    finally:
        blank.close()
    assert forgetful.edits[0].sets == {"LR": 0.04}


def test_another_db_named_by_memory_db_is_remembered_and_a_bad_one_refused(two_tags, tmp_path):
    repo_dir, store, discarded = two_tags
    other = Store(tmp_path / "other.db")  # a fresh db for this project; the earlier night is in experiments.db
    other.create_run("dec1", branch="autoloop/dec1", base_commit=discarded["parent_commit"],
                     best_commit=discarded["parent_commit"])
    other.close()
    ctx = context(repo_dir, Store(tmp_path / "other.db"), "dec1",
                  memory_db=str(repo_dir / "experiments.db"))
    try:
        earlier = earlier_trials(ctx.store, ctx.run["id"], memory_db_path(ctx.config, repo_dir))
        assert [(t["source"], t["tag"], t["number"]) for t in earlier] == [
            ("experiments.db", "nov28", 1), ("experiments.db", "nov28", 2), ("experiments.db", "nov28", 3),
            ("experiments.db", "nov29", 1)]
        assert refused_repeat(ctx, discarded["diff"])["tag"] == "nov28"
        assert "- run 'nov28' (experiments.db): 3 trials, 1 kept" in render_context(ctx)
    finally:
        ctx.store.close()
    with pytest.raises(AutoloopError, match=r"memory-db nowhere.db is not a file: point --memory-db at"):
        memory_db_path(resolve(repo_dir, {"memory_db": "nowhere.db"}), repo_dir)
    result = CliRunner().invoke(app, ["run", "--repo", str(repo_dir), "--memory-db", "nowhere.db", "--max-trials", "1"])
    assert result.exit_code != 0 and "memory-db nowhere.db is not a file" in result.output
    assert store.trials(store.get_run("nov29")["id"])  # nothing recorded was lost


def test_ideas_and_the_reports_lessons_say_what_earlier_runs_established(two_tags):
    repo_dir, store, _ = two_tags
    store.add_idea("double the learning rate again", sets={"LR": 0.04})
    shown = CliRunner().invoke(app, ["ideas", "--repo", str(repo_dir)])
    assert shown.exit_code == 0, shown.output
    assert "↳ tried before in run 'nov28' as trial 2: discard (+0.0300 ± 0.0020)" in shown.output
    found = lessons(earlier_trials(store, store.get_run("nov29")["id"]))
    assert found == ["Run 'nov28': 3 trials, 1 kept, val_bpb 2.0000 -> 1.9750.",
                     "Kept in nov28#3: a wider model (-0.0250 ± 0.0020)."]
    from autoloop.review.report import report_data

    assert report_data(store, store.get_run("nov29"))["lessons"] == found


def test_the_memory_section_stays_within_its_budget():
    """A db of 100 earlier trials across 12 tags, every one a different theme: the section
    is cut at whole lines within MEMORY_CHARS and says so."""
    earlier = []
    for k in range(100):
        earlier.append({"source": "this db", "run_key": k // 9, "tag": f"run{k // 9}", "number": k, "kind": "proposal",
                        "status": "discard" if k % 5 else "keep", "description": f"change {k} " + "x" * 80,
                        "diff": f"--- a/train.py\n+++ b/train.py\n@@ -1 +1 @@\n-CONST_{k} = 1\n+CONST_{k} = 2\n",
                        "metric": 2.0, "delta": 0.01, "best_before": 1.99, "decision": None, "metric_sd": None,
                        "n_runs": 1})
    text = memory_section(earlier)
    assert len(text) <= MEMORY_CHARS
    assert text.endswith("- ... (cut to the brief's budget)") or re.search(r"more themes$", text)


@pytest.mark.slow  # two short nights of the real loop (the fake script): 8-12 s
def test_an_llm_answer_discarded_in_an_earlier_tag_is_sent_back_and_never_trained(tmp_path, monkeypatch,
                                                                                   one_run_per_trial):
    """Two nights of the real loop on the fake script with a fake OpenAI-compatible server:
    night 'a' trains WIDTH = 128 and discards it; night 't' (from the same best commit) gets
    the same answer, refuses it with the earlier run named, and the model's next answer runs."""
    from autoloop.loop.controller import Controller
    from fakes.fake_openai import FakeOpenAI, edit_answer

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-memory")
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    repo_dir = make_repo(tmp_path / "repo", FAKE_TRAIN.read_text())
    width = "WIDTH = 64  # model width; power of two"
    wider = edit_answer(width, "WIDTH = 128", "wider")

    def night(tag: str, answers: list[str], trials: int) -> FakeOpenAI:
        with FakeOpenAI(answers) as server:
            flags = {"tag": tag, "time_budget": 5, "grace_seconds": 20, "verify": False, "proposers": "llm",
                     "llm_model": "fake-model", "llm_base_url": server.base_url, "llm_retries": 0,
                     "llm_max_repairs": 1, "max_trials": trials, "check": False}
            Controller(resolve(repo_dir, flags), repo_dir, verifier=None).run()
        return server

    night("a", [wider], 2)
    server = night("t", [wider, edit_answer(width, "WIDTH = 32", "narrower")], 2)
    with Store(repo_dir / "experiments.db") as store:
        earlier = store.trials(store.get_run("a")["id"])
        now = store.trials(store.get_run("t")["id"])
    assert earlier[1]["status"] == "discard" and earlier[1]["description"] == "wider"
    assert [t["description"] for t in now[1:]] == ["narrower"]  # the repeat never became a trial
    sent_back = server.requests[1]["messages"][-1]["content"]
    assert "already discarded on the same parent in run 'a' (this db) as trial 2" in sent_back
