"""The morning review on a real tiny CPU run: log, show, diff, best, finalize, report,
export and load_trials, checked against what the db and git say.

The run is made once per session by the real Controller over the fake training script
(see review_support.py for its trials); tests that write (finalize, report) work on a
private copy of it.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autoloop.cli import app
from conftest import copy_run
from review_support import (
    DRIFT_MESSAGE, EXPECTED, GIT_ENV, NOISE, NOISE_MESSAGE, NOISY_TAG, TAG, WRITER, build_noisy_db, build_old_db,
    build_run, db_rows, git, noisy_report,
)

runner = CliRunner()


@pytest.fixture(scope="session")
def night(tmp_path_factory, session_cache, embedded_dataset) -> Path:
    """The fixture run's repository (read-only for tests: copy it to write)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOLOOP_CACHE_DIR", str(session_cache))
        for name in ("AUTOLOOP_TIME_BUDGET", "AUTOLOOP_MAX_STEPS", "AUTOLOOP_TAG", "AUTOLOOP_FAULT"):
            mp.delenv(name, raising=False)
        return build_run(tmp_path_factory.mktemp("night"))


@pytest.fixture
def repo(night, tmp_path) -> Path:
    return copy_run(night, tmp_path / "copy")


def cli(repo: Path, *args: str, ok: bool = True):
    result = runner.invoke(app, [*args, "--repo", str(repo)])
    if ok:
        assert result.exit_code == 0, (result.output, result.exception)
    return result


def trials(repo: Path) -> list[dict]:
    return db_rows(repo, "SELECT * FROM trials ORDER BY number")


# ---------------------------------------------------------------------------- the fixture itself


def test_fixture_run_has_every_outcome(night):
    rows = trials(night)
    assert {t["number"]: (t["kind"], t["status"]) for t in rows} == EXPECTED


# ---------------------------------------------------------------------------- log


def test_log_json_is_the_db(night):
    out = json.loads(cli(night, "log", "--json").output)
    db = trials(night)
    assert [r["number"] for r in out] == [t["number"] for t in db]
    for row, t in zip(out, db):
        for key in ("kind", "status", "reason", "metric", "metric_source", "best_before", "description", "proposer",
                    "trial_commit", "heldout_metric", "lineage", "idea_id", "parent_commit", "started_at", "finished_at"):
            assert row[key] == t[key], key
        # Minutes: every training run the trial cost (its own and the incumbent's runs made for it).
        runs = db_rows(night, "SELECT wall_seconds FROM measurements WHERE COALESCE(for_trial_id, trial_id) = ? "
                              "AND wall_seconds IS NOT NULL", (t["id"],))
        seconds = sum(r["wall_seconds"] for r in runs) if runs else t["wall_seconds"]
        assert row["minutes"] == (round(seconds / 60, 2) if seconds is not None else None)
        if t["metric"] is not None and t["best_before"] is not None:
            assert row["delta"] == pytest.approx(t["metric"] - t["best_before"])
        else:
            assert row["delta"] is None


@pytest.mark.parametrize("args, numbers", [
    (["--status", "keep"], [1, 2, 4]),
    (["--status", "crash,timeout"], [3, 7, 9]),
    (["--kind", "baseline"], [1]),
    (["--last", "3"], [7, 8, 9]),
    (["--status", "discard", "--last", "1"], [8]),
    (["--tag", TAG, "--kind", "proposal", "--status", "invalid"], [6]),
])
def test_log_filters(night, args, numbers):
    out = json.loads(cli(night, "log", "--json", *args).output)
    assert [r["number"] for r in out] == numbers


def test_log_text_lists_every_trial_with_its_reason(night):
    out = cli(night, "log").output
    for t in trials(night):
        line = next(l for l in out.splitlines() if re.match(rf"\s*{t['number']} ", l))
        assert t["kind"] in line and t["status"] in line
        assert (t["description"] or "")[:20] in line
        if t["metric"] is not None and (t["n_runs"] or 1) > 1:
            assert f"{t['metric']:.4f} ± {t['metric_sd']:.4f} ({t['n_runs']})" in line
        elif t["metric"] is not None:
            assert f"{t['metric']:.6f}" in line
    assert "CUDA error: an illegal memory access was encountered (pretend)" in out
    assert "showing" not in out  # 9 trials: all of them


def test_log_default_view_is_the_last_50(tmp_path):
    from autoloop.store import Store

    repo = tmp_path / "r"
    repo.mkdir()
    store = Store(repo / "experiments.db")
    run = store.create_run("many", branch="autoloop/many", base_commit="0" * 40)
    for i in range(60):
        t = store.new_trial(run["id"], "proposal" if i else "baseline", description=f"idea {i}")
        store.update_trial(t["id"], status="discard", metric=1.0 + i / 100)
    store.close()
    out = cli(repo, "log").output
    numbers = [int(l.split()[0]) for l in out.splitlines() if re.match(r"\s*\d+ ", l)]
    assert numbers == list(range(11, 61))
    assert "showing 50 of 60 trials" in out
    every = cli(repo, "log", "--all").output
    assert len([l for l in every.splitlines() if re.match(r"\s*\d+ ", l)]) == 60
    assert len(json.loads(cli(repo, "log", "--json").output)) == 60


def test_log_rejects_an_unknown_status(night):
    result = cli(night, "log", "--status", "kept", ok=False)
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "error: unknown status 'kept': use one of running, keep, discard, crash, timeout, invalid, interrupted "
        "(comma-separated for several)"]


# ---------------------------------------------------------------------------- show and diff


def test_show_has_every_field_the_evidence_diff_and_log(night):
    t = next(r for r in trials(night) if r["number"] == 5)
    out = cli(night, "show", "5").output
    assert out.startswith(f"trial 5 of run '{TAG}' [proposal]: discard")
    for text in (t["description"], t["reason"], f"{t['metric']:.6f} (harness)", f"{t['best_before']:.6f}",
                 f"{t['metric'] - t['best_before']:+.6f}", "keep margin    0.0", t["parent_commit"], t["trial_commit"],
                 f"refs/autoloop/{TAG}/trials/5", "idea           4: wider [WIDTH=128]", "+WIDTH = 128", "-WIDTH = 64"):
        assert text in out, text
    log_lines = Path(t["log_path"]).read_text().splitlines()
    assert f"log: last {len(log_lines)} lines of {t['log_path']}" in out
    assert out.rstrip().endswith(log_lines[-1])


def test_show_names_the_compile_flag_and_the_warm_up_time_apart():
    """`compile: False` beside `compile 48.1 s` read as a contradiction: the seconds are the
    harness clock's untimed warm-up, whether or not torch.compile is on."""
    from autoloop.review.text import format_trial

    out = format_trial({"number": 3, "run": "r", "kind": "proposal", "status": "discard", "compile_seconds": 48.1,
                        "training_seconds": 20.0, "result": {"compiled": False, "depth": 2}}, with_diff=False)
    assert "torch.compile  off" in out and "untimed warm-up 48.1 s" in out
    assert "compile 48.1 s" not in out and "compiled" not in out


