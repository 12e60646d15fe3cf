"""Proposals: what a proposer returns, and how the controller validates it.

A `Proposal` changes editable files only, by whole-file contents, search/replace blocks,
constant assignments (`--set NAME=VALUE`) or a unified diff. `materialize` turns it
into the new contents of every file it touches, computed from the parent commit, never
from the working tree; `validate` then checks the contract before anything is
committed: editable files only, protected files untouched, the edit applies, it changes
something, every touched file is UTF-8 text, and every touched Python file compiles. A
failure raises `InvalidProposal`, which the controller records as an `invalid` trial with
nothing committed.

Any other exception out of `materialize` or `validate` (a value the constants editor
cannot write, git failing on a strange patch) is turned into `InvalidProposal` too,
naming the exception: a proposal can be wrong in ways nobody foresaw, and it must end as
one invalid trial, never as a controller that crashes on it at every restart. A full
disk is the exception: it is not the proposal's fault, so it propagates
(`autoloop.errors.is_disk_full`).

Patches are bytes on the way to git: `Proposal.patch` may be `bytes` (e.g. read back from
a BLOB) or `str`; a str that came from bytes holds undecodable bytes as surrogates
(`surrogateescape`), so encoding it back gives git exactly the bytes it was made from.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field

from autoloop.errors import AutoloopError, is_disk_full
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
    patch: str | bytes | None = None  # a unified diff against the parent (git apply format)
    source: str = "unknown"  # the proposer's name
    idea_id: int | None = None
    model: str | None = None  # the LLM that wrote it, if any
    meta: dict = field(default_factory=dict)

    def to_json(self) -> str:
        patch = self.patch
        if isinstance(patch, (bytes, bytearray)):
            patch = patch_text(patch)
        # ensure_ascii: undecodable bytes (surrogates) become \udcXX escapes SQLite can store.
        return json.dumps({"edits": [asdict(e) for e in self.edits], "patch": patch}, default=_printable, ensure_ascii=True)

    @classmethod
    def edits_from_json(cls, text: str) -> tuple[list[Edit], str | None]:
        data = json.loads(text)
        return [Edit(**e) for e in data.get("edits", [])], data.get("patch")


def matches(path: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(path, pattern) or path == pattern for pattern in patterns)


def _printable(value) -> str:
    """JSON for a value a proposer put in an edit; never raises (the trial row must be written)."""
    try:
        return str(value)
    except Exception:
        return f"<unprintable {type(value).__name__}>"


def patch_text(data: bytes | str) -> str:
    """A patch as text; bytes that are not UTF-8 survive as surrogates (see the module doc)."""
    return data if isinstance(data, str) else bytes(data).decode("utf-8", errors="surrogateescape")


def patch_bytes(patch: bytes | str) -> bytes:
    """The exact bytes to hand to git."""
    return bytes(patch) if isinstance(patch, (bytes, bytearray)) else patch.encode("utf-8", errors="surrogateescape")


def _first_line(data: bytes, fallback: str) -> str:
    lines = data.decode("utf-8", errors="replace").strip().splitlines()
    return lines[0] if lines else fallback


def _git_location(project_dir: str) -> tuple[str, str]:
    """(the worktree's top level, the project folder relative to it: "" or "sub/")."""
    out = subprocess.run(["git", "rev-parse", "--show-toplevel", "--show-prefix"], cwd=project_dir, capture_output=True)
    if out.returncode != 0:
        raise InvalidProposal(f"{project_dir} is not in a git repository: {_first_line(out.stderr, 'git rev-parse failed')}")
    top, _, prefix = out.stdout.decode("utf-8", errors="surrogateescape").partition("\n")
    return top.strip(), prefix.strip()


def _patch_paths(top: str, patch: bytes, directory: list[str]) -> list[str]:
    out = subprocess.run(["git", "apply", "--numstat", "-z", *directory, "-"], cwd=top, input=patch, capture_output=True)
    if out.returncode != 0:
        raise InvalidProposal(f"the patch is not a valid diff: {_first_line(out.stderr, 'git apply failed')}")
    paths = []
    for record in out.stdout.decode("utf-8", errors="surrogateescape").split("\0"):
        parts = record.split("\t")
        if len(parts) == 3 and parts[2]:
            paths.append(parts[2])
    return paths


def _utf8(path: str, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidProposal(
            f"{path} would not be UTF-8 text after the patch (byte 0x{data[exc.start]:02x} at offset {exc.start}): "
            "editable files must stay UTF-8"
        ) from None


def _apply_patch(project_dir: str, parent: str, patch: str | bytes) -> dict[str, str | None]:
    """Apply a diff to the parent commit's tree in a temporary index (never the worktree).

    Paths in the patch are relative to the project folder `project_dir`, which may be a
    subfolder ("sub/") of the git worktree; a patch whose paths all start with "sub/"
    (`git diff` run in the subfolder writes them so) is taken as relative to the top level.
    git runs at the top level with `--directory=sub` where needed: git apply run in a
    subfolder would treat `diff --git` patches and plain ones differently."""
    data = patch_bytes(patch)
    top, prefix = _git_location(project_dir)
    directory: list[str] = []
    if prefix:
        as_top = _patch_paths(top, data, [])
        if not as_top or not all(path.startswith(prefix) for path in as_top):
            directory = [f"--directory={prefix.rstrip('/')}"]
    # Back to project-relative paths; one outside the project keeps a "../" that validate rejects.
    paths = [path[len(prefix):] if path.startswith(prefix) else os.path.relpath("/" + path, "/" + prefix)
             for path in _patch_paths(top, data, directory)]
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": os.path.join(tmp, "index")}
        read = subprocess.run(["git", "read-tree", parent], cwd=top, env=env, capture_output=True)
        if read.returncode != 0:
            raise InvalidProposal(f"the parent commit {parent[:12]} cannot be read: {_first_line(read.stderr, 'git read-tree failed')}")
        applied = subprocess.run(["git", "apply", "--cached", *directory, "-"], cwd=top, env=env, input=data,
                                 capture_output=True)
        if applied.returncode != 0:
            raise InvalidProposal(f"the patch does not apply to the parent commit: {_first_line(applied.stderr, 'git apply failed')}")
        files: dict[str, str | None] = {}
        for path in paths:
            shown = subprocess.run(["git", "show", f":{prefix}{path}"], cwd=top, env=env, capture_output=True)
            files[path] = _utf8(path, shown.stdout) if shown.returncode == 0 else None
        return files


def _unforeseen(exc: Exception, what: str) -> InvalidProposal:
    """Any other failure as an InvalidProposal whose reason is one line naming the exception."""
    text = " ".join(str(exc).split())[:300]
    return InvalidProposal(f"the proposal cannot be {what}: {type(exc).__name__}" + (f": {text}" if text else ""))


def _invalid_on_any_failure(verb: str):
    """Any exception out of the wrapped step becomes InvalidProposal (a full disk excepted:
    that propagates), so a proposal that cannot be used is an `invalid` trial, never a
    controller crash."""
    def wrap(step):
        @functools.wraps(step)
        def guarded(*args, **kwargs):
            try:
                return step(*args, **kwargs)
            except InvalidProposal:
                raise
            except Exception as exc:
                if is_disk_full(exc):
                    raise
                raise _unforeseen(exc, verb) from exc
        return guarded
    return wrap


@_invalid_on_any_failure("applied")
def materialize(proposal: Proposal, project_dir: str, parent: str, read_parent_file) -> dict[str, str | None]:
    """New contents of every touched file (None = deleted), computed from the parent.

    Raises InvalidProposal for anything that makes the proposal unusable, whatever the cause
    (a full disk excepted: that propagates)."""
    files: dict[str, str | None] = {}
    if proposal.patch:
        files.update(_apply_patch(project_dir, parent, proposal.patch))

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


@_invalid_on_any_failure("validated")
def validate(files: dict[str, str | None], read_parent_file, *, editable: list[str], protected: list[str]) -> dict[str, str | None]:
    """Check the contract on materialized files; returns only files that really change.

    Raises InvalidProposal for any failure (a full disk excepted), like `materialize`."""
    changed = {}
    for path, content in files.items():
        if os.path.isabs(path) or ".." in path.split("/"):
            raise InvalidProposal(f"edits a path outside the repository: {path}")
        if matches(path, protected):
            raise InvalidProposal(f"edits protected file {path}: proposals may only change {', '.join(editable)}")
        if not matches(path, editable):
            raise InvalidProposal(f"edits {path}, which is not editable: proposals may only change {', '.join(editable)}")
        if isinstance(content, (bytes, bytearray)):
            content = _utf8(path, bytes(content))
        if content is not None and not isinstance(content, str):
            raise InvalidProposal(f"the new content of {path} is not text ({type(content).__name__})")
        if content is not None:
            try:
                content.encode("utf-8")
            except UnicodeEncodeError as exc:  # surrogates: bytes that were not UTF-8
                raise InvalidProposal(f"{path} would not be UTF-8 text after the edit (at character {exc.start}): "
                                      "editable files must stay UTF-8") from None
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
