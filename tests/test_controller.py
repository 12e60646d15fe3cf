"""The loop core with the fake training script: statuses, git, db, stop conditions, bad input."""

from __future__ import annotations

import math
import subprocess
import time

import pytest

from autoloop.config import resolve
from autoloop.loop.controller import Controller
from autoloop.errors import AutoloopError
from autoloop.gitops import GitRepo
from autoloop.proposers.seeding import seed_idea
from autoloop.base.processes import process_group_alive
from autoloop.store import Store


# The loop's mechanics (git, db, processes, recovery), one training run per trial.
pytestmark = pytest.mark.usefixtures("one_run_per_trial")



def run_loop(repo, **flags):
    flags.setdefault("tag", "t")
    flags.setdefault("time_budget", 5)
    flags.setdefault("grace_seconds", 20)
    flags.setdefault("proposers", "ideas")
    config = resolve(repo, flags)
    return Controller(config, repo, verifier=None).run()


def seed(repo, text, *sets, patch=None, priority=0):
    return seed_idea(resolve(repo, {}), repo, text, sets=list(sets), patch=patch, priority=priority)


def trials(repo, tag="t"):
    store = Store(repo / "experiments.db")
    try:
        return store.trials(store.get_run(tag)["id"])
    finally:
        store.close()


def git(repo, *args) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def assert_consistent(repo, tag="t"):
    """Branch on the db's best commit, clean worktree, every non-kept commit archived."""
    store = Store(repo / "experiments.db")
    try:
        run = store.get_run(tag)
        rows = store.trials(run["id"])
        assert store.integrity_check() == [] or store.integrity_check() == ["ok"]
    finally:
        store.close()
    gitrepo = GitRepo.open(repo)
    assert gitrepo.branch_commit(f"autoloop/{tag}") == run["best_commit"]
    assert gitrepo.current_branch() == f"autoloop/{tag}"
    assert not gitrepo.is_dirty()
    archived = gitrepo.archived(tag)
    for row in rows:
        assert row["status"] != "running"
        if row["trial_commit"] and row["status"] != "keep" and row["kind"] == "proposal":
            assert archived.get(row["number"]) == row["trial_commit"], row
    kept = [r for r in rows if r["status"] == "keep"]
    assert kept and kept[-1]["trial_commit"] == run["best_commit"]
    numbers = [r["number"] for r in rows]
    assert numbers == list(range(1, len(rows) + 1))
    return rows


def test_baseline_then_ideas_keep_discard_and_archive(fake_repo):
    seed(fake_repo, "lower lr", "LR=0.01")
    seed(fake_repo, "wider", "WIDTH=128")
    seed(fake_repo, "narrower and 2**5", "WIDTH=2**5")
    summary = run_loop(fake_repo)
    rows = assert_consistent(fake_repo)
    assert [(r["kind"], r["status"]) for r in rows] == [
        ("baseline", "keep"), ("proposal", "keep"), ("proposal", "discard"), ("proposal", "discard"),
    ]
    assert rows[1]["metric"] == pytest.approx(1.0) and rows[1]["delta"] < 0
    assert rows[1]["best_before"] == pytest.approx(rows[0]["metric"])
    assert summary.trials_run == 4 and summary.best_metric == pytest.approx(1.0)
    assert "no more proposals" in summary.stop_reason
    # Each trial's diff is recoverable: in the row and from git.
    for row in rows[1:]:
        assert row["diff"] == GitRepo.open(fake_repo).diff(row["parent_commit"], row["trial_commit"])
        changed = [l for l in row["diff"].splitlines() if l.startswith(("+", "-")) and not l.startswith(("+++", "---"))]
        assert len(changed) == 2  # a one-line change
    assert "WIDTH = 2**5" in git(fake_repo, "show", "refs/autoloop/t/trials/4:train.py")
    assert "LR = 0.01" in (fake_repo / "train.py").read_text()
    store = Store(fake_repo / "experiments.db")
    assert [i["status"] for i in store.ideas()] == ["done", "done", "done"]
    assert store.curve(rows[0]["id"])  # the result's curve is stored
    store.close()