def test_show_gives_the_trials_own_log_not_the_incumbents(repo):
    """A comparison's last run may be the incumbent's re-measurement (its row's log_path
    then names the incumbent's run): `show` gives the trial's own last run's log."""
    t = next(r for r in trials(repo) if r["number"] == 5)
    own = [m for m in db_rows(repo, f"SELECT * FROM measurements WHERE trial_id = {t['id']} ORDER BY id")]
    incumbent_log = db_rows(repo, "SELECT log_path FROM measurements WHERE trial_id = "
                                  "(SELECT id FROM trials WHERE number = 1) ORDER BY id")[0]["log_path"]
    conn = sqlite3.connect(repo / "experiments.db")
    try:
        conn.execute("UPDATE trials SET log_path = ? WHERE id = ?", (incumbent_log, t["id"]))
        conn.commit()
    finally:
        conn.close()
    out = cli(repo, "show", "5").output
    assert f"lines of {own[-1]['log_path']}" in out and incumbent_log not in out


def test_show_json_has_every_column(night):
    out = json.loads(cli(night, "show", "3", "--json").output)
    columns = [c["name"] for c in db_rows(night, "PRAGMA table_info(trials)")]
    process = {"pgid", "pid", "pid_start_time", "heartbeat_at"}
    assert set(columns) - process <= set(out)
    assert out["status"] == "crash" and out["reason"] == "RuntimeError: CUDA error: an illegal memory access was encountered (pretend)"
    assert any("RuntimeError: CUDA error: an illegal memory access was encountered (pretend)" in line for line in out["log_tail"])


def test_show_of_a_crash_and_an_invalid_trial(night):
    crash = cli(night, "show", "3", "--no-diff").output
    assert "RuntimeError: CUDA error: an illegal memory access was encountered (pretend)" in crash and "\ndiff\n" not in crash
    invalid = cli(night, "show", "6").output
    assert "invalid" in invalid and "syntax error in train.py" in invalid
    assert "(none: the proposal was rejected before it was committed" in invalid


def test_diff_is_the_commit_diff_and_applies(night, tmp_path):
    t = next(r for r in trials(night) if r["number"] == 4)
    out = cli(night, "diff", "4").stdout
    assert out == git(night, "diff", "--no-color", "--binary", t["parent_commit"], t["trial_commit"], "--")
    # It applies to the parent: check it in a scratch worktree at the parent commit.
    work = tmp_path / "wt"
    git(night, "worktree", "add", "--detach", str(work), t["parent_commit"])
    try:
        subprocess.run(["git", "apply", "--check", "-"], cwd=work, input=out, text=True, check=True)
    finally:
        git(night, "worktree", "remove", "--force", str(work))


def test_diff_without_a_diff_says_why(night):
    base = cli(night, "diff", "1")
    assert base.stdout == "" and "the baseline trains the base commit unchanged" in base.stderr
    invalid = cli(night, "diff", "6")
    assert invalid.stdout == "" and "rejected before it was committed" in invalid.stderr


# ---------------------------------------------------------------------------- best


def test_best_against_the_baseline(night):
    info = json.loads(cli(night, "best", "--json").output)
    keeps = db_rows(night, "SELECT * FROM trials WHERE status = 'keep' ORDER BY metric LIMIT 1")[0]
    run = db_rows(night, "SELECT * FROM runs")[0]
    base = db_rows(night, "SELECT * FROM trials WHERE kind = 'baseline'")[0]
    assert info["best_trial"] == keeps["number"] == 4
    assert info["best_commit"] == run["best_commit"] == keeps["trial_commit"]
    assert info["metric"] == keeps["metric"] and info["baseline_metric"] == base["metric"]
    assert info["relative_gain"] == pytest.approx((base["metric"] - keeps["metric"]) / base["metric"])
    assert info["kept"] == 2 and info["heldout_metric"] is None
    text = cli(night, "best").output
    assert f"trial 4 at {run['best_commit']}" in text and "held-out  - (not verified)" in text
    # best minus baseline, said with its direction (docs/review.md, "Numbers")
    assert f"{(base['metric'] - keeps['metric']) / base['metric'] * 100:.2f}% lower" in text and "better)" not in text


# ---------------------------------------------------------------------------- finalize


def _state(repo: Path) -> tuple:
    return (git(repo, "rev-parse", "HEAD"), git(repo, "symbolic-ref", "HEAD"), git(repo, "status", "--porcelain"),
            git(repo, "rev-parse", f"autoloop/{TAG}"), (repo / "train.py").read_text())


def test_finalize_squashes_the_kept_changes_onto_the_base(repo):
    run = db_rows(repo, "SELECT * FROM runs")[0]
    before = _state(repo)
    out = cli(repo, "finalize", "--json").output
    result = json.loads(out)
    branch = f"final/{TAG}"
    assert result["branch"] == branch and result["trials"] == [2, 4]
    assert _state(repo) == before  # worktree, HEAD, current branch and the run's branch untouched
    tip = git(repo, "rev-parse", branch).strip()
    assert git(repo, "rev-parse", f"{tip}^{{tree}}") == git(repo, "rev-parse", f"{run['best_commit']}^{{tree}}")
    assert git(repo, "rev-parse", f"{tip}^").strip() == run["base_commit"]
    message = git(repo, "log", "-1", "--format=%B", tip)
    kept = db_rows(repo, "SELECT * FROM trials WHERE status = 'keep' AND kind = 'proposal' ORDER BY number")
    from autoloop.review.queries import trial_delta

    for t in kept:
        # its delta as `log` gives it: the paired difference against its incumbent
        assert (f"- trial {t['number']}: {t['description']} (val_bpb {t['metric']:.6f}, {trial_delta(t):+.4f} bpb "
                "against its incumbent)") in message
    assert "crash it" not in message and "wider" not in message
    # The best trial's checkpoint, copied under .autoloop/<tag>/best/.
    best_dir = repo / ".autoloop" / TAG / "best"
    assert json.loads((best_dir / "checkpoint.pt").read_text()) == {"LR": 0.01, "WIDTH": 64}
    info = json.loads((best_dir / "best.json").read_text())
    assert info["trial"] == 4 and info["commit"] == run["best_commit"] and info["finalized_commit"] == tip


def test_finalize_per_trial_and_the_branch_rules(repo):
    run = db_rows(repo, "SELECT * FROM runs")[0]
    kept = {t["number"]: t for t in db_rows(repo, "SELECT * FROM trials WHERE status = 'keep' AND kind = 'proposal'")}
    cli(repo, "finalize", "--per-trial", "--branch", "story")
    commits = git(repo, "rev-list", "--reverse", f"{run['base_commit']}..story").split()
    assert len(commits) == 2
    for sha, number in zip(commits, (2, 4)):
        assert git(repo, "rev-parse", f"{sha}^{{tree}}") == git(repo, "rev-parse", f"{kept[number]['trial_commit']}^{{tree}}")
        assert f"Autoloop-Trial: {number}" in git(repo, "log", "-1", "--format=%B", sha)

    again = cli(repo, "finalize", "--branch", "story", ok=False)
    assert again.exit_code == 1 and "branch 'story' already exists" in again.output
    assert len(again.output.strip().splitlines()) == 1
    cli(repo, "finalize", "--branch", "story", "--force")
    assert git(repo, "rev-list", "--count", f"{run['base_commit']}..story").strip() == "1"
    own = cli(repo, "finalize", "--branch", f"autoloop/{TAG}", ok=False)
    assert own.exit_code == 1 and "the run's own branch" in own.output
    assert git(repo, "rev-parse", f"autoloop/{TAG}").strip() == run["best_commit"]


