"""The git model of a run.

Branches and refs
-----------------
`autoloop run --tag T` works on the branch `autoloop/T`, created from the current HEAD the
first time (its starting commit is remembered under `refs/autoloop/T/base`) and resumed
when it exists. Parallel lineages use their own branches (`autoloop/T-w<k>`); trial
numbers are unique per run, so archive refs never collide across lineages.

Each proposal becomes a commit whose parent is the current best commit:

1. **Commit through a temporary index** (`commit_files`): with `GIT_INDEX_FILE` pointing at
   a fresh file outside the repository, `git read-tree <parent>` loads the parent's tree,
   each edited file is written with `git hash-object -w` and staged with
   `git update-index --cacheinfo`, then `git write-tree` and `git commit-tree -p <parent>`
   create the commit. Neither the working tree, the real index nor any ref changes, so a
   crash at any point here leaves the checkout exactly as it was; the worst leftover is an
   unreachable object that `git gc` collects.
2. **Check it out** (`checkout_commit`): the controller moves the branch to the commit and
   makes the worktree match (`git reset --hard <commit>` while on the branch). Training
   then runs on that checkout.
3. **Decide**: keep = the branch stays on the commit. Otherwise `archive(tag, number, sha)`
   writes `refs/autoloop/<tag>/trials/<number>`, which keeps the commit reachable forever
   (gc never prunes it, and its diff is also stored in the trial row), and the branch is
   reset to the best commit with `checkout_commit` again.

Only the controller moves refs; proposers, agents and workers hand back file contents or
diffs. `clean_worktree_to` (crash recovery) is `reset --hard` and nothing more: it never
runs `git clean`, because `.autoloop/` (logs, checkpoints, the run lock) and
`experiments.db` are git-ignored and must survive, and untracked files belong to the user.
Every file a proposal adds is tracked in its commit, so moving off that commit removes it.

A project in a subfolder
------------------------
The project folder is the folder autoloop runs in, the one holding train.py; it may be a
subfolder of a bigger repository. `GitRepo.open(folder)` remembers it as `project_dir`, and the
worktree's top level as `toplevel`; `prefix` is the folder relative to the top ("" or
"sub/"). Every path the controller and proposals use (edits, `file_reader`, `diff`,
`changed_paths`, `dirty_files`) is relative to the project folder, and GitRepo adds the
prefix where git wants a path relative to the top (the temporary index, tree lookups), so
an edit of `train.py` run from `sub/` commits `sub/train.py`. Branches, refs and checkouts
are the whole worktree's: one loop per working tree (`autoloop.lock`).

Identity
--------
Commits use the repository's configured identity (`user.name`/`user.email`, or the
`GIT_AUTHOR_*`/`GIT_COMMITTER_*` environment). Where none is configured - a fresh GPU box -
they fall back to `autoloop <autoloop@localhost>` so a run never stops on
"Please tell me who you are".
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path

import git

from autoloop.errors import AutoloopError, DiskFull, is_disk_full

BRANCH_PREFIX = "autoloop/"
REF_PREFIX = "refs/autoloop/"
FALLBACK_NAME = "autoloop"
FALLBACK_EMAIL = "autoloop@localhost"

# A tag becomes one path component of a branch and of refs; keep it boring.
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


# Every git command of the controller runs no hook and no fsmonitor command: git is run as
# the user, outside every sandbox, so nothing a repository's hooks folder or config could
# name (a hook planted through a link, say) may run as a side effect of a commit or reset.
GIT = ("git", "-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false")

def branch_name(tag: str) -> str:
    return BRANCH_PREFIX + tag


def validate_tag(tag: str) -> str:
    """Return `tag` if it can name a branch and refs; raise AutoloopError otherwise."""
    if not _TAG_RE.match(tag) or ".." in tag or tag.endswith((".lock", ".")):
        raise AutoloopError(
            f"invalid tag {tag!r}: use letters, digits, '.', '_' and '-', starting with a letter or digit"
        )
    return tag


def _one_at_a_time(cls):
    """Every method of `cls` holds the instance's lock: GitPython keeps one `git cat-file
    --batch` process per Repo, and two threads talking to it at once (trials on several
    workers) read each other's answers ("SHA could not be resolved") or hang."""
    for name, member in list(vars(cls).items()):
        if name.startswith("__") or not inspect.isfunction(member):
            continue

        def locked(self, *args, __method=member, **kwargs):
            with self._lock:
                return __method(self, *args, **kwargs)

        functools.update_wrapper(locked, member)
        setattr(cls, name, locked)
    return cls


@_one_at_a_time
class GitRepo:
    """A git working copy, seen through the operations the controller needs. Safe to share
    between threads: one operation at a time."""

    def __init__(self, repo: git.Repo, project: str | Path | None = None):
        self._lock = threading.RLock()
        self.repo = repo
        self.toplevel = Path(repo.working_tree_dir)  # type: ignore[arg-type]
        self.project_dir = Path(project) if project is not None else self.toplevel  # the project folder
        self.prefix = ""  # the project folder relative to the top level: "" or "sub/"
        if project is not None:
            try:
                rel = self.project_dir.resolve().relative_to(self.toplevel.resolve()).as_posix()
            except ValueError:
                raise AutoloopError(f"{project} is not inside the working tree {self.toplevel}: run autoloop in it") from None
            if rel.split("/")[0] == ".git":
                raise AutoloopError(f"{project} is inside .git: run autoloop in the project folder")
            self.prefix = "" if rel == "." else rel + "/"

    @classmethod
    def open(cls, path: str | Path) -> GitRepo:
        """Open the repository containing `path`; `path` is the project folder (it may be a
        subfolder of the repository: see "A project in a subfolder")."""
        try:
            repo = git.Repo(path, search_parent_directories=True)
        except (git.InvalidGitRepositoryError, git.NoSuchPathError):
            raise AutoloopError(
                f"{path} is not a git repository: run `git init && git add -A && git commit -m init` first"
            ) from None
        if repo.bare:
            raise AutoloopError(f"{path} is a bare git repository: run autoloop in a clone with a working tree")
        return cls(repo, Path(path).resolve())

    def top_path(self, path: str) -> str:
        """A project-relative path as git's trees and index name it (relative to the top level)."""
        return self.prefix + _normalise_path(path)

    def _relative(self) -> list[str]:
        """`git diff` options that show paths relative to the project folder."""
        return [f"--relative={self.prefix}"] if self.prefix else []

    # -- low level ------------------------------------------------------------------------

    def _git(self, *args: str, env: dict[str, str] | None = None, strip: bool = True, **kwargs) -> str:
        """Run `git args...` in the repository and return stdout.

        A full disk is a DiskFull error saying so (git's message for it names
        `index.lock` too, as the file it could not create). A stale `index.lock` (left by
        a git process that was killed: "File exists") is turned into an AutoloopError
        naming the file, since every later git command would fail on it.
        """
        try:
            return self.repo.git.execute(
                [*GIT, *args], env=env, strip_newline_in_stdout=strip, **kwargs
            )  # type: ignore[return-value]
        except git.GitCommandError as error:
            stderr = str(error.stderr or "")
            if is_disk_full(stderr):
                # git names index.lock as the file it could not create: not a lock problem.
                raise DiskFull(f"git {args[0]} could not write: No space left on device") from error
            match = re.search(r"'([^']*index\.lock)'", stderr)
            if match and "exists" in stderr:
                raise AutoloopError(
                    f"git is locked by {match.group(1)}: if no git command is running, delete that file and retry"
                ) from error
            raise

    def _succeeds(self, *args: str) -> bool:
        status, _, _ = self.repo.git.execute(
            [*GIT, *args], with_extended_output=True, with_exceptions=False
        )
        return status == 0

    def _identity_env(self) -> dict[str, str]:
        """GIT_AUTHOR/COMMITTER variables for whatever identity git cannot find itself."""
        env: dict[str, str] = {}
        for field, fallback in (("name", FALLBACK_NAME), ("email", FALLBACK_EMAIL)):
            configured = self._succeeds("config", "--get", f"user.{field}")
            for role in ("AUTHOR", "COMMITTER"):
                variable = f"GIT_{role}_{field.upper()}"
                if not configured and not os.environ.get(variable):
                    env[variable] = fallback
        return env

    # -- state ----------------------------------------------------------------------------

    def head(self) -> str:
        """The commit HEAD points at."""
        try:
            return self.repo.head.commit.hexsha
        except ValueError:
            raise AutoloopError(
                f"{self.project_dir} has no commits yet: run `git add -A && git commit -m init` first"
            ) from None

    def current_branch(self) -> str | None:
        """The checked-out branch name, or None on a detached HEAD."""
        if self.repo.head.is_detached:
            return None
        return self.repo.active_branch.name

    def branch_commit(self, branch: str) -> str | None:
        """The commit `branch` points at, or None if there is no such branch."""
        out = self.repo.git.execute(
            [*GIT, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}^{{commit}}"],
            with_extended_output=True,
            with_exceptions=False,
        )
        return out[1].strip() if out[0] == 0 else None

    def dirty_files(self) -> list[str]:
        """Tracked files with uncommitted changes (staged or not), anywhere in the worktree,
        relative to the project folder. Untracked files are ignored: they are not part of
        any commit autoloop makes."""
        out = self._git("status", "--porcelain=v1", "-z", "--untracked-files=no", strip=False)
        files = self._porcelain_paths(out)
        if not self.prefix:
            return files
        # Relative to the project folder ("../x" outside it), like every other path here.
        top, project = self.toplevel.resolve(), self.project_dir.resolve()
        return [os.path.relpath(top / path, project) for path in files]

    @staticmethod
    def _porcelain_paths(out: str) -> list[str]:
        entries = out.split("\0")
        files: list[str] = []
        i = 0
        while i < len(entries):
            entry = entries[i]
            i += 1
            if len(entry) < 4:
                continue
            files.append(entry[3:])
            if entry[0] in "RC":
                i += 1  # a rename/copy is followed by its source path
        return files

    def is_dirty(self) -> bool:
        return bool(self.dirty_files())

    def commit_exists(self, sha: str) -> bool:
        return self._succeeds("cat-file", "-e", f"{sha}^{{commit}}")

    def is_ancestor(self, ancestor: str, descendant: str) -> bool:
        """True if `ancestor` is `descendant` or one of its ancestors."""
        return self._succeeds("merge-base", "--is-ancestor", ancestor, descendant)

    def is_valid_branch_name(self, branch: str) -> bool:
        """True if `branch` can name a branch (`git check-ref-format`)."""
        return self._succeeds("check-ref-format", f"refs/heads/{branch}")

    def tree_of(self, commit: str) -> str:
        """The sha of `commit`'s tree."""
        return self._git("rev-parse", f"{commit}^{{tree}}")

    # -- branch of a run ------------------------------------------------------------------

    def ensure_branch(self, tag: str) -> tuple[str, str, bool]:
        """Check out `autoloop/<tag>`, creating it from HEAD if needed.

        Returns (branch name, base commit, created). The base commit is the commit the
        branch was created from (recorded in `refs/autoloop/<tag>/base`); for a branch
        made by other means it falls back to the branch's current commit. A dirty tracked
        tree is refused: its changes would silently become part of every trial.
        """
        validate_tag(tag)
        dirty = self.dirty_files()
        if dirty:
            shown = ", ".join(dirty[:5]) + (f" and {len(dirty) - 5} more" if len(dirty) > 5 else "")
            raise AutoloopError(
                f"{self.project_dir} has uncommitted changes to tracked files ({shown}): "
                "commit them or `git stash` them, then rerun"
            )
        branch = branch_name(tag)
        base_ref = f"{REF_PREFIX}{tag}/base"
        existing = self.branch_commit(branch)
        if existing is None:
            base = self.head()
            self._git("checkout", "-q", "-b", branch, base)
            self._git("update-ref", base_ref, base)
            return branch, base, True
        if self.current_branch() != branch:
            self._git("checkout", "-q", branch)
        recorded = self.repo.git.execute(
            [*GIT, "rev-parse", "--verify", "--quiet", base_ref],
            with_extended_output=True,
            with_exceptions=False,
        )
        base = recorded[1].strip() if recorded[0] == 0 else existing
        return branch, base, False

    # -- commits --------------------------------------------------------------------------

    def commit_files(self, parent: str, files: dict[str, str | bytes | None], message: str) -> str:
        """Create a commit on top of `parent` with `files` replaced, without touching the
        working tree, the index or any ref; return its sha.

        `files` maps project-relative paths to new contents (str is written as UTF-8) or to
        None to delete the file. Existing files keep their mode (e.g. executable).
        Content is stored as `git add` would store it at that path (clean filters and
        .gitattributes apply).
        """
        parent_commit = self.repo.commit(parent)
        tmpdir = tempfile.mkdtemp(prefix="autoloop-index-")
        try:
            # An absolute path: git resolves a relative GIT_INDEX_FILE against its cwd.
            env = {"GIT_INDEX_FILE": os.path.join(tmpdir, "index")}
            self._git("read-tree", parent_commit.hexsha, env=env)
            for number, (path, content) in enumerate(sorted(files.items())):
                rel = self.top_path(path)
                if content is None:
                    self._git("update-index", "--force-remove", "--", rel, env=env)
                    continue
                data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
                blob_file = os.path.join(tmpdir, f"blob{number}")
                with open(blob_file, "wb") as handle:
                    handle.write(data)
                sha = self._git("hash-object", "-w", f"--path={rel}", "--", blob_file, env=env)
                try:
                    mode = oct(parent_commit.tree[rel].mode)[2:]
                except KeyError:
                    mode = "100644"
                self._git("update-index", "--add", "--cacheinfo", f"{mode},{sha},{rel}", env=env)
            tree = self._git("write-tree", env=env)
            return self._git(
                "commit-tree", tree, "-p", parent_commit.hexsha, "-m", message, env={**env, **self._identity_env()}
            )
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)

    def commit_tree(self, tree: str, parent: str, message: str) -> str:
        """A commit of `tree` on top of `parent` (no ref moves), with the repository's
        identity or autoloop's fallback; returns its sha."""
        return self._git("commit-tree", tree, "-p", parent, "-m", message, env=self._identity_env())

    def rebased_files(self, parent: str, commit: str, onto: str) -> tuple[dict[str, str], str | None]:
        """The edit `parent` -> `commit` merged onto `onto`, file by file (`git merge-file`,
        a three-way merge of each changed file): ({path: content}, None), or ({}, why it
        does not apply). Nothing is written to the repository."""
        import subprocess

        merged = {}
        for path in self.changed_paths(parent, commit):
            base, theirs, ours = (self.file_reader(sha)(path) for sha in (parent, commit, onto))
            if theirs is None or base is None or ours is None:
                return {}, f"{path} was added or deleted"
            with tempfile.TemporaryDirectory(prefix="autoloop-rebase-") as tmp:
                names = []
                for name, text in (("ours", ours), ("base", base), ("theirs", theirs)):
                    (Path(tmp) / name).write_text(text)
                    names.append(str(Path(tmp) / name))
                done = subprocess.run(["git", "merge-file", "-p", *names], capture_output=True, text=True)
            if done.returncode != 0:
                return {}, f"its change to {path} conflicts with the new best"
            merged[path] = done.stdout
        return merged, None

    def checkout_commit(self, branch: str, sha: str) -> None:
        """Point `branch` at `sha`, check the branch out and make the worktree match.

        Used both to advance to a proposal and to reset to the best commit. Tracked
        changes in the worktree are discarded; untracked and ignored files are kept.
        """
        if self.current_branch() == branch:
            self._git("reset", "-q", "--hard", sha)
        else:
            # -B moves (or creates) the branch, -f discards tracked changes: together
            # the same as switching to the branch and `reset --hard sha`.
            self._git("checkout", "-q", "-f", "-B", branch, sha)

    def clean_worktree_to(self, sha: str) -> None:
        """Crash recovery: `git reset --hard sha` on the current branch (it moves too).

        Deliberately no `git clean`: ignored files (.autoloop/, experiments.db) must
        survive, and untracked files are the user's.
        """
        self._git("reset", "-q", "--hard", sha)

    # -- archive --------------------------------------------------------------------------

    def archive(self, tag: str, number: int, sha: str) -> str:
        """Keep a non-kept trial's commit reachable under refs/autoloop/<tag>/trials/<number>."""
        ref = f"{REF_PREFIX}{validate_tag(tag)}/trials/{int(number)}"
        self._git("update-ref", "-m", f"autoloop: archive trial {number}", ref, sha)
        return ref

    def set_branch(self, branch: str, sha: str, *, expected: str | None, message: str) -> None:
        """Point `branch` at `sha` only if it is still at `expected` (None: only if it does
        not exist yet): a compare-and-swap, so a branch someone created or moved meanwhile is
        never clobbered. For branches outside the run's own (`autoloop finalize`)."""
        self._git("update-ref", "-m", message, f"refs/heads/{branch}", sha, expected or "0" * 40)

    def checkout_branch(self, branch: str) -> None:
        """Check out an existing branch (the worktree follows; tracked changes must not conflict)."""
        self._git("checkout", "-q", branch)

    def set_lineage_branch(self, branch: str, sha: str) -> None:
        """Point a lineage's branch (`autoloop/<tag>-w<k>`, islands mode) at `sha` without
        checking it out: only the run's own branch is ever checked out."""
        if not branch.startswith(BRANCH_PREFIX) or not self._succeeds("check-ref-format", f"refs/heads/{branch}"):
            raise ValueError(f"{branch!r} is not a valid branch under {BRANCH_PREFIX}")
        if self.current_branch() == branch:
            raise ValueError(f"{branch!r} is checked out: move it with checkout_commit")
        self._git("update-ref", f"refs/heads/{branch}", sha)

    def set_ref(self, ref: str, sha: str) -> None:
        """Point a ref under refs/autoloop/ at `sha` (e.g. to keep an orphaned branch tip
        reachable during crash recovery). Other namespaces are refused: branches move
        only through `ensure_branch`/`checkout_commit`."""
        if not ref.startswith(REF_PREFIX) or not self._succeeds("check-ref-format", ref):
            raise ValueError(f"{ref!r} is not a valid ref under {REF_PREFIX}")
        self._git("update-ref", ref, sha)

    def archived(self, tag: str) -> dict[int, str]:
        """{trial number: commit} for every archived trial of run `tag`."""
        prefix = f"{REF_PREFIX}{validate_tag(tag)}/trials/"
        out = self._git("for-each-ref", "--format=%(refname) %(objectname)", prefix)
        result: dict[int, str] = {}
        for line in out.splitlines():
            ref, sha = line.split()
            suffix = ref[len(prefix) :]
            if suffix.isdigit():
                result[int(suffix)] = sha
        return result

    # -- contents -------------------------------------------------------------------------

    def diff(self, parent: str, sha: str) -> str:
        """The unified diff from `parent` to `sha`, applicable with `git apply`."""
        return self._git(
            "diff", "--no-color", "--no-ext-diff", "--binary", *self._relative(), parent, sha, "--", strip=False
        )

    def changed_paths(self, parent: str, sha: str) -> list[str]:
        """Paths that differ between the two commits (a rename lists both paths)."""
        out = self._git("diff", "--name-only", "--no-renames", "-z", *self._relative(), parent, sha, "--", strip=False)
        return [path for path in out.split("\0") if path]

    def file_reader(self, sha: str):
        """`read(path) -> str | None`: files of commit `sha`, None where there is no such
        file (or the path leaves the repository), as proposals' validation expects."""

        def read(path: str) -> str | None:
            try:
                return self.show_file(sha, path)
            except (AutoloopError, ValueError):
                return None

        return read

    def show_file(self, sha: str, path: str) -> str:
        """The content of `path` at commit `sha`."""
        try:
            blob = self.repo.commit(sha).tree[self.top_path(path)]
        except KeyError:
            raise AutoloopError(f"{path} does not exist in commit {sha[:12]}: check the path") from None
        return blob.data_stream.read().decode("utf-8", errors="replace")


def _normalise_path(path: str) -> str:
    """A repo-relative POSIX path; absolute paths and '..' are refused."""
    rel = Path(path).as_posix()
    if rel.startswith("/") or ".." in Path(rel).parts or rel in ("", "."):
        raise ValueError(f"{path!r} is not a repo-relative file path")
    return rel[2:] if rel.startswith("./") else rel