@pytest.mark.parametrize(
    "mode, status, reason",
    [
        ("'crash'", "crash", "RuntimeError: CUDA error: an illegal memory access"),
        ("'fail'", "crash", "FAIL: loss is nan"),
        ("'nan'", "crash", "nan"),
        ("'nometric'", "crash", "without a val_bpb"),
        ("'hang'", "timeout", ""),
        ("'stubborn_child'", "timeout", ""),
    ],
)
def test_misbehaving_scripts_get_the_right_status_and_leave_no_process(fake_repo, mode, status, reason):
    seed(fake_repo, f"mode {mode}", f"MODE={mode}")
    run_loop(fake_repo, time_budget=1, grace_seconds=2)
    rows = assert_consistent(fake_repo)
    row = rows[-1]
    assert row["status"] == status, row
    assert reason in (row["reason"] or "")
    if row["pgid"]:
        assert not process_group_alive(row["pgid"])
    assert rows[0]["status"] == "keep"


def test_reported_only_metric_is_not_compared_with_harness_best(fake_repo):
    seed(fake_repo, "summary only, and better", "MODE='reported'", "LR=0.01")
    run_loop(fake_repo)
    row = assert_consistent(fake_repo)[-1]
    assert row["metric_source"] == "reported" and row["status"] == "invalid"
    assert "cannot be checked" in row["reason"]


def test_third_party_script_runs_on_reported_metrics(tmp_path):
    from conftest import FAKE_TRAIN, make_repo

    source = FAKE_TRAIN.read_text().replace('MODE = "ok"', 'MODE = "reported"')
    repo = make_repo(tmp_path / "third", source)
    seed(repo, "lower lr", "LR=0.01")
    run_loop(repo)
    rows = assert_consistent(repo)
    assert [r["status"] for r in rows] == ["keep", "keep"]
    assert {r["metric_source"] for r in rows} == {"reported"}


def test_invalid_proposals_commit_nothing(fake_repo):
    seed(fake_repo, "syntax error", "LR=0.01")
    store = Store(fake_repo / "experiments.db")
    # Ideas stored directly, as a proposer could produce them: a patch to a protected
    # file, a patch that does not apply, a syntax error.
    protected = "--- a/pyproject.toml\n+++ b/pyproject.toml\n@@ -0,0 +1 @@\n+x\n"
    (fake_repo / "pyproject.toml").write_text("")
    git(fake_repo, "add", "pyproject.toml")
    git(fake_repo, "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qm", "pyproject")
    store.add_idea("touch protected", patch=protected.replace("@@ -0,0 +1 @@", "@@ -0,0 +1 @@"))
    store.add_idea("stale patch", patch="--- a/train.py\n+++ b/train.py\n@@ -1,1 +1,1 @@\n-no such line\n+x\n")
    store.add_idea("broken python", sets={"LR": "0.01 +"})
    store.close()
    before = git(fake_repo, "rev-list", "--all", "--count")
    run_loop(fake_repo)
    rows = assert_consistent(fake_repo)
    by_desc = {r["description"]: r for r in rows}
    assert by_desc["touch protected"]["status"] == "invalid"
    assert "protected file pyproject.toml" in by_desc["touch protected"]["reason"]
    assert by_desc["stale patch"]["status"] == "invalid"
    assert "does not apply" in by_desc["stale patch"]["reason"]
    assert by_desc["broken python"]["status"] == "invalid"
    for row in (by_desc["touch protected"], by_desc["stale patch"], by_desc["broken python"]):
        assert row["trial_commit"] is None
    # Only the valid proposal added a commit (plus the pyproject commit made above).
    assert int(git(fake_repo, "rev-list", "--all", "--count")) == int(before) + 1


def unified_diff(old: str, new: str, path: str = "train.py") -> str:
    import difflib

    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}"))


def test_syntax_error_proposal_is_invalid(fake_repo):
    source = (fake_repo / "train.py").read_text()
    patch = unified_diff(source, source.replace("LR = 0.02", "LR = = 0.02"))
    store = Store(fake_repo / "experiments.db")
    store.add_idea("typo", patch=patch)
    store.close()
    run_loop(fake_repo)
    row = assert_consistent(fake_repo)[-1]
    lineno = source.splitlines().index(next(l for l in source.splitlines() if l.startswith("LR = 0.02"))) + 1
    assert row["status"] == "invalid" and row["reason"].startswith(f"syntax error in train.py line {lineno}")


def test_max_trials_and_resume_continue_numbering(fake_repo):
    for value in ("0.015", "0.012", "0.011"):
        seed(fake_repo, f"lr {value}", f"LR={value}")
    summary = run_loop(fake_repo, max_trials=2)
    assert summary.trials_run == 2 and "max-trials" in summary.stop_reason
    run_loop(fake_repo)
    rows = assert_consistent(fake_repo)
    assert [r["number"] for r in rows] == [1, 2, 3, 4]
    assert [r["kind"] for r in rows].count("baseline") == 1