def test_finalize_checkout(repo):
    (repo / "train.py").write_text((repo / "train.py").read_text() + "# local edit\n")
    dirty = cli(repo, "finalize", "--checkout", ok=False)
    assert dirty.exit_code == 1 and "uncommitted changes" in dirty.output
    assert "final/" not in git(repo, "branch")  # refused before anything was written
    git(repo, "checkout", "--", "train.py")
    cli(repo, "finalize", "--checkout")
    assert git(repo, "symbolic-ref", "--short", "HEAD").strip() == f"final/{TAG}"
    best = db_rows(repo, "SELECT best_commit FROM runs")[0]["best_commit"]
    assert (repo / "train.py").read_text() == git(repo, "show", f"{best}:train.py")


# ---------------------------------------------------------------------------- report


def _stats(page: str) -> dict[str, str]:
    return dict(re.findall(r'data-key="(\w+)"[^>]*><div class="label">[^<]*</div><div class="value">([^<]*)</div>', page))


def _section(page: str, table_id: str) -> str:
    return page.split(f'<table id="{table_id}">')[1].split("</table>")[0]


def test_report_headline_tables_and_charts(repo, tmp_path):
    out_dir = tmp_path / "report"
    result = cli(repo, "report", "--out", str(out_dir))
    assert "report.html" in result.output
    page = (out_dir / "report.html").read_text()
    db = trials(repo)
    count = lambda *statuses: sum(1 for t in db if t["status"] in statuses)
    proposals = [t for t in db if t["kind"] == "proposal"]
    kept = sum(1 for t in proposals if t["status"] == "keep")
    decided = sum(1 for t in proposals if t["status"] != "interrupted")
    base = next(t for t in db if t["kind"] == "baseline")["metric"]
    best = min(t["metric"] for t in db if t["status"] == "keep")
    stats = _stats(page)
    assert stats["trials"] == str(len(db)) == "9"
    assert stats["kept"] == str(kept) == "2"
    assert stats["discarded"] == str(count("discard")) == "2"
    assert stats["crashed"] == str(count("crash", "timeout")) == "3"
    assert stats["invalid"] == str(count("invalid")) == "1"
    assert stats["keep_rate"] == f"{kept / decided * 100:.1f}%"
    # every training run once (the baseline's seeds and the best's re-measurement too), not each trial's last
    timed = db_rows(repo, "SELECT COALESCE(SUM(wall_seconds), 0) AS s FROM measurements")[0]["s"]
    untimed = sum(t["wall_seconds"] or 0 for t in db if not db_rows(
        repo, "SELECT 1 FROM measurements WHERE COALESCE(for_trial_id, trial_id) = ? AND wall_seconds IS NOT NULL",
        (t["id"],)))
    assert stats["compute_hours"] == f"{(timed + untimed) / 3600:.2f}"
    assert 'data-key="compute_hours"><div class="label">CPU hours</div>' in page and "GPU hours" not in page
    # The night ended by its limit: its best was re-measured at fresh seeds (the fake has no
    # seed noise, so exactly its value, with a standard error of 0).
    assert stats["baseline_to_best"] == f"{base:.4f} → {best:.4f} ± 0.0000"
    assert stats["relative_gain"] == f"{(base - best) / base * 100:.2f}% lower"
    assert 'data-key="relative_gain" data-state="measured"' in page  # no ablation yet: not claimed as confirmed

    # The kept table lists exactly the kept trials, in order, with their deltas (the paired
    # difference its decision gives, as `log` shows it).
    from autoloop.review.queries import trial_delta

    kept_table = _section(page, "kept")
    assert [int(n) for n in re.findall(r'<tr data-trial="(\d+)"', kept_table)] == \
        [t["number"] for t in db if t["status"] == "keep"] == [1, 2, 4]
    for t in db:
        if t["status"] == "keep" and t["kind"] != "baseline":
            assert f"{trial_delta(t):+.4f}" in kept_table

    # Every discarded trial: what it tried and why it was discarded.
    discarded = _section(page, "discarded")
    assert [int(n) for n in re.findall(r'<tr data-trial="(\d+)"', discarded)] == \
        [t["number"] for t in db if t["status"] == "discard"] == [5, 8]
    assert "WIDTH 64 → 128" in discarded and "LR 0.01 → 0.012" in discarded  # 8 was tried on trial 4's LR
    for t in db:
        if t["status"] == "discard":
            assert _html(t["reason"]) in discarded

    crashes = _section(page, "crash-reasons")
    rows = re.findall(r"<tr><td class=\"num\">(\d+)</td><td>([^<]*)</td><td>([^<]*)</td></tr>", crashes)
    assert rows[0] == ("2", "RuntimeError: CUDA error: an illegal memory access was encountered (pretend)", "3, 9")
    assert any(r[2] == "7" and "deadline" in r[1] for r in rows)
    assert "syntax error in train.py" in _section(page, "invalid-reasons")

    ideas = _section(page, "ideas")
    assert len(re.findall(r"<tr data-idea=", ideas)) == 9
    assert "try rotary embeddings" in ideas and "waiting: text only" in ideas  # no LLM or agent in the run
    assert "trial 4: <span class=\"status keep\">keep</span>" in ideas

    # Charts: inline SVG (the two charts and the experiment tree), no image files; the legend counts are the cards'.
    assert page.count('<svg xmlns="http://www.w3.org/2000/svg" class="chart"') == 2 and page.count("<svg ") == 3
    assert '<svg class="tree"' in page and "<img" not in page
    assert sorted(p.name for p in out_dir.iterdir()) == ["report.html"]
    assert f"discarded ({stats['discarded']})" in page and f"kept ({stats['kept']})" in page
    assert len(re.findall(r'class="point discard(?: above)?" data-trial=', page)) == int(stats["discarded"])
    assert len(re.findall(r'class="discard-label"', page)) == int(stats["discarded"])  # labelled with the number
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page


def _html(text: str) -> str:
    import html

    return html.escape(text, quote=True)


def test_the_report_lists_an_idea_with_a_patch_and_sets_as_both(repo, tmp_path):
    from autoloop.store import Store

    with Store(repo / "experiments.db") as store:
        store.add_idea("wider by patch, lower lr", sets={"LR": "0.012"}, source="human",
                       patch="--- a/train.py\n+++ b/train.py\n@@ -1 +1 @@\n-WIDTH = 64\n+WIDTH = 128\n")
    cli(repo, "report", "--out", str(tmp_path / "report"))
    page = (tmp_path / "report" / "report.html").read_text()
    assert "<td>wider by patch, lower lr</td><td><code>patch, LR=0.012</code></td>" in page


def test_report_default_folder(repo):
    cli(repo, "report")
    assert sorted(p.name for p in (repo / ".autoloop" / TAG / "report").iterdir()) == ["report.html"]


