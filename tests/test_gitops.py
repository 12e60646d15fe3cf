"""Tests for autoloop.gitops on real repositories made in tmp_path."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from autoloop.errors import AutoloopError
from autoloop.gitops import GitRepo

TRAIN_PY = "LR = 0.001  # learning rate\nprint('training')\n"


def git(cwd: Path, *args: str, env: dict | None = None) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True, env=env
    ).stdout.strip()


def make_repo(path: Path, env: dict | None = None, identity: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q", "-b", "main", env=env)
    if identity:
        git(path, "config", "user.name", "Test User", env=env)
        git(path, "config", "user.email", "test@example.com", env=env)
    (path / "train.py").write_text(TRAIN_PY)
    (path / "run.sh").write_text("#!/bin/sh\npython train.py\n")
    (path / "run.sh").chmod(0o755)
    (path / ".gitignore").write_text(".autoloop/\nexperiments.db\n")
    git(path, "add", "-A", env=env)
    commit_env = env
    if not identity:
        # The initial commit is the user's; only autoloop's own commits must work without one.
        commit_env = {**(env or os.environ), "GIT_AUTHOR_NAME": "u", "GIT_AUTHOR_EMAIL": "u@x",
                      "GIT_COMMITTER_NAME": "u", "GIT_COMMITTER_EMAIL": "u@x"}
    git(path, "commit", "-q", "-m", "init", env=commit_env)
    return path


@pytest.fixture
def repo_dir(tmp_path: Path) -> Path:
    return make_repo(tmp_path / "project")


@pytest.fixture
def repo(repo_dir: Path) -> GitRepo:
    return GitRepo.open(repo_dir)


def test_open_refuses_a_non_repository(tmp_path: Path):
    with pytest.raises(AutoloopError, match=r"is not a git repository: run `git init && git add -A"):
        GitRepo.open(tmp_path)


def test_ensure_branch_creates_then_resumes(repo: GitRepo, repo_dir: Path):
    head = repo.head()
    branch, base, created = repo.ensure_branch("t1")
    assert (branch, base, created) == ("autoloop/t1", head, True)
    assert repo.current_branch() == "autoloop/t1"
    child = repo.commit_files(head, {"train.py": "LR = 0.002\n"}, "trial 1")
    repo.checkout_commit(branch, child)
    git(repo_dir, "checkout", "-q", "main")
    branch, base, created = repo.ensure_branch("t1")
    assert (branch, base, created) == ("autoloop/t1", head, False)
    assert repo.current_branch() == "autoloop/t1"
    assert repo.branch_commit("autoloop/t1") == child
    assert repo.branch_commit("autoloop/none") is None
    with pytest.raises(AutoloopError, match="invalid tag"):
        repo.ensure_branch("../evil")


def test_dirty_tracked_tree_is_refused(repo: GitRepo, repo_dir: Path):
    (repo_dir / "notes.txt").write_text("untracked is fine\n")
    assert not repo.is_dirty()
    (repo_dir / "train.py").write_text("LR = 0.5\n")
    assert repo.dirty_files() == ["train.py"]
    with pytest.raises(AutoloopError, match=r"uncommitted changes to tracked files \(train.py\): commit them or `git stash`"):
        repo.ensure_branch("t1")
    assert repo.current_branch() == "main"


def test_commit_through_index_touches_nothing_until_checkout(repo: GitRepo, repo_dir: Path):
    branch, base, _ = repo.ensure_branch("t1")
    index_before = (repo_dir / ".git" / "index").read_bytes()
    sha = repo.commit_files(
        base,
        {"train.py": "LR = 0.002  # learning rate\nprint('training')\n", "model_utils.py": b"X = 1\n", "run.sh": None},
        "trial 1: raise LR",
    )
    # Worktree, index and branch are exactly as before.
    assert (repo_dir / "train.py").read_text() == TRAIN_PY
    assert not (repo_dir / "model_utils.py").exists()
    assert (repo_dir / "run.sh").exists()
    assert (repo_dir / ".git" / "index").read_bytes() == index_before
    assert repo.branch_commit(branch) == base
    assert not repo.is_dirty()
    # The commit itself is right.
    assert repo.commit_exists(sha) and repo.is_ancestor(base, sha) and not repo.is_ancestor(sha, base)
    assert git(repo_dir, "log", "-1", "--format=%s|%an", sha) == "trial 1: raise LR|Test User"
    assert repo.show_file(sha, "train.py").startswith("LR = 0.002")
    assert sorted(repo.changed_paths(base, sha)) == ["model_utils.py", "run.sh", "train.py"]
    # Checkout makes the worktree match.
    repo.checkout_commit(branch, sha)
    assert repo.head() == sha and repo.branch_commit(branch) == sha
    assert (repo_dir / "train.py").read_text().startswith("LR = 0.002")
    assert (repo_dir / "model_utils.py").read_text() == "X = 1\n"
    assert not (repo_dir / "run.sh").exists()
    assert not repo.is_dirty()
    # ...and back to the best: the added file is gone again, modes are kept.
    repo.checkout_commit(branch, base)
    assert (repo_dir / "train.py").read_text() == TRAIN_PY
    assert not (repo_dir / "model_utils.py").exists()
    assert os.access(repo_dir / "run.sh", os.X_OK)


def test_modes_are_preserved_for_edited_files(repo: GitRepo, repo_dir: Path):
    sha = repo.commit_files(repo.head(), {"run.sh": "#!/bin/sh\necho hi\n"}, "edit script")
    assert git(repo_dir, "ls-tree", sha, "run.sh").split()[0] == "100755"


def test_archive_survives_gc_and_keeps_the_diff(repo: GitRepo, repo_dir: Path):
    branch, base, _ = repo.ensure_branch("t1")
    sha = repo.commit_files(base, {"train.py": "LR = 0.1\n"}, "trial 2")
    repo.checkout_commit(branch, sha)
    diff = repo.diff(base, sha)
    repo.archive("t1", 2, sha)
    repo.checkout_commit(branch, base)  # discard: reset to best
    git(repo_dir, "reflog", "expire", "--expire=now", "--all")
    git(repo_dir, "gc", "-q", "--prune=now")
    assert repo.archived("t1") == {2: sha}
    assert repo.commit_exists(sha)
    assert repo.diff(base, sha) == diff
    assert "-LR = 0.001  # learning rate" in diff and "+LR = 0.1" in diff and diff.endswith("\n")
    # The diff re-applies cleanly on the parent.
    (repo_dir / "trial.patch").write_text(diff)
    git(repo_dir, "apply", "--check", "trial.patch")
    assert repo.archived("other") == {}


def test_commits_without_a_configured_identity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    for role in ("AUTHOR", "COMMITTER"):
        for field in ("NAME", "EMAIL"):
            monkeypatch.delenv(f"GIT_{role}_{field}", raising=False)
    monkeypatch.setenv("EMAIL", "")  # git also falls back to $EMAIL
    repo_dir = make_repo(tmp_path / "bare-identity", env=dict(os.environ), identity=False)
    repo = GitRepo.open(repo_dir)
    sha = repo.commit_files(repo.head(), {"train.py": "LR = 0.3\n"}, "trial 1")
    assert git(repo_dir, "log", "-1", "--format=%an <%ae>|%cn <%ce>", sha) == (
        "autoloop <autoloop@localhost>|autoloop <autoloop@localhost>"
    )


def test_clean_worktree_keeps_ignored_and_untracked_files(repo: GitRepo, repo_dir: Path):
    branch, base, _ = repo.ensure_branch("t1")
    sha = repo.commit_files(base, {"train.py": "LR = 0.2\n"}, "trial 1")
    repo.checkout_commit(branch, sha)
    # A crash left a half-edited tracked file and run-time files behind.
    (repo_dir / "train.py").write_text("LR = garbage\n")
    (repo_dir / ".autoloop").mkdir()
    (repo_dir / ".autoloop" / "trial-1.log").write_text("log\n")
    (repo_dir / "experiments.db").write_bytes(b"db")
    (repo_dir / "notes.txt").write_text("mine\n")
    repo.clean_worktree_to(base)
    assert (repo_dir / "train.py").read_text() == TRAIN_PY
    assert repo.branch_commit(branch) == base
    assert (repo_dir / ".autoloop" / "trial-1.log").read_text() == "log\n"
    assert (repo_dir / "experiments.db").read_bytes() == b"db"
    assert (repo_dir / "notes.txt").read_text() == "mine\n"
    assert not repo.is_dirty()


def test_stale_index_lock_is_a_clear_error(repo: GitRepo, repo_dir: Path):
    (repo_dir / ".git" / "index.lock").write_text("")
    with pytest.raises(AutoloopError, match=r"index.lock: if no git command is running, delete that file"):
        repo.clean_worktree_to(repo.head())


def test_git_on_a_full_disk_is_a_full_disk_not_a_lock(repo: GitRepo, repo_dir: Path, tmp_path, monkeypatch):
    import shutil

    from autoloop.errors import DiskFull

    real = shutil.which("git")
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "git"  # git as it fails when it cannot create index.lock on a full disk
    # (autoloop passes `-c` options before the subcommand: find it among the arguments)
    fake.write_text("#!/bin/sh\nfor a in \"$@\"; do if [ \"$a\" = reset ]; then\n"
                    f"  echo \"fatal: Unable to create '{repo_dir}/.git/index.lock': No space left on device\" >&2; exit 128\n"
                    f"fi; done\nexec {real} \"$@\"\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(DiskFull) as caught:
        repo.clean_worktree_to(repo.head())
    assert str(caught.value) == "git reset could not write: No space left on device"


def test_show_file_missing_path(repo: GitRepo):
    with pytest.raises(AutoloopError, match="does not exist in commit"):
        repo.show_file(repo.head(), "nope.py")


def test_set_ref_only_under_autoloop(repo: GitRepo, repo_dir: Path):
    repo.set_ref("refs/autoloop/t1/orphans/abc", repo.head())
    assert git(repo_dir, "rev-parse", "refs/autoloop/t1/orphans/abc") == repo.head()
    with pytest.raises(ValueError):
        repo.set_ref("refs/heads/main", repo.head())


def test_repository_without_commits(tmp_path: Path):
    git(tmp_path, "init", "-q")
    with pytest.raises(AutoloopError, match="has no commits yet"):
        GitRepo.open(tmp_path).head()