def test_stop_request_from_another_process_stops_after_current_trial(fake_repo):
    for value in ("0.015", "0.012", "0.011", "0.0105"):
        seed(fake_repo, f"lr {value}", f"LR={value}", "SLEEP=1.0")
    proc = subprocess.Popen(
        ["autoloop", "run", "--no-verify", "--proposers", "ideas", "--tag", "t", "--time-budget", "5"], cwd=fake_repo,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.time() + 60
    while time.time() < deadline:
        if (fake_repo / "experiments.db").exists():
            store = Store(fake_repo / "experiments.db")
            run = store.get_run("t")
            n = len(store.trials(run["id"])) if run else 0
            store.close()
            if n >= 2:
                break
        time.sleep(0.2)
    out = subprocess.run(["autoloop", "stop", "--tag", "t"], cwd=fake_repo, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    assert "stopped by `autoloop stop`" in output
    rows = assert_consistent(fake_repo)
    assert len(rows) < 5


def test_ctrl_c_kills_the_trial_resets_and_exits_zero(fake_repo):
    seed(fake_repo, "slow one", "SLEEP=30", "LR=0.01")
    proc = subprocess.Popen(
        ["autoloop", "run", "--no-verify", "--proposers", "ideas", "--tag", "t", "--time-budget", "60"], cwd=fake_repo,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.time() + 60
    pgid = None
    while time.time() < deadline and pgid is None:
        time.sleep(0.2)
        if (fake_repo / "experiments.db").exists():
            store = Store(fake_repo / "experiments.db")
            run = store.get_run("t")
            rows = store.trials(run["id"]) if run else []
            store.close()
            if len(rows) == 2 and rows[1]["pgid"]:
                pgid = rows[1]["pgid"]
    assert pgid is not None
    proc.send_signal(2)  # SIGINT, as Ctrl-C
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    assert "interrupted" in output
    assert not process_group_alive(pgid)
    rows = assert_consistent(fake_repo)
    assert rows[1]["status"] == "interrupted"
    store = Store(fake_repo / "experiments.db")
    assert store.ideas()[0]["status"] == "pending"  # not evaluated: back in the queue
    store.close()


def test_circuit_breaker_reruns_incumbent_then_continues(fake_repo):
    for i in range(2):
        seed(fake_repo, f"crash {i}", "MODE='crash'", f"LR={0.03 + i / 100}")
    seed(fake_repo, "good", "LR=0.01")
    run_loop(fake_repo, max_consecutive_failures=2)
    rows = assert_consistent(fake_repo)
    assert [(r["kind"], r["status"]) for r in rows] == [
        ("baseline", "keep"), ("proposal", "crash"), ("proposal", "crash"), ("rerun", "discard"), ("proposal", "keep"),
    ]
    assert rows[3]["trial_commit"] == rows[0]["trial_commit"]


def test_circuit_breaker_pauses_when_incumbent_fails_too(fake_repo, monkeypatch):
    seed(fake_repo, "crash", "MODE='crash'")
    # The incumbent starts failing too: simulate a broken machine by a training command
    # that fails for everything after the baseline.
    marker = fake_repo / ".autoloop-broken"
    wrapper = fake_repo / "wrap.sh"
    wrapper.write_text(f'#!/bin/sh\nif [ -e {marker} ]; then echo "CUDA error: device busy" >&2; exit 1; fi\n'
                       f'touch {marker}\nexec python train.py\n')
    wrapper.chmod(0o755)
    git(fake_repo, "add", "wrap.sh")
    git(fake_repo, "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qm", "wrapper")
    summary = run_loop(fake_repo, max_consecutive_failures=1, train_command="sh wrap.sh")
    assert summary.paused and "incumbent itself failed" in summary.stop_reason
    store = Store(fake_repo / "experiments.db")
    run = store.get_run("t")
    assert run["status"] == "paused" and "device busy" in run["pause_reason"]
    store.close()


def test_baseline_failure_pauses_with_reason(tmp_path):
    from conftest import FAKE_TRAIN, make_repo

    repo = make_repo(tmp_path / "r", FAKE_TRAIN.read_text().replace('MODE = "ok"', 'MODE = "crash"'))
    summary = run_loop(repo)
    assert summary.paused and "baseline fails" in summary.stop_reason and "RuntimeError" in summary.stop_reason


def test_hours_limit_starts_no_trial_that_cannot_finish(fake_repo):
    seed(fake_repo, "lr", "LR=0.01")
    summary = run_loop(fake_repo, hours=0.0001, time_budget=30)
    assert summary.trials_run == 0 and "--hours" in summary.stop_reason


def test_dirty_tree_is_refused_and_nothing_is_recorded(fake_repo):
    (fake_repo / "train.py").write_text((fake_repo / "train.py").read_text() + "\n# local edit\n")
    with pytest.raises(AutoloopError, match="uncommitted changes to tracked files \\(train.py\\)"):
        run_loop(fake_repo)
    store = Store(fake_repo / "experiments.db")
    assert store.runs() == []
    store.close()


def test_missing_training_script_is_one_clear_line(fake_repo):
    with pytest.raises(AutoloopError, match="training script .*nope.py does not exist"):
        run_loop(fake_repo, train_command="python nope.py")


def test_one_running_loop_per_working_tree_whatever_the_tag(fake_repo):
    seed(fake_repo, "slow", "SLEEP=20", "LR=0.01")
    proc = subprocess.Popen(["autoloop", "run", "--no-verify", "--proposers", "ideas", "--tag", "t"], cwd=fake_repo,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and len(trials_or_empty(fake_repo)) < 2:
            time.sleep(0.2)
        for tag in ("t", "other"):  # the same run, and a second run in the same folder
            with pytest.raises(AutoloopError) as caught:
                run_loop(fake_repo, tag=tag)
            message = str(caught.value)
            assert "\n" not in message
            assert f"run 't' (pid {proc.pid}," in message and "`autoloop status`" in message, message
        out = subprocess.run(["autoloop", "run", "--tag", "other", "--proposers", "ideas"], cwd=fake_repo,
                             capture_output=True, text=True)
        assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert f"run 't' (pid {proc.pid}," in out.stderr
        status = subprocess.run(["autoloop", "status"], cwd=fake_repo, capture_output=True, text=True)
        assert f"controller: pid {proc.pid} runs 't' in this working tree" in status.stdout, status.stdout
    finally:
        proc.send_signal(2)
        proc.wait(timeout=60)
    assert_consistent(fake_repo)
    # Nothing of the refused runs was recorded, and the lock is free again.
    with Store(fake_repo / "experiments.db") as store:
        assert [r["tag"] for r in store.runs()] == ["t"]
    status = subprocess.run(["autoloop", "status"], cwd=fake_repo, capture_output=True, text=True)
    assert "controller:" not in status.stdout and "nothing running" in status.stdout


def test_a_new_tag_after_a_run_ended_continues_from_its_best(fake_repo):
    seed(fake_repo, "better lr", "LR=0.01")
    run_loop(fake_repo, tag="night1")
    best = trials(fake_repo, "night1")[-1]
    assert best["status"] == "keep"
    run_loop(fake_repo, tag="night2", max_trials=1)
    with Store(fake_repo / "experiments.db") as store:
        assert store.get_run("night2")["base_commit"] == best["trial_commit"]
    assert trials(fake_repo, "night2")[0]["metric"] == pytest.approx(best["metric"])


def test_db_from_a_newer_schema_is_refused(fake_repo):
    run_loop(fake_repo, max_trials=1)
    import sqlite3

    conn = sqlite3.connect(fake_repo / "experiments.db")
    conn.execute("INSERT INTO _migrations (name, applied_at) VALUES ('9999_from_the_future', 'x')")
    conn.commit()
    conn.close()
    with pytest.raises(AutoloopError, match="newer autoloop"):
        run_loop(fake_repo)
    conn = sqlite3.connect(fake_repo / "experiments.db")
    assert conn.execute("SELECT COUNT(*) FROM trials").fetchone()[0] == 1  # nothing lost
    conn.close()


def test_environment_change_is_refused_unless_allowed(fake_repo):
    run_loop(fake_repo, max_trials=1)
    import sqlite3

    conn = sqlite3.connect(fake_repo / "experiments.db")
    conn.execute("UPDATE runs SET torch_version = '2.5.0'")
    conn.commit()
    conn.close()
    with pytest.raises(AutoloopError, match="different environment .*torch_version '2.5.0'.*--allow-env-change"):
        run_loop(fake_repo)
    seed(fake_repo, "lr", "LR=0.01")
    run_loop(fake_repo, allow_env_change=True)
    store = Store(fake_repo / "experiments.db")
    run = store.get_run("t")
    assert run["env_changes"] and run["env_changes"][0]["changes"]["torch_version"][0] == "2.5.0"
    assert any(e["kind"] == "env_change" for e in store.events(run["id"]))
    store.close()


def test_seed_rejects_unknown_constant_and_bad_patch(fake_repo, tmp_path):
    with pytest.raises(AutoloopError, match="no UPPER_CASE constant NOPE: did you mean NOISE?"):
        seed(fake_repo, "x", "NOPE=1")
    with pytest.raises(AutoloopError, match="is not NAME=VALUE"):
        seed(fake_repo, "x", "LR")
    bad = tmp_path / "bad.diff"
    bad.write_text("this is not a diff\n")
    with pytest.raises(AutoloopError, match="is not a usable diff"):
        seed(fake_repo, "x", patch=bad)


def test_ideas_seeded_during_a_run_are_picked_up(fake_repo):
    seed(fake_repo, "slow first", "SLEEP=2", "LR=0.015")
    proc = subprocess.Popen(["autoloop", "run", "--no-verify", "--proposers", "ideas", "--tag", "t"], cwd=fake_repo,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        time.sleep(0.2)
        if (fake_repo / "experiments.db").exists() and len(trials_or_empty(fake_repo)) >= 2:
            break
    seed(fake_repo, "seeded mid-run", "LR=0.01")
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    rows = assert_consistent(fake_repo)
    assert rows[-1]["description"] == "seeded mid-run" and rows[-1]["status"] == "keep"


def trials_or_empty(repo):
    if not (repo / "experiments.db").exists():
        return []
    store = Store(repo / "experiments.db")
    try:
        run = store.get_run("t")
        return store.trials(run["id"]) if run else []
    finally:
        store.close()


def test_readers_in_other_processes_never_see_database_locked(fake_repo):
    for i in range(6):
        seed(fake_repo, f"lr {i}", f"LR={0.011 + i / 1000}")
    reader = subprocess.Popen(
        ["python", "-c", (
            "import subprocess, time, sys\n"
            "end = time.time() + 8\n"
            "bad = 0\n"
            "while time.time() < end:\n"
            "    for cmd in (['autoloop', 'log', '--json'], ['autoloop', 'status']):\n"
            "        out = subprocess.run(cmd, capture_output=True, text=True)\n"
            "        if 'locked' in out.stderr or 'locked' in out.stdout: bad += 1; print(out.stderr)\n"
            "print('BAD', bad)\n"
        )],
        cwd=fake_repo, stdout=subprocess.PIPE, text=True,
    )
    time.sleep(0.5)
    run_loop(fake_repo)
    output, _ = reader.communicate(timeout=60)
    assert "BAD 0" in output, output


# ---------------------------------------------------------------------- issue 11: edges


def _binary_patch_to_latin1(repo) -> str:
    """An agent-style `git diff --binary` that leaves train.py as latin-1 bytes (not UTF-8)."""
    source = (repo / "train.py").read_bytes()
    (repo / "train.py").write_bytes(source.replace(b"# learning rate", b"# taux d'apprentissage \xe9"))
    git(repo, "add", "train.py")
    (repo / ".gitattributes").write_text("train.py binary\n")
    patch = subprocess.run(["git", "diff", "--cached", "--binary"], cwd=repo, check=True, capture_output=True).stdout
    git(repo, "reset", "-q", "--hard")
    (repo / ".gitattributes").unlink()
    return patch.decode("ascii")


def test_a_proposal_that_cannot_be_applied_for_any_reason_is_invalid_not_a_crash(fake_repo):
    source = (fake_repo / "train.py").read_text()
    latin1 = unified_diff(source, source.replace("# learning rate", "# taux d'apprentissage é")).encode("latin-1")
    store = Store(fake_repo / "experiments.db")
    store.add_idea("latin-1 patch", patch=latin1)  # stored as a BLOB, read back as bytes
    store.add_idea("binary diff", patch=_binary_patch_to_latin1(fake_repo))
    store.close()
    seed(fake_repo, "a good one", "LR=0.01", priority=-1)

    class Weird:  # a value the constants editor cannot write
        def __repr__(self):
            raise RuntimeError("no repr")

    class OddProposer:  # a proposer whose edit raises something unforeseen in materialize
        name = "odd"
        done = False

        def propose(self, ctx):
            if OddProposer.done:
                return None
            OddProposer.done = True
            return Proposal("odd value", [Edit("train.py", sets={"LR": Weird()})])

    from autoloop.config import resolve as resolve_config
    from autoloop.proposers.base import ProposerChain
    from autoloop.proposers.proposal import Edit, Proposal
    from autoloop.proposers.seeded import IdeasProposer

    config = resolve_config(fake_repo, {"tag": "t", "time_budget": 5, "grace_seconds": 20})
    chain = ProposerChain([IdeasProposer(config), OddProposer()])
    summary = Controller(config, fake_repo, verifier=None, chain=chain).run()
    rows = assert_consistent(fake_repo)
    by_desc = {r["description"]: r for r in rows}
    for name in ("latin-1 patch", "binary diff", "odd value"):
        row = by_desc[name]
        assert row["status"] == "invalid" and row["trial_commit"] is None, row
        assert "\n" not in row["reason"]
    assert "not be UTF-8" in by_desc["latin-1 patch"]["reason"] and "train.py" in by_desc["latin-1 patch"]["reason"]
    assert "not be UTF-8" in by_desc["binary diff"]["reason"]
    assert "RuntimeError: no repr" in by_desc["odd value"]["reason"]
    assert by_desc["a good one"]["status"] == "keep"
    assert "no more proposals" in summary.stop_reason


def test_a_project_in_a_subfolder_edits_trains_and_records_there(tmp_path):
    from conftest import FAKE_TRAIN, make_repo

    fake = FAKE_TRAIN.read_text()
    top = make_repo(tmp_path / "big", fake.replace("LR = 0.02", "LR = 0.5"), {"sub/train.py": fake})
    sub = top / "sub"
    seed(sub, "lower lr", "LR=0.01")
    source = (sub / "train.py").read_text()
    seed_patch = tmp_path / "wider.patch"
    seed_patch.write_text(unified_diff(source, source.replace("WIDTH = 64", "WIDTH = 128")))
    seed(sub, "wider (a patch)", patch=seed_patch, priority=1)
    # `git diff` run in sub/ names the file sub/train.py, relative to the top: applies too.
    (sub / "train.py").write_text(source.replace("SLEEP = 0.0", "SLEEP = 0.01"))
    top_patch = tmp_path / "sleep.patch"
    top_patch.write_bytes(subprocess.run(["git", "diff"], cwd=sub, check=True, capture_output=True).stdout)
    git(sub, "checkout", "train.py")
    assert "+++ b/sub/train.py" in top_patch.read_text()
    seed(sub, "sleep (git diff)", patch=top_patch, priority=2)
    run_loop(sub)
    rows = assert_consistent(sub)
    assert [(r["description"], r["status"]) for r in rows[1:]] == [
        ("sleep (git diff)", "discard"), ("wider (a patch)", "discard"), ("lower lr", "keep")]
    baseline = 1.0 + (math.log10(0.02) + 2) ** 2
    assert rows[0]["metric"] == pytest.approx(baseline)  # sub/train.py trained, not ../train.py
    assert rows[1]["metric"] == pytest.approx(baseline)
    assert rows[2]["metric"] == pytest.approx(baseline + 0.1)  # and it trained the edits
    assert rows[3]["metric"] == pytest.approx(1.0)
    for row in rows[1:]:
        assert git(top, "diff", "--name-only", row["parent_commit"], row["trial_commit"]) == "sub/train.py"
        assert row["diff"].startswith("diff --git a/train.py b/train.py")  # paths as in the project folder
    assert git(top, "show", f"{rows[3]['trial_commit']}:train.py") == (top / "train.py").read_text().rstrip("\n")
    assert "LR = 0.01" in (sub / "train.py").read_text() and "LR = 0.5" in (top / "train.py").read_text()
    assert (sub / ".autoloop" / "t" / "trials" / "2" / "runs" / "1" / "train.log").exists() and (sub / "experiments.db").exists()
    assert not (top / ".autoloop").exists() and not (top / "experiments.db").exists()
    assert git(top, "status", "--porcelain", "--untracked-files=all") == ""


def test_a_train_script_outside_the_project_folder_is_refused_in_one_line(tmp_path):
    from conftest import FAKE_TRAIN, make_repo

    top = make_repo(tmp_path / "big", FAKE_TRAIN.read_text(), {"sub/README": "x\n"})
    with pytest.raises(AutoloopError) as caught:
        run_loop(top / "sub", train_command="python ../train.py")
    assert "\n" not in str(caught.value) and "outside the project folder" in str(caught.value)