def test_report_works_after_the_readme_install_without_matplotlib(repo, tmp_path):
    """The README installs no plotting library: the report must not need one. matplotlib
    is made unimportable in the process, as if it were not installed."""
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from autoloop.cli import main; sys.argv = ['autoloop', 'report', '--repo', sys.argv[1], '--out', sys.argv[2]]\n"
            "main()")
    done = subprocess.run([sys.executable, "-c", code, str(repo), str(tmp_path / "r")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "r" / "report.html").read_text()
    assert page.count("<svg ") == 3 and 'class="point keep"' in page and 'class="curve baseline"' in page


# ---------------------------------------------------------------------------- export and load_trials


def test_export_tsv_reads_back_with_pandas(night, tmp_path):
    import pandas as pd

    from autoloop.review.export import autoresearch_status

    out = tmp_path / "results.tsv"
    cli(night, "export", "--format", "tsv", "--out", str(out))
    df = pd.read_csv(out, sep="\t")
    assert list(df.columns[:5]) == ["commit", "val_bpb", "memory_gb", "status", "description"]
    db = trials(night)
    assert list(df["trial"]) == [t["number"] for t in db]  # the baseline is trial 1; none is running
    for (_, row), t in zip(df.iterrows(), db):
        status = autoresearch_status(t["status"], t["kind"], t["metric"])
        assert row["status"] == status and row["autoloop_status"] == t["status"]
        assert row["description"] == t["description"] and row["kind"] == t["kind"] and row["run"] == TAG
        assert (row["commit"] if isinstance(row["commit"], str) else None) == (t["trial_commit"][:7] if t["trial_commit"] else None)
        if status == "crash":  # autoresearch's placeholders
            assert row["val_bpb"] == 0.0 and row["memory_gb"] == 0.0
        else:
            assert row["val_bpb"] == pytest.approx(t["metric"], abs=5e-7)  # 6 decimals
            assert row["memory_gb"] == pytest.approx(t["peak_memory_mb"] / 1024, abs=0.05)
        if t["metric"] is None:
            assert pd.isna(row["metric"])
        else:
            assert row["metric"] == t["metric"]  # exact: written with full precision
        assert (None if pd.isna(row["delta"]) else row["delta"]) == t["delta"]
    assert set(df["status"]) == {"keep", "discard", "crash"}
    # stdout gives the same text
    assert cli(night, "export").stdout == out.read_text()


def test_export_csv_and_json(night):
    import pandas as pd

    df = pd.read_csv(io.StringIO(cli(night, "export", "--format", "csv").stdout))
    assert list(df["status"]) == [t["status"] for t in trials(night)]
    records = json.loads(cli(night, "export", "--format", "json").stdout)
    db = trials(night)
    assert [r["number"] for r in records] == [t["number"] for t in db]
    for r, t in zip(records, db):
        assert r["metric"] == t["metric"] and r["diff"] == t["diff"] and r["run"] == TAG
        assert r["result"] == (json.loads(t["result"]) if t["result"] else None)
        assert "pgid" not in r
    bad = cli(night, "export", "--format", "xlsx", ok=False)
    assert bad.exit_code == 1 and "unknown export format 'xlsx'" in bad.output


def test_load_trials_is_typed(night):
    import pandas as pd

    import autoloop

    df = autoloop.load_trials(night / "experiments.db")
    db = trials(night)
    assert list(df["number"]) == [t["number"] for t in db]
    assert str(df["number"].dtype) == "Int64" and str(df["idea_id"].dtype) == "Int64"
    assert df["metric"].dtype == "float64"
    assert isinstance(df["status"].dtype, pd.CategoricalDtype)
    assert set(df["status"].cat.categories) == {"running", "keep", "discard", "crash", "timeout", "invalid", "interrupted"}
    assert str(df["started_at"].dtype).startswith("datetime64") and str(df["started_at"].dt.tz) == "UTC"
    assert str(df["description"].dtype) == "string"
    assert (df["run"] == TAG).all()
    for (_, row), t in zip(df.iterrows(), db):
        assert (None if pd.isna(row["metric"]) else row["metric"]) == t["metric"]
        assert row["status"] == t["status"]
    assert isinstance(df.loc[0, "result"], dict)
    assert len(autoloop.load_trials(night / "experiments.db", run=TAG)) == len(db)


def test_load_trials_errors(night, tmp_path):
    from autoloop import load_trials
    from autoloop.errors import AutoloopError

    with pytest.raises(AutoloopError, match="no run tagged 'nope'.*runs: night"):
        load_trials(night / "experiments.db", run="nope")
    with pytest.raises(AutoloopError, match="no trial database at"):
        load_trials(tmp_path / "missing.db")
    assert not (tmp_path / "missing.db").exists()
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(AutoloopError, match="not an autoloop database"):
        load_trials(tmp_path / "notes.txt")


def test_import_autoloop_stays_light():
    code = "import sys, autoloop; assert callable(autoloop.__getattr__); print(sorted(m for m in ('pandas', 'sqlite_utils', 'git', 'matplotlib') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# ---------------------------------------------------------------------------- errors


def _one_error_line(result, text: str) -> None:
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], lines


