"""Proposals: what a proposer returns, and how the controller validates it.

A `Proposal` changes editable files only, by whole-file contents, search/replace blocks,
constant assignments (`--set NAME=VALUE`) or a unified diff. `materialize` turns it
into the new contents of every file it touches, computed from the parent commit, never
from the working tree; `validate` then checks the contract before anything is
committed: editable files only, protected files untouched, the edit applies, it changes
something, and every touched Python file compiles. A failure raises `InvalidProposal`,
which the controller records as an `invalid` trial with nothing committed.
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field

from autoloop.errors import AutoloopError
from autoloop.pyconst import set_constants


class InvalidProposal(AutoloopError):
    """The proposal breaks the contract; str() is the reason stored with the trial."""


@dataclass
class Edit:
    path: str
    content: str | None = None  # the whole new file
    search: str | None = None  # or: replace this exact text (must occur once) ...
    replace: str | None = None  # ... with this
    sets: dict | None = None  # or: set these UPPER_CASE constants {NAME: value}


@dataclass
class Proposal:
    description: str
    edits: list[Edit] = field(default_factory=list)
    patch: str | None = None  # a unified diff against the parent (git apply format)
    source: str = "unknown"  # the proposer's name
    idea_id: int | None = None
    model: str | None = None  # the LLM that wrote it, if any
    meta: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"edits": [asdict(e) for e in self.edits], "patch": self.patch}, default=str)

    @classmethod
    def edits_from_json(cls, text: str) -> tuple[list[Edit], str | None]:
        data = json.loads(text)
        return [Edit(**e) for e in data.get("edits", [])], data.get("patch")


def matches(path: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(path, pattern) or path == pattern for pattern in patterns)


def _patch_paths(repo_dir: str, patch: str) -> list[str]:
    out = subprocess.run(
        ["git", "apply", "--numstat", "-z", "-"], cwd=repo_dir, input=patch.encode(), capture_output=True
    )
    if out.returncode != 0:
        raise InvalidProposal(f"the patch is not a valid diff: {out.stderr.decode().strip().splitlines()[0] if out.stderr else 'git apply failed'}")
    paths = []
    for record in out.stdout.decode().split("\0"):
        parts = record.split("\t")
        if len(parts) == 3 and parts[2]:
            paths.append(parts[2])
    return paths


def _apply_patch(repo_dir: str, parent: str, patch: str) -> dict[str, str | None]:
    """Apply a diff to the parent commit's tree in a temporary index (never the worktree)."""
    paths = _patch_paths(repo_dir, patch)
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": os.path.join(tmp, "index")}
        subprocess.run(["git", "read-tree", parent], cwd=repo_dir, env=env, check=True, capture_output=True)
        applied = subprocess.run(
            ["git", "apply", "--cached", "-"], cwd=repo_dir, env=env, input=patch.encode(), capture_output=True
        )
        if applied.returncode != 0:
            first = (applied.stderr.decode().strip().splitlines() or ["git apply failed"])[0]
            raise InvalidProposal(f"the patch does not apply to the parent commit: {first}")
        files: dict[str, str | None] = {}
        for path in paths:
            shown = subprocess.run(["git", "show", f":{path}"], cwd=repo_dir, env=env, capture_output=True)
            files[path] = shown.stdout.decode() if shown.returncode == 0 else None
        return files


def materialize(proposal: Proposal, repo_dir: str, parent: str, read_parent_file) -> dict[str, str | None]:
    """New contents of every touched file (None = deleted), computed from the parent."""
    files: dict[str, str | None] = {}
    if proposal.patch:
        files.update(_apply_patch(repo_dir, parent, proposal.patch))

    def current(path: str) -> str:
        if path in files:
            if files[path] is None:
                raise InvalidProposal(f"{path} is deleted by the patch and edited again")
            return files[path]
        text = read_parent_file(path)
        if text is None:
            raise InvalidProposal(f"{path} does not exist in the parent commit: only existing files can be edited this way")
        return text

    for edit in proposal.edits:
        path = edit.path.lstrip("./") if edit.path.startswith("./") else edit.path
        if edit.content is not None:
            files[path] = edit.content
        elif edit.sets:
            try:
                files[path] = set_constants(current(path), edit.sets, path=path)
            except InvalidProposal:
                raise
            except AutoloopError as exc:
                raise InvalidProposal(str(exc)) from None
            except SyntaxError as exc:
                raise InvalidProposal(f"{path} does not parse: {exc.msg} (line {exc.lineno})") from None
        elif edit.search is not None:
            text = current(path)
            count = text.count(edit.search)
            if count != 1:
                where = "is not found" if count == 0 else f"matches {count} places"
                raise InvalidProposal(f"a search block for {path} {where}: it must match exactly one place")
            files[path] = text.replace(edit.search, edit.replace or "", 1)
        else:
            raise InvalidProposal(f"an edit of {path} has no content, search/replace or constants")
    return files


def validate(files: dict[str, str | None], read_parent_file, *, editable: list[str], protected: list[str]) -> dict[str, str | None]:
    """Check the contract on materialized files; returns only files that really change."""
    changed = {}
    for path, content in files.items():
        if os.path.isabs(path) or ".." in path.split("/"):
            raise InvalidProposal(f"edits a path outside the repository: {path}")
        if matches(path, protected):
            raise InvalidProposal(f"edits protected file {path}: proposals may only change {', '.join(editable)}")
        if not matches(path, editable):
            raise InvalidProposal(f"edits {path}, which is not editable: proposals may only change {', '.join(editable)}")
        if content != read_parent_file(path):
            changed[path] = content
    if not changed:
        raise InvalidProposal("the proposal changes nothing")
    for path, content in changed.items():
        if content is not None and path.endswith(".py"):
            try:
                compile(content, path, "exec", dont_inherit=True)
            except SyntaxError as exc:
                raise InvalidProposal(f"syntax error in {path} line {exc.lineno}: {exc.msg}") from None
            except ValueError as exc:  # e.g. null bytes
                raise InvalidProposal(f"{path} does not compile: {exc}") from None
    return changed
