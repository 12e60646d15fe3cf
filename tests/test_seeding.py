"""`autoloop seed` checks an idea when it is seeded, with the controller's own rules,
against the current best commit: a bad idea fails now, in one line, not at 3 a.m.

Real git repositories and SQLite files in tmp_path; the CLI through typer's CliRunner.
"""

from __future__ import annotations

import difflib
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autoloop.cli import app
from autoloop.config import resolve
from autoloop.errors import AutoloopError
from autoloop.proposers.seeding import MAX_PATCH_BYTES, seed_idea
from autoloop.store import Store
from conftest import FAKE_TRAIN, make_repo

runner = CliRunner()
GIT_ID = ["-c", "user.name=t", "-c", "user.email=t@example.com"]


def seed(repo, text="idea", *sets, patch=None, tag=None):
    return seed_idea(resolve(repo, {}), repo, text, sets=list(sets), patch=patch, tag=tag)


def cli_seed(repo, *args):
    return runner.invoke(app, ["seed", "--repo", str(repo), *args])


def git(repo, *args) -> str:
    return subprocess.run(["git", *GIT_ID, *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def ideas(repo) -> list[dict]:
    db = repo / "experiments.db"
    if not db.exists():
        return []
    with Store(db) as store:
        return store.ideas()


def diff(old: str, new: str, path: str = "train.py") -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}"))


def new_file_diff(path: str) -> str:
    return f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n@@ -0,0 +1 @@\n+x = 1\n"


def write_patch(tmp_path: Path, text: str | bytes, name: str = "idea.diff") -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def assert_refused(repo, args: list[str], *fragments: str) -> str:
    """The CLI refuses in exactly one line, exit 1, no traceback, nothing stored."""
    before = len(ideas(repo))
    result = cli_seed(repo, *args)
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.output
    assert len(ideas(repo)) == before
    return lines[0]


# ---------------------------------------------------------------------------- patches


@pytest.mark.parametrize("path, fragment", [
    ("../outside.py", "invalid path '../outside.py'"),
    (".git/hooks/pre-commit", ".git/hooks/pre-commit"),
    ("autoloop/harness/evaluate.py", "protected file autoloop/harness/evaluate.py"),
    ("notes.py", "not editable"),
])
def test_a_patch_to_a_file_proposals_may_not_change_is_refused(fake_repo, tmp_path, path, fragment):
    patch = write_patch(tmp_path, new_file_diff(path))
    assert_refused(fake_repo, ["x", "--patch", str(patch)], fragment)
    assert not (fake_repo / ".git" / "hooks" / "pre-commit").exists()
    assert not (tmp_path / "outside.py").exists()


def test_a_patch_that_is_not_utf8_is_one_line(fake_repo, tmp_path):
    source = (fake_repo / "train.py").read_text()
    text = diff(source, source.replace("LR = 0.02", "LR = 0.01  # caf\xe9")).encode("latin-1")
    line = assert_refused(fake_repo, ["latin-1", "--patch", str(write_patch(tmp_path, text))], "not UTF-8")
    assert "byte 0xe9" in line


def test_a_patch_over_the_size_limit_is_refused_before_the_db_grows(fake_repo, tmp_path):
    source = (fake_repo / "train.py").read_text()
    filler = "".join(f"# {'x' * 70} {i}\n" for i in range(MAX_PATCH_BYTES // 70 + 10))
    patch = write_patch(tmp_path, diff(source, source + filler))
    assert patch.stat().st_size > MAX_PATCH_BYTES
    assert_refused(fake_repo, ["huge", "--patch", str(patch)], "1 MB", "MAX_PATCH_BYTES")
    assert not (fake_repo / "experiments.db").exists()


def test_a_patch_is_checked_against_the_current_best_not_head(fake_repo, tmp_path):
    """The run's best commit differs from HEAD: a patch made against HEAD's train.py that
    no longer applies to the best is refused; one made against the best is accepted."""
    head = git(fake_repo, "rev-parse", "HEAD")
    source = (fake_repo / "train.py").read_text()
    best_source = source.replace("LR = 0.02", "LR = 0.015")
    git(fake_repo, "checkout", "-qb", "autoloop/t")
    (fake_repo / "train.py").write_text(best_source)
    git(fake_repo, "commit", "-qam", "kept: lr 0.015")
    best = git(fake_repo, "rev-parse", "HEAD")
    git(fake_repo, "checkout", "-q", "main")
    with Store(fake_repo / "experiments.db") as store:
        store.create_run("t", base_commit=head, best_commit=best)
    stale = write_patch(tmp_path, diff(source, source.replace("LR = 0.02", "LR = 0.01")), "stale.diff")
    assert_refused(fake_repo, ["lr", "--patch", str(stale)], "does not apply", best[:7], "run 't'")
    fresh = write_patch(tmp_path, diff(best_source, best_source.replace("LR = 0.015", "LR = 0.01")), "fresh.diff")
    idea = seed(fake_repo, "lr from the best", patch=fresh)
    assert idea["patch"] == fresh.read_text()
    # --set is checked against the best too: LR=0.015 changes nothing there.
    assert_refused(fake_repo, ["same", "--set", "LR=0.015"], "changes nothing")


def test_the_tagged_run_is_the_one_checked(fake_repo, tmp_path):
    head = git(fake_repo, "rev-parse", "HEAD")
    source = (fake_repo / "train.py").read_text()
    git(fake_repo, "checkout", "-qb", "other")
    (fake_repo / "train.py").write_text(source.replace("WIDTH = 64", "WIDTH = 128"))
    git(fake_repo, "commit", "-qam", "wider")
    wider = git(fake_repo, "rev-parse", "HEAD")
    git(fake_repo, "checkout", "-q", "main")
    with Store(fake_repo / "experiments.db") as store:
        store.create_run("a", base_commit=head, best_commit=None)  # no baseline yet: its base commit
        store.create_run("b", base_commit=head, best_commit=wider)
    # The most recent run (b) has WIDTH=128; run a has WIDTH=64.
    assert_refused(fake_repo, ["w", "--set", "WIDTH=128"], "changes nothing")
    assert seed(fake_repo, "w", "WIDTH=128", tag="a")["sets"] == {"WIDTH": "128"}


def test_a_good_patch_is_stored_verbatim(fake_repo, tmp_path):
    source = (fake_repo / "train.py").read_text()
    patch = write_patch(tmp_path, diff(source, source.replace("LR = 0.02", "LR = 0.01")))
    result = cli_seed(fake_repo, "lower lr", "--patch", str(patch))
    assert result.exit_code == 0, result.output
    (idea,) = ideas(fake_repo)
    assert idea["patch"] == patch.read_text() and idea["text"] == "lower lr"


def test_a_patch_that_does_not_compile_is_refused(fake_repo, tmp_path):
    source = (fake_repo / "train.py").read_text()
    patch = write_patch(tmp_path, diff(source, source.replace("LR = 0.02", "LR = = 0.02")))
    assert_refused(fake_repo, ["typo", "--patch", str(patch)], "syntax error in train.py")


# ---------------------------------------------------------------------------- --set values


@pytest.mark.parametrize("pair, fragment", [
    ("LR=1e400", "not a finite number"),
    ("LR=float('nan')", "float"),
    ("LR=-1e999", "not a finite number"),
    ("WIDTH=2.5", "WIDTH is an int"),
    ("WIDTH=abc", "abc"),
    ("WIDTH=[1,2]", "WIDTH is an int"),
    ("WIDTH=True", "WIDTH is an int"),
    ("WIDTH='64'", "WIDTH is an int"),
    ("MODE=crash", "quote"),
    ("MODE=3", "MODE is a str"),
    ("LR='0.01'", "LR is a float"),
    ("WIDTH=(64", "not a Python value"),
])
def test_a_value_that_does_not_fit_the_constant_is_refused(fake_repo, pair, fragment):
    assert_refused(fake_repo, ["x", "--set", pair], fragment)


@pytest.mark.parametrize("pairs, stored", [
    (["LR=0.01"], {"LR": "0.01"}),
    (["LR=1"], {"LR": "1"}),  # an int is a fine float
    (["LR=3e-3"], {"LR": "3e-3"}),
    (["WIDTH=2**5"], {"WIDTH": "2**5"}),  # arithmetic of literals, as written
    (["MODE='crash'"], {"MODE": "'crash'"}),
    (["SLEEP=2", "LR=0.01"], {"SLEEP": "2", "LR": "0.01"}),
])
def test_a_value_that_fits_is_stored_as_typed(fake_repo, pairs, stored):
    assert seed(fake_repo, "ok", *pairs)["sets"] == stored


def test_a_value_may_name_another_constant(tmp_path):
    repo = make_repo(tmp_path / "r", FAKE_TRAIN.read_text().replace("SLEEP = 0.0", "SLEEP = 0.0\nBASE_LR = 0.01"))
    assert seed(repo, "lr from base", "LR=BASE_LR / 2")["sets"] == {"LR": "BASE_LR / 2"}


def test_the_value_check_reads_the_committed_best_not_the_worktree(fake_repo):
    # An uncommitted edit of train.py is not what the loop will train from.
    source = (fake_repo / "train.py").read_text()
    (fake_repo / "train.py").write_text(source.replace("WIDTH = 64", "WIDTH = 64.0"))
    assert_refused(fake_repo, ["x", "--set", "WIDTH=2.5"], "WIDTH is an int")


def test_an_accepted_idea_runs_as_a_valid_trial(fake_repo, tmp_path):
    """What seed accepts, the controller accepts: the same materialize and validate."""
    from autoloop.loop.controller import Controller

    source = (fake_repo / "train.py").read_text()
    # The patch's context includes the LR line, so it goes first (ideas are taken oldest first).
    seed(fake_repo, "wider by patch", patch=write_patch(tmp_path, diff(source, source.replace("WIDTH = 64", "WIDTH = 128"))))
    seed(fake_repo, "lr by constant", "LR=0.015")
    config = resolve(fake_repo, {"tag": "t", "time_budget": 5, "grace_seconds": 20, "proposers": "ideas", "max_trials": 3})
    Controller(config, fake_repo, verifier=None).run()
    with Store(fake_repo / "experiments.db") as store:
        rows = store.trials(store.get_run("t")["id"])
    assert [r["status"] for r in rows] == ["keep", "discard", "keep"], [r["reason"] for r in rows]


def test_missing_patch_and_empty_description_are_one_line(fake_repo, tmp_path):
    assert_refused(fake_repo, ["x", "--patch", str(tmp_path / "nope.diff")], "does not exist")
    assert_refused(fake_repo, ["  ", "--set", "LR=0.01"], "description")


def test_library_errors_are_autoloop_errors(fake_repo):
    with pytest.raises(AutoloopError, match="WIDTH is an int"):
        seed(fake_repo, "x", "WIDTH=2.5")


# ---------------------------------------------------------------------------- train.py's invariants

REAL_TRAIN = Path(__file__).resolve().parents[1] / "train.py"


@pytest.fixture
def real_repo(tmp_path) -> Path:
    """The real train.py (only read here: seeding never runs it)."""
    return make_repo(tmp_path / "real", REAL_TRAIN.read_text())


def test_a_set_that_breaks_an_assert_of_train_py_is_refused_naming_it(real_repo):
    # On a CPU train.py's CPU block has N_HEAD=1: 3 KV heads do not divide it.
    line = assert_refused(real_repo, ["gqa", "--set", "N_KV_HEAD=3"],
                          "asserts N_HEAD % N_KV_HEAD == 0", "N_HEAD must be a multiple of N_KV_HEAD",
                          "N_HEAD=1, N_KV_HEAD=3", "choose values")
    lineno = next(i for i, text in enumerate(REAL_TRAIN.read_text().splitlines(), 1) if "assert cfg[" in text)
    assert f"train.py line {lineno} asserts" in line
    assert_refused(real_repo, ["odd heads", "--set", "N_HEAD=3"], "MODEL_DIM must be a multiple of N_HEAD")


def test_values_that_keep_the_asserts_are_seeded(real_repo):
    assert seed(real_repo, "two query heads", "N_HEAD=2")["sets"] == {"N_HEAD": "2"}
    # Two constants changed together keep the rule that one of them alone would break.
    assert seed(real_repo, "more heads", "N_HEAD=8", "N_KV_HEAD=4")["sets"] == {"N_HEAD": "8", "N_KV_HEAD": "4"}


def test_an_assert_already_broken_at_the_base_does_not_block_other_ideas(tmp_path):
    source = ("A = 4\nB = 3\nLR = 0.1\n\ndef f(cfg, n):\n    assert cfg['a'] % cfg['b'] == 0\n    assert cfg['a'] > 0\n"
              "    assert n < A  # n is the run's: not an invariant of the constants\n\nCFG = dict(a=A, b=B)\n")
    repo = make_repo(tmp_path / "r", source)
    assert seed(repo, "lr", "LR=0.2")["sets"] == {"LR": "0.2"}
    assert_refused(repo, ["x", "--set", "A=-4"], "line 7 asserts A > 0", "A=-4")


# ---------------------------------------------------------------------------- the queue: listing, cancelling


def cli_ideas(repo, *args):
    return runner.invoke(app, ["ideas", "--repo", str(repo), *args])


def test_an_idea_with_a_patch_and_sets_is_listed_with_both(fake_repo, tmp_path):
    source = (fake_repo / "train.py").read_text()
    patch = write_patch(tmp_path, diff(source, source.replace("WIDTH = 64", "WIDTH = 128")))
    assert cli_seed(fake_repo, "wider, lower lr", "--patch", str(patch), "--set", "LR=0.01").exit_code == 0
    assert cli_seed(fake_repo, "only lr", "--set", "LR=0.03").exit_code == 0
    assert cli_seed(fake_repo, "only wider", "--patch", str(patch)).exit_code == 0
    listed = cli_ideas(fake_repo).output
    assert "wider, lower lr [patch, LR=0.01]" in listed, listed
    assert "only lr [LR=0.03]" in listed and "only wider [patch]" in listed


def test_a_cancelled_idea_stays_listed_and_is_never_proposed(fake_repo):
    from autoloop.proposers.seeded import IdeasProposer

    seed(fake_repo, "first", "LR=0.01")
    seed(fake_repo, "second", "LR=0.03")
    result = cli_ideas(fake_repo, "--cancel", "1")
    assert result.exit_code == 0 and result.output.strip() == "cancelled idea 1: first"
    listed = cli_ideas(fake_repo).output.splitlines()
    assert "cancelled" in next(line for line in listed if "first" in line)
    again = cli_ideas(fake_repo, "--cancel", "1")
    assert again.exit_code == 1 and again.output.strip() == "error: idea 1 cannot be cancelled: it is cancelled already"
    missing = cli_ideas(fake_repo, "--cancel", "7")
    assert missing.exit_code == 1 and len(missing.output.strip().splitlines()) == 1 and "no idea 7" in missing.output
    # The ideas proposer, as the loop asks it, takes the second and then nothing.
    with Store(fake_repo / "experiments.db") as store:
        run = store.create_run("t", base_commit=git(fake_repo, "rev-parse", "HEAD"))
        ctx = type("Ctx", (), {"store": store, "run": run})()
        proposer = IdeasProposer(resolve(fake_repo, {}))
        assert proposer.propose(ctx).description == "second"
        assert proposer.propose(ctx) is None
        assert [i["status"] for i in store.ideas()] == ["cancelled", "taken"]


def test_an_idea_the_same_as_one_still_queued_is_not_queued_twice(fake_repo):
    seed(fake_repo, "lower lr", "LR=0.01")
    line = assert_refused(fake_repo, ["the same, in other words", "--set", "LR=0.01"],
                          "idea 1 is the same edit and still queued ('lower lr')", "not queued twice",
                          "autoloop ideas --cancel 1")
    assert line.startswith("error: ")
    seed(fake_repo, "lower lr and more", "LR=0.01", "SLEEP=0.1")  # another edit: queued
    seed(fake_repo, "try SwiGLU in the MLP")
    assert_refused(fake_repo, ["try  SwiGLU in the MLP "], "idea 3 is the same text and still queued")
    # Once the first is no longer queued (cancelled here; tried works the same), it may be seeded again.
    assert cli_ideas(fake_repo, "--cancel", "1").exit_code == 0
    assert seed(fake_repo, "lower lr", "LR=0.01")["id"] == 4
    with Store(fake_repo / "experiments.db") as store:
        store.set_idea_status(4, "done")
    assert seed(fake_repo, "lower lr", "LR=0.01")["id"] == 5


def test_an_idea_seeded_for_a_run_not_started_yet_waits_for_it(fake_repo):
    """`seed --tag T` before `run --tag T`: queued for T alone, checked against HEAD (where
    T will start), and given to T when it is created."""
    from autoloop.loop.controller import Controller
    from autoloop.proposers.seeded import IdeasProposer

    result = cli_seed(fake_repo, "lower lr for tonight", "--set", "LR=0.01", "--tag", "tonight")
    assert result.exit_code == 0, result.output
    assert "run 'tonight' is not started yet: the idea waits for `autoloop run --tag tonight`" in result.output
    assert "waits for run 'tonight'" in cli_ideas(fake_repo).output
    assert_refused(fake_repo, ["same for tonight", "--set", "LR=0.02", "--tag", "tonight", "--set", "LR=0.02x"],
                   "LR=0.02x")  # still checked now, against HEAD
    head = git(fake_repo, "rev-parse", "HEAD")
    with Store(fake_repo / "experiments.db") as store:
        other = store.create_run("other", base_commit=head, best_commit=head)
        assert store.next_idea(other["id"]) is None  # another run never takes it
        assert store.ideas(other["id"]) == []
    controller = Controller(resolve(fake_repo, {"tag": "tonight", "proposers": "ideas"}), fake_repo, verifier=None)
    controller.open()  # creates the run, as `autoloop run --tag tonight` does first
    try:
        run = controller.run_row
        assert [i["id"] for i in controller.store.ideas(run["id"])] == [1]
        ctx = type("Ctx", (), {"store": controller.store, "run": run})()
        assert IdeasProposer(controller.config).propose(ctx).description == "lower lr for tonight"
        (idea,) = controller.store.ideas()
        assert (idea["run_id"], idea["status"]) == (run["id"], "taken")
    finally:
        controller.close()


def test_an_assert_too_big_to_read_is_left_alone_and_the_others_still_hold():
    """The asserts are a trial's code: one past pyconst's caps (here 1,200 nodes) is
    skipped, never walked recursively, and the readable ones are still checked."""
    from autoloop.invariants import broken_by, invariants

    source = ("A = 4\nB = 2\n\ndef f():\n    assert A % B == 0\n    assert A + " + "+".join(["B"] * 600) + " > 0\n")
    assert [i.text for i in invariants(source)] == ["A % B == 0"]
    (problem,) = broken_by(source, source.replace("B = 2", "B = 3"))
    assert problem.describe() == "train.py line 5 asserts A % B == 0 (A must be a multiple of B), and with A=4, B=3 it does not hold"