COMMANDS = [["log"], ["show", "1"], ["diff", "1"], ["best"], ["finalize"], ["report"], ["export"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_unknown_run_and_foreign_file(night, tmp_path, command):
    _one_error_line(cli(night, *command, "--tag", "nope", ok=False), "no run tagged 'nope'")
    (tmp_path / "notes.db").write_text("not sqlite\n")
    _one_error_line(cli(night, *command, "--db", str(tmp_path / "notes.db"), ok=False), "is not an autoloop database")
    conn = sqlite3.connect(tmp_path / "other.db")
    conn.execute("CREATE TABLE things (x)")
    conn.close()
    _one_error_line(cli(night, *command, "--db", str(tmp_path / "other.db"), ok=False), "is not an autoloop database")


@pytest.mark.parametrize("command", COMMANDS[1:], ids=lambda c: c[0])
def test_empty_run(tmp_path, command):
    from autoloop.store import Store

    repo = tmp_path / "r"
    repo.mkdir()
    store = Store(repo / "experiments.db")
    store.create_run("empty", branch="autoloop/empty", base_commit="0" * 40)
    store.close()
    expected = "has no trial 1 (no trials yet)" if command[0] in ("show", "diff") else "run 'empty' has no trials yet"
    _one_error_line(cli(repo, *command, ok=False), expected)
    assert cli(repo, "log").output.strip() == "run 'empty' has no trials yet"


@pytest.mark.parametrize("command", [["show", "99"], ["diff", "99"], ["show", "0"]], ids=lambda c: " ".join(c))
def test_trial_that_does_not_exist(night, command):
    _one_error_line(cli(night, *command, ok=False), f"run '{TAG}' has no trial {command[1]} (trials 1-9)")


def test_a_run_whose_baseline_crashed(fake_repo, tmp_path):
    """No metric anywhere: the report still renders; best and finalize say why not."""
    from autoloop.store import Store

    head = git(fake_repo, "rev-parse", "HEAD").strip()
    store = Store(fake_repo / "experiments.db")
    run = store.create_run("broken", branch="autoloop/broken", base_commit=head, best_commit=head)
    t = store.new_trial(run["id"], "baseline", parent_commit=head, trial_commit=head, description="baseline")
    store.update_trial(t["id"], status="crash", reason="RuntimeError: boom", wall_seconds=3.0)
    store.close()
    cli(fake_repo, "report", "--out", str(tmp_path / "r"))
    stats = _stats((tmp_path / "r" / "report.html").read_text())
    assert stats["crashed"] == "1" and stats["baseline_to_best"] == "– → –" and stats["keep_rate"] == "–"
    _one_error_line(cli(fake_repo, "best", ok=False), "has no successful trial yet")
    _one_error_line(cli(fake_repo, "finalize", ok=False), "has no successful trial yet")


def test_finalize_with_nothing_kept(fake_repo):
    from autoloop.store import Store

    head = git(fake_repo, "rev-parse", "HEAD").strip()
    store = Store(fake_repo / "experiments.db")
    run = store.create_run("flat", branch="autoloop/flat", base_commit=head, best_commit=head)
    t = store.new_trial(run["id"], "baseline", parent_commit=head, trial_commit=head)
    store.update_trial(t["id"], status="keep", metric=1.2)
    store.close()
    # Not an error: one line saying why no branch was made and what to try, exit 0 (tests/test_nothing_kept.py).
    lines = cli(fake_repo, "finalize").output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("run 'flat' tried no change yet (only its baseline ran), so there "
                                                   "is nothing to finalize (no branch was made)"), lines
    assert "final/" not in git(fake_repo, "branch")


def _run_with_ablated_changes(repo: Path, drops: dict[str, bool]) -> None:
    """A run of kept changes (one commit each, in order) whose latest ablations found the
    ones marked True indistinguishable from zero: git commits and db rows, by hand."""
    from autoloop.store import Store

    base = git(repo, "rev-parse", "HEAD").strip()
    git(repo, "checkout", "-q", "-b", "autoloop/abl")
    store = Store(repo / "experiments.db")
    run = store.create_run("abl", branch="autoloop/abl", base_commit=base, best_commit=base, status="finished")
    b = store.new_trial(run["id"], "baseline", parent_commit=base, trial_commit=base, description="baseline")
    store.update_trial(b["id"], status="keep", metric=1.2)
    parent, kept = base, []
    for k, (constant, drop) in enumerate(drops.items()):
        source = (repo / "train.py").read_text()
        line = next(l for l in source.splitlines() if l.startswith(f"{constant} = "))
        (repo / "train.py").write_text(source.replace(line, f"{constant} = {2 ** (k + 7)}", 1))
        git(repo, "commit", "-qam", f"set {constant}")
        sha = git(repo, "rev-parse", "HEAD").strip()
        t = store.new_trial(run["id"], "proposal", parent_commit=parent, trial_commit=sha, description=f"set {constant}",
                            diff=git(repo, "diff", parent, sha))
        store.update_trial(t["id"], status="keep", metric=1.1 - 0.01 * k, delta=-0.01)
        parent = sha
        kept.append((t, drop))
    store.update_run(run["id"], best_commit=parent)
    for t, drop in kept:
        a = store.new_trial(run["id"], "ablation", parent_commit=parent, derived_from=t["id"], description="ablation")
        store.update_trial(a["id"], status="discard", metric=1.1, decision={
            "effect": -0.0005 if drop else -0.05, "low": -0.01 if drop else -0.06, "high": 0.009 if drop else -0.04,
            "n": 3, "null": drop, "drop": drop, "level": 0.95})
    store.close()
    git(repo, "checkout", "-q", "main")


def test_finalize_drop_null_says_plainly_what_it_left_out(fake_repo):
    _run_with_ablated_changes(fake_repo, {"WIDTH": False, "LR": True})
    # (a hand-made run: nothing to re-measure it with; the headline is not what this tests)
    result = cli(fake_repo, "finalize", "--tag", "abl", "--drop-null", "--no-remeasure")
    first = result.output.splitlines()[0]
    assert "with kept trial 2, leaving out trial 3 (no benefit in the ablation)" in first and "without it" in first
    assert " , " not in first and "trials ," not in first


def test_finalize_drop_null_with_nothing_left_makes_no_empty_commit(fake_repo):
    _run_with_ablated_changes(fake_repo, {"WIDTH": True})
    _one_error_line(cli(fake_repo, "finalize", "--tag", "abl", "--drop-null", "--no-remeasure", ok=False),
                    "the ablation found no benefit from any kept change of run 'abl' (trial 2): with --drop-null "
                    "nothing is left to finalize")
    assert "final/" not in git(fake_repo, "branch")


# ---------------------------------------------------------------------------- while a run is writing


def test_every_command_works_while_a_run_is_writing(repo, tmp_path, session_cache):
    """A real controller resumes the run in another process and keeps writing trials
    (each one sleeps a little) while every review command reads the same db."""
    from autoloop.store import Store

    store = Store(repo / "experiments.db")
    for i in range(40):
        store.add_idea(f"slow {i}", sets={"SLEEP": "0.4", "LR": f"{0.013 + i / 10000:.4f}"}, source="human")
    store.close()
    before = len(trials(repo))
    env = {**os.environ, **GIT_ENV, "AUTOLOOP_CACHE_DIR": str(session_cache)}
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(repo), TAG, "40"],
        cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        deadline = time.time() + 60
        while len(trials(repo)) < before + 2:
            assert writer.poll() is None and time.time() < deadline, writer.stderr.read().decode()
            time.sleep(0.2)
        out = tmp_path / "out"
        # At least two rounds, and until the writer has added a trial while the readers read
        # (a loaded machine slows both: the bound is generous, the condition is what counts).
        round_, deadline = 0, time.time() + 600
        while round_ < 2 or len(trials(repo)) <= before + 2:
            latest = str(len(trials(repo)))
            for command in (["log"], ["log", "--json"], ["show", latest], ["show", "2"], ["diff", "4"], ["best"],
                            ["report", "--out", str(out)], ["export", "--format", "tsv"], ["export", "--format", "json"],
                            ["finalize", "--branch", f"snapshot{round_}"], ["status"], ["ideas"]):
                cli(repo, *command)
            assert writer.poll() is None, "the writer finished before the readers did: give it more work"
            assert time.time() < deadline, f"the writer added no trial in {round_ + 1} rounds of reading"
            round_ += 1
        rows = json.loads(cli(repo, "log", "--json").output)
        assert len(rows) > before + 2
        assert [r["number"] for r in rows] == list(range(1, len(rows) + 1))
        page = (out / "report.html").read_text()
        assert _stats(page)["trials"] in {str(n) for n in range(before + 2, len(rows) + 1)}
    finally:
        if writer.poll() is None:
            os.kill(writer.pid, signal.SIGINT)  # the controller stops after killing its trial
        writer.wait(timeout=60)
    after = trials(repo)
    assert all(t["status"] != "running" for t in after)
    assert db_rows(repo, "PRAGMA integrity_check")[0]["integrity_check"] == "ok"


# ---------------------------------------------------------------------------- slow: a browser, the real train.py


def _pixels_near(image, rgb, tolerance=12) -> int:
    import numpy as np

    target = np.array(rgb, dtype=float) / 255.0
    return int((np.abs(image[:, :, :3] - target).max(axis=2) < tolerance / 255.0).sum())


@pytest.mark.slow
def test_report_screenshot_in_headless_chromium(repo, tmp_path):
    """The page as a browser renders it shows the charts and the tables (look at the
    PNG yourself with scripts/screenshot_report.py; this checks it is not blank)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        import screenshot_report
    finally:
        sys.path.pop(0)
    if screenshot_report.find_chromium() is None:
        pytest.skip("no chromium installed (apt-get install -y chromium)")
    from matplotlib.image import imread

    cli(repo, "report", "--out", str(tmp_path / "report"))
    png = screenshot_report.screenshot(tmp_path / "report" / "report.html", tmp_path / "shot.png", height=2600)
    image = imread(png)
    assert image.shape[1] == 1280 and image.shape[0] == 2600
    white = (image[:, :, :3] > 0.98).all(axis=2).mean()
    assert white < 0.93, "the page is (almost) blank"
    assert _pixels_near(image, (0x1a, 0x98, 0x50)) > 200  # kept points and the running-best line
    assert _pixels_near(image, (0xd7, 0x30, 0x27)) > 20  # the crash markers
    assert _pixels_near(image, (0xf6, 0xf8, 0xfa)) > 20000  # stat cards and table headers


# The repository's train.py starts with learning rates 1000x too small; the idea restores
# them: an improvement far beyond the seed noise even at 3 steps, so the paired rule keeps
# it (and it is verified) without depending on train.py's tuning.
HANDICAP = {"MATRIX_LR": ("0.04", "0.00004"), "EMBEDDING_LR": ("0.6", "0.0006"),
            "UNEMBEDDING_LR": ("0.004", "0.000004")}
REAL_IDEAS = [("restore the learning rates", {name: good for name, (good, _) in HANDICAP.items()})]


def handicapped_train_py(source: str) -> str:
    for name, (good, bad) in HANDICAP.items():
        line = re.search(rf"^{name} = {re.escape(good)}  # .*$", source, re.MULTILINE).group(0)
        source = source.replace(line, f"{name} = {bad}  # too small on purpose (tests/test_review.py)")
    return source


@pytest.mark.slow
def test_review_of_a_run_of_the_real_train_py(tmp_path, session_cache, embedded_dataset, monkeypatch):
    """The real train.py in step mode, verified, then every review command on its db:
    real loss curves, a real checkpoint, held-out metrics."""
    from autoloop.config import resolve
    from autoloop.loop.controller import Controller
    from autoloop.store import Store
    from conftest import REPO_ROOT, make_repo

    repo = make_repo(tmp_path / "real", handicapped_train_py((REPO_ROOT / "train.py").read_text()))
    # One run a trial (strict, one baseline seed): what is reviewed here is one real run's
    # curves, checkpoint and held-out figures; several runs a trial are review_support's
    # noisy db's. The paired rule's five more trainings and evaluations cost 50 s of CPU here
    # (measured with bench/suite_cpu.py); most of what is left is the keep's probes.
    config = resolve(repo, {"tag": "real", "max_steps": 3, "max_trials": 2, "proposers": "ideas",
                            "decision_rule": "strict", "baseline_seeds": 1})
    store = Store(repo / "experiments.db")
    for text, sets in REAL_IDEAS:
        store.add_idea(text, sets=sets, source="human")
    store.close()
    Controller(config, repo).run()
    db = trials(repo)
    assert [t["status"] for t in db] == ["keep", "keep"], [t["reason"] for t in db]

    info = json.loads(cli(repo, "best", "--json").output)
    assert info["best_trial"] == 2 and info["metric_source"] == "verified"
    assert info["heldout_metric"] == db[1]["heldout_metric"] is not None
    assert info["baseline_heldout_metric"] == db[0]["heldout_metric"] is not None

    out = tmp_path / "report"
    cli(repo, "report", "--out", str(out))
    page = (out / "report.html").read_text()
    assert _stats(page)["baseline_to_best"] == f"{db[0]['metric']:.4f} → {db[1]['metric']:.4f}"
    assert not (out / "loss_curves.png").exists()  # the page draws its charts inline
    for label in ("baseline", "best"):  # the real curves, each a path through its logged steps
        (path,) = re.findall(rf'<path class="curve {label}" d="([^"]+)"', page)
        assert path.count("L") >= 2, path
    curve = db_rows(repo, "SELECT COUNT(*) AS n FROM curves WHERE trial_id = ?", (db[1]["id"],))[0]["n"]
    assert curve >= 3

    result = json.loads(cli(repo, "finalize", "--json").output)
    assert git(repo, "rev-parse", f"{result['commit']}^{{tree}}") == git(repo, "rev-parse", f"{db[1]['trial_commit']}^{{tree}}")
    copied = Path(result["checkpoint"])
    assert copied.read_bytes() == Path(db[1]["checkpoint_path"]).read_bytes()
    from autoloop.harness import load_trained_model

    model = load_trained_model(repo / "train.py", copied)  # the kept weights load with the kept code
    assert sum(p.numel() for p in model.parameters()) == db[1]["num_params"]

    import autoloop

    df = autoloop.load_trials(repo / "experiments.db")
    assert list(df["metric"]) == [t["metric"] for t in db]
    assert list(df["heldout_metric"]) == [t["heldout_metric"] for t in db]


# ---------------------------------------------------------------------------- noise-aware trials


@pytest.fixture
def noisy(tmp_path) -> Path:
    """A db written the way the noise-aware controller writes it (review_support.build_noisy_db)."""
    build_noisy_db(tmp_path / "noisy")
    return tmp_path / "noisy"


def _line_of(out: str, number: int) -> str:
    return next(l for l in out.splitlines() if re.match(rf"\s*{number} ", l))


def test_log_shows_mean_se_and_runs_of_several_runs_and_single_runs_as_before(noisy):
    out = cli(noisy, "log").output
    db = {t["number"]: t for t in trials(noisy)}
    for number, t in db.items():
        line = _line_of(out, number)
        if t["n_runs"] > 1:
            assert f"{t['metric']:.4f} ± {t['metric_sd']:.4f} ({t['n_runs']})" in line
        else:
            assert f"{t['metric']:.6f}" in line and "±" not in line
    assert "2.5431 ± 0.0023 (3)" in _line_of(out, 2)
    assert "-0.0011~" in _line_of(out, 3)  # the near miss
    assert "+0.0020≈" in _line_of(out, 6)  # not distinguishable, not a near miss
    assert "≈" not in _line_of(out, 2) and "~" not in _line_of(out, 4)
    assert "~ near miss: discarded, but within the noise of the incumbent" in out
    assert "≈ not distinguishable from the incumbent" in out
    assert "val_bpb of several runs: mean ± standard error (runs)" in out


def test_log_json_has_the_uncertainty(noisy):
    out = {r["number"]: r for r in json.loads(cli(noisy, "log", "--json").output)}
    for t in trials(noisy):
        row = out[t["number"]]
        assert (row["metric"], row["metric_sd"], row["n_runs"]) == (t["metric"], t["metric_sd"], t["n_runs"])
        decision = json.loads(t["decision"]) if t["decision"] else {}
        if "mean_diff" in decision:
            low, high = decision.get("interval") or (decision["low"], decision["high"])
            assert row["distinguishable"] == (not low <= 0 <= high)  # the interval decides
    assert out[3]["near_miss"] is True and out[3]["distinguishable"] is False
    assert out[2]["near_miss"] is False and out[2]["distinguishable"] is True
    assert out[5]["near_miss"] is None and out[5]["distinguishable"] is None  # a drift check: no decision


OLD_LOG = """\
   # kind      status        val_bpb     delta    min  description / reason
   1 baseline  keep        1.090600?         -    0.5  baseline
                                                    ↳ first result: val_bpb 1.090600
   2 proposal  keep        1.031000?   -0.0596    0.5  lr 0.015
                                                    ↳ improved
   3 proposal  crash               -         -    0.5  crash it
                                                    ↳ RuntimeError: pretend
   4 proposal  discard      1.100000   +0.0690    0.5  wider
                                                    ↳ 1.100000 is not better than the best 1.031000 (+0.069000)
   5 rerun     discard      1.031200   +0.0002    0.5  re-run of the incumbent
                                                    ↳ re-run of the incumbent
? kept without verification (--no-verify): the script's own figure, no held-out check
"""


def test_an_old_database_reads_as_before(tmp_path):
    build_old_db(tmp_path / "old")
    repo = tmp_path / "old"
    assert cli(repo, "log").output == OLD_LOG
    shown = cli(repo, "show", "5").output
    assert "  measurement    val_bpb 1.031200 (seed 1)" in shown
    for new in ("measurements (", "decision", "flags", "ablation", "±"):
        assert new not in shown
    status = cli(repo, "status").output
    assert "noise" not in status and "drift" not in status
    assert "best: val_bpb 1.031000 (trial 2" in status
    info = json.loads(cli(repo, "status", "--json").output)
    assert info["noise"] is None and info["drift"] == [] and info["noise_events"] == []
    page = (Path(cli(repo, "report", "--out", str(tmp_path / "r"), "--no-remeasure").output.split()[1])).read_text()
    assert 'id="ablation"' not in page and "Noise and drift" not in page and "±" not in page


def test_show_lists_every_measurement_the_decision_and_the_flags(noisy):
    out = cli(noisy, "show", "3", "--no-diff").output
    db = {t["number"]: t for t in trials(noisy)}
    rows = db_rows(noisy, "SELECT m.*, t.number AS owner FROM measurements m JOIN trials t ON t.id = m.trial_id "
                          "WHERE m.trial_id = ? OR m.for_trial_id = ? ORDER BY m.id", (db[3]["id"], db[3]["id"]))
    assert len(rows) == 3 and {r["role"] for r in rows} == {"candidate", "incumbent"}
    section = out.split("measurements (3)\n")[1].split("\ndecision\n")[0].splitlines()
    for row, line in zip(rows, section[1:]):
        cells = line.split()
        assert int(cells[0]) == row["seed"] and cells[1] == row["role"]
        assert f"{row['metric']:.6f}" in line and f" {row['num_steps']} " in line
        assert f"{row['training_seconds']:.1f}" in line and f"{row['wall_seconds']:.1f}" in line
        assert line.rstrip().endswith("ok")
        # The incumbent's row names the trial whose code it trained; the trial's own rows leave it blank.
        assert cells[2] == ("2" if row["owner"] == 2 else f"{row['metric']:.6f}")
    decision = json.loads(db[3]["decision"])
    block = out.split("\ndecision\n")[1].split("\nflags\n")[0]
    assert f"statistic        {decision['statistic']:.6g}" in block
    assert f"95% CI {decision['low']:+.4f}..{decision['high']:+.4f}" in block
    assert "pairs (n)        2" in block and "stopped because  max runs reached" in block
    assert "near miss        yes" in block and "distinguishable  no" in block
    assert "slow_start: spent 40% of its budget before the first step" in out.split("\nflags\n")[1]
    assert "2.5420 ± 0.0040 (2) (harness): mean ± standard error of 2 runs" in out

    detail = json.loads(cli(noisy, "show", "3", "--json").output)
    assert [m["role"] for m in detail["measurements"]] == [r["role"] for r in rows]
    assert detail["decision"] == decision
    assert detail["flags"] == [{"flag": "slow_start", "message": "spent 40% of its budget before the first step"}]


def test_show_reads_the_figures_under_decides_names_too(noisy):
    out = cli(noisy, "show", "6", "--no-diff").output
    block = out.split("\ndecision\n")[1].split("\ncommits\n")[0]
    for expected in ("statistic        1.111", "bound            -3.2", "stopped because  futility",
                     "interval         95% CI -0.0022..+0.0062", "distinguishable  no", "near miss        no"):
        assert expected in block, expected


def test_show_of_an_ablation_and_of_the_change_it_measured(noisy):
    out = cli(noisy, "show", "7", "--no-diff").output
    assert "reverts the change of trial 2 in the best commit" in out
    assert "effect -0.0569 (95% CI -0.0612..-0.0526, 3 paired runs): helps" in out
    assert "\ndecision\n" not in out  # its figures are the ablation's, shown once
    kept = cli(noisy, "show", "2", "--no-diff").output
    assert "ablations\n  trial 7: effect -0.0569" in kept
    assert "for trial 3" in kept  # its re-measurement for trial 3's comparison


def test_status_shows_the_noise_estimate_and_drift(noisy):
    out = cli(noisy, "status").output
    assert "noise: one run sd 0.0060, paired difference sd 0.0040 (8 df); decision rule paired" in out
    assert f"drift (trial 5): {DRIFT_MESSAGE}" in out
    assert f"noise event: {NOISE_MESSAGE}" in out
    assert "best: val_bpb 2.5431 ± 0.0023 (3) (trial 2" in out
    info = json.loads(cli(noisy, "status", "--json").output)
    assert info["noise"] == {"run_sd": NOISE["noise_sd"], "pair_sd": NOISE["noise_pair_sd"], "df": NOISE["noise_df"]}
    assert [e["message"] for e in info["drift"]] == [DRIFT_MESSAGE]


def test_report_shows_intervals_noise_drift_and_the_ablation(noisy, tmp_path):
    from autoloop.review.charts import Z95
    from autoloop.review.queries import best_trial
    from autoloop.store import Store

    out_dir = tmp_path / "r"
    cli(noisy, "report", "--out", str(out_dir))
    page = (out_dir / "report.html").read_text()
    kept_table = page.split('<table id="kept">')[1].split("</table>")[0]
    assert "2.6000 ± 0.0029 (3)" in kept_table and "2.5431 ± 0.0023 (3)" in kept_table
    ablation = page.split('<table id="ablation">')[1].split("</table>")[0]
    assert re.search(r'<tr data-trial="2"><td class="num">2</td><td>lr 0.02</td><td class="num">-0.0569</td>'
                     r'<td class="num">-0.0612..-0.0526</td><td class="num">3</td><td>helps</td>', ablation)
    assert "one run sd 0.0060, paired difference sd 0.0040 (8 df)" in page
    assert DRIFT_MESSAGE.replace("'", "&#x27;") in page.split('<table id="drift">')[1]

    # The chart: an error bar of ±1.96 se on each kept trial with several runs, on no other,
    # centred on its point and as long as its interval.
    store = Store(noisy / "experiments.db")
    try:
        run = store.get_run(NOISY_TAG)
        assert best_trial(store, run)["number"] == 2
    finally:
        store.close()
    bars = re.findall(r'<g class="errorbar"[^>]*><line x1="([\d.]+)" x2="[\d.]+" y1="([\d.]+)" y2="([\d.]+)"/>', page)
    kept = [t for t in trials(noisy) if t["status"] == "keep"]
    assert len(bars) == len(kept) == 2
    points = {int(n): (float(x), float(y)) for n, x, y in re.findall(
        r'class="point (?:keep|baseline)" (?:data-trial="(\d+)" )?cx="([\d.]+)" cy="([\d.]+)"', page) if n}
    diamond = re.search(r'class="point baseline" d="M([\d.]+),([\d.]+)', page)
    centres = [(float(diamond.group(1)), float(diamond.group(2)) + 7)] + [points[t["number"]] for t in kept[1:]]
    scale = []
    for (x, y1, y2), t, (cx, cy) in zip(bars, kept, centres):
        assert float(x) == pytest.approx(cx, abs=0.11) and (float(y1) + float(y2)) / 2 == pytest.approx(cy, abs=0.2)
        scale.append((float(y1) - float(y2)) / (2 * Z95 * t["metric_sd"]))  # pixels per bpb: the same for both
    assert scale[0] == pytest.approx(scale[1], rel=0.02)


def _noisy_report(noisy, tmp_path, name: str, change=None) -> str:
    """The noisy run's report, after `change(conn)` edited a copy of its db."""
    return noisy_report(noisy, tmp_path / name, tmp_path / f"{name}-report", change).read_text()


def _gain_card(page: str) -> str:
    return page.split('<div class="stat" data-key="relative_gain"')[1].split("</div></div>")[0]


def test_the_headline_gain_agrees_with_the_ablation(noisy, tmp_path):
    # The ablation found the one kept change helps: the gain is confirmed (green).
    page = _noisy_report(noisy, tmp_path, "helps")
    assert _gain_card(page).startswith(' data-state="confirmed"') and "every kept change helps" in _gain_card(page)
    # The same run, but the ablation found the change indistinguishable from zero: the
    # headline says so instead of claiming the gain in green above the ablation table.
    null = '{"effect": -0.001, "low": -0.02, "high": 0.018, "n": 3, "null": true, "drop": true, "level": 0.95}'
    page = _noisy_report(noisy, tmp_path, "null", lambda c: c.execute(
        "UPDATE trials SET decision = ? WHERE kind = 'ablation'", (null,)))
    card = _gain_card(page)
    assert card.startswith(' data-state="not confirmed"')
    assert "the ablation finds no kept change distinguishable from zero" in card
    assert "not distinguishable from zero: candidate to drop" in _section(page, "ablation")
    # No ablation at all: the gain as measured, not claimed as confirmed.
    page = _noisy_report(noisy, tmp_path, "none", lambda c: c.execute("DELETE FROM trials WHERE kind = 'ablation'"))
    assert _gain_card(page).startswith(' data-state="measured"') and "autoloop ablate" in _gain_card(page)


def test_no_drift_detected_is_said_only_when_a_drift_check_measured_it(noisy, tmp_path):
    def crashed(conn):
        conn.execute("UPDATE trials SET status = 'crash', metric = NULL, reason = 'RuntimeError: boom' "
                     "WHERE kind = 'drift'")
        conn.execute("DELETE FROM events WHERE kind = 'drift'")

    page = _noisy_report(noisy, tmp_path, "crashed", crashed)
    noise = page.split("<h2>Noise and drift</h2>")[1].split("<h2>")[0]
    assert "No drift detected" not in noise
    assert "the drift check of trial 5 crashed (RuntimeError: boom): drift was not measured then" in noise
    page = _noisy_report(noisy, tmp_path, "quiet", lambda c: c.execute("DELETE FROM events WHERE kind = 'drift'"))
    assert "No drift detected by the drift checks that ran" in page


def test_an_empty_kept_table_is_a_sentence_not_a_row(noisy, tmp_path):
    def nothing_kept(conn):
        conn.execute("UPDATE trials SET status = 'discard' WHERE number = 2")
        conn.execute("UPDATE runs SET best_commit = base_commit")

    page = _noisy_report(noisy, tmp_path, "flat", nothing_kept)
    assert '<table id="kept">' not in page
    assert "No change was kept: the best is still the baseline (trial 1, 2.6000)." in page
    assert _stats(page)["kept"] == "0" and _gain_card(page).startswith(' data-state="none"')


def test_gpu_hours_only_on_a_gpu(noisy, tmp_path):
    assert "CPU hours" in _noisy_report(noisy, tmp_path, "cpu") and "GPU hours" not in _noisy_report(noisy, tmp_path, "cpu2")
    page = _noisy_report(noisy, tmp_path, "gpu", lambda c: c.execute("UPDATE runs SET gpu = 'NVIDIA H100 80GB HBM3'"))
    assert "GPU hours" in page and "CPU hours" not in page
    # The machine has a GPU but its runs recorded the CPU as their device: CPU hours.
    page = _noisy_report(noisy, tmp_path, "gpu-idle", lambda c: (c.execute("UPDATE runs SET gpu = 'NVIDIA H100 80GB HBM3'"),
                                                                c.execute("UPDATE measurements SET device = 'cpu'")))
    assert "CPU hours" in page and "GPU hours" not in page


def test_the_discarded_card_is_the_charts_discarded_points(noisy, tmp_path):
    """The card counts discarded proposals, as the chart's legend and points do: the drift
    check and the ablation (also stored as `discard`) are counted apart."""
    page = _noisy_report(noisy, tmp_path, "cards")
    stats = _stats(page)
    assert stats["discarded"] == "3"  # trials 3, 4 and 6; not the drift check 5, not the ablation 7
    assert "discarded (3)" in page and len(re.findall(r'class="point discard(?: above)?" data-trial=', page)) == 3
    assert "proposals; also 1 drift check or re-run and 1 ablation" in page.split('<div class="stat" data-key="discarded"')[1].split(
        "</div></div>")[0]
    assert [int(n) for n in re.findall(r'<tr data-trial="(\d+)"', _section(page, "discarded"))] == [3, 4, 6]


def test_how_a_trial_reads_against_the_incumbent():
    from autoloop.decide.effects import comparison_text, format_estimate, sensitivity, trial_effect

    assert format_estimate(2.54312, 0.00401, 3) == "2.5431 ± 0.0040 (3)"
    assert format_estimate(2.54312, None, 1) == format_estimate(2.54312) == "2.543120"
    assert format_estimate(None, 0.1, 3) == "-"
    # A clearly worse discard: the interval excludes 0, whatever flag the controller stored with it.
    worse = trial_effect({"metric": 2.7, "n_runs": 1, "delta": 0.15, "decision": json.dumps(
        {"mean_diff": 0.15, "se": 0.01, "interval": [0.12, 0.18], "distinguishable": False, "near_miss": False})})
    assert worse.distinguishable is True and worse.diff == 0.15 and worse.se is None
    assert comparison_text(worse) == "+0.1500 ± 0.0100 vs the incumbent (95% CI +0.1200..+0.1800, 1 run)"
    # One pair before any noise was measured: no interval, the stored flag stands.
    early = trial_effect({"metric": 2.5, "n_runs": 1, "decision": {"mean_diff": -0.01, "distinguishable": False}})
    assert early.distinguishable is False and sensitivity(early) == 0.0
    near = trial_effect({"metric": 2.54, "metric_sd": 0.002, "n_runs": 4, "decision": {
        "mean_diff": -0.002, "se": 0.002, "low": -0.006, "high": 0.002, "near_miss": True}})
    assert (near.distinguishable, near.near_miss, near.se, near.n) == (False, True, 0.002, 4)
    assert comparison_text(near).endswith(": near miss, not distinguishable from the incumbent")
    # A trial from an old database: its delta, and no claim either way.
    old = trial_effect({"metric": 1.1, "best_before": 1.0, "delta": None})
    assert old.distinguishable is None and old.diff == pytest.approx(0.1) and comparison_text(old) == "+0.1000"
    assert sensitivity(old) == pytest.approx(0.1)


def test_the_report_says_what_the_curves_say(noisy, tmp_path):
    out_dir = tmp_path / "report-flags"
    result = runner.invoke(app, ["report", "--repo", str(noisy), "--tag", NOISY_TAG, "--out", str(out_dir)])
    assert result.exit_code == 0, result.output
    page = (out_dir / "report.html").read_text()
    assert "What the curves say" in page and "spent 40% of its budget before the first step" in page
