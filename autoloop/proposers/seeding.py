"""Seeding ideas: checked when seeded, so a bad idea fails now in one line, not as an
invalid trial (or a crash) at 3 a.m.

An idea is checked against the *current best*: the best commit of the run it is for
(`--tag`, else the most recent run in the db; its base commit before the baseline has
finished), or HEAD when there is no run yet. That is the commit the loop applies it to
next. The rules are the controller's own, by the same code: the idea becomes the
proposal the `ideas` proposer will make of it (`proposers.seeded.idea_proposal`) and goes
through `materialize` and `validate` (editable files only, protected files untouched,
the patch applies to the best commit, it changes something, every touched Python file
compiles). On top of those, because they would otherwise fail only when the trial
trains:

* a `--set` value must fit its constant: an int constant takes an int, a float constant
  an int or a float, a string a (quoted) string, a bool a bool, a list or tuple a list or
  tuple; numbers must be finite (`1e400` would be written as `inf`); a name in the value
  must be another constant of the file (`abc` is a typo for `'abc'`);
* the constants must keep train.py's own asserts over them (`autoloop.invariants`): with
  N_HEAD=4, `--set N_KV_HEAD=3` breaks `assert N_HEAD % N_KV_HEAD == 0` and is refused
  naming that line, instead of crashing at night as a bare AssertionError;
* a patch file must be UTF-8 text (ideas are stored as text) of at most
  MAX_PATCH_BYTES.

`--tag T` for a run not started yet queues the idea for it: checked against HEAD (where
`autoloop run --tag T` will start), kept for that run alone (`ideas.run_tag`), and given
to the run when it is created.

An idea the same as one still pending (the same edit, whatever its words; for a text-only
idea, the same text) is not queued twice: `Store.add_idea` says which one, in one line.

A text-only idea (no `--set`, no patch) is only ever read by a proposer that reads text:
an LLM (`llm-model`) or a coding agent (`agent-command`). With neither configured (in
pyproject.toml, the environment, or the latest run's own settings), it is queued but
says at once that it waits (`text_only_wait`), and `autoloop ideas` says why it waits.
"""

from __future__ import annotations

import ast
import math
import subprocess
from pathlib import Path

from autoloop.config import Config
from autoloop.errors import AutoloopError
from autoloop.pyconst import Constant, Unreadable, evaluate, parse_expression, parse_value, read_constants

# train.py is ~30 KB, so a rewrite of the whole file is well under 100 KB; 1 MB leaves
# ten times that. The text is stored again in the trial's edits and diff, so a 20 MB
# "idea" grew the db by 100 MB.
MAX_PATCH_BYTES = 1_000_000


# ---------------------------------------------------------------------------- --set values


def parse_sets(pairs: list[str], source: str, path: str) -> dict[str, str]:
    """`NAME=VALUE` pairs -> {NAME: value text}, each NAME a constant of `source` and
    each value one that fits it (see the module docstring)."""
    try:
        known = read_constants(source)
    except SyntaxError as exc:
        raise AutoloopError(f"{path} does not parse (line {exc.lineno}: {exc.msg}): fix it before seeding --set ideas") from None
    sets: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            raise AutoloopError(f"--set {pair!r} is not NAME=VALUE: write it like --set MATRIX_LR=0.03")
        if name not in known:
            raise AutoloopError(f"--set {name}: {path} has no UPPER_CASE constant {name}: {_suggest(name, known)}")
        check_value(known[name], value, known, path)
        sets[name] = value
    return sets


def _suggest(name: str, known: dict[str, Constant]) -> str:
    """'did you mean MATRIX_LR?' for a near miss (case, underscores, a typo), else a few of
    the constants and where to see them all."""
    import difflib

    squash = lambda text: text.replace("_", "").upper()  # noqa: E731
    same = [k for k in known if squash(k) == squash(name)]
    close = same or difflib.get_close_matches(name.upper(), list(known), n=3, cutoff=0.6)
    if close:
        return f"did you mean {' or '.join(close)}?"
    if not known:
        return "it has none"
    shown = sorted(known)
    listed = ", ".join(shown[:8]) + (f", ... ({len(shown)} in all)" if len(shown) > 8 else "")
    return f"its constants are {listed}; `autoloop search-plan` lists them with their values"


def check_value(constant: Constant, text: str, known: dict[str, Constant], path: str) -> None:
    """Raise AutoloopError unless `text` is a value `constant` can take (module docstring)."""
    name = constant.name
    try:
        parse_value(text)
    except AutoloopError as exc:  # no Python expression at all
        raise AutoloopError(f"--set {name}={text[:80]}: {exc}") from None
    node = parse_expression(text)  # parse_value has parsed it: no Unreadable here
    names = sorted({n.id for n in ast.walk(node) if isinstance(n, ast.Name)} - set(known))
    if names:
        raise AutoloopError(
            f"--set {name}={text}: {names[0]!r} is neither a value nor a constant of {path}: "
            f"quote a string (--set {name}='{text}') or give a number"
        )
    if any(isinstance(n, ast.Name) for n in ast.walk(node)):
        return  # an expression of other constants: its value exists only when train.py runs
    try:
        value = evaluate(node)  # a literal or arithmetic of literals (2**18), within the caps constants are read with
    except Unreadable as exc:
        raise AutoloopError(f"--set {name}={text[:80]}: not a value autoloop evaluates ({exc}): give a literal, "
                            f"e.g. {name}={constant.source}") from None
    if not _finite(value):
        raise AutoloopError(f"--set {name}={text}: not a finite number (it reads as {value!r}): give a value train.py can train with")
    expected = _expected_type(constant.value, value)
    if expected is not None:
        raise AutoloopError(
            f"--set {name}={text}: {name} is {expected} in {path} (now {constant.source}) and {text} is "
            f"{_article(type(value).__name__)}: give {expected}"
            + (f" (a string needs quotes: {name}='...')" if expected == "a str" else "")
        )


def _finite(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, complex):
        return math.isfinite(value.real) and math.isfinite(value.imag)
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in (*value.keys(), *value.values()))
    return True


def _expected_type(current, value) -> str | None:
    """None when `value` fits a constant whose value is `current`, else what it needs."""
    if current is None:  # None, or an expression we cannot evaluate: anything goes
        return None
    if isinstance(current, bool):
        return None if isinstance(value, bool) else "a bool"
    if isinstance(current, int):
        return None if isinstance(value, int) and not isinstance(value, bool) else "an int"
    if isinstance(current, float):
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a float"
    if isinstance(current, (list, tuple)):
        return None if isinstance(value, (list, tuple)) else _article(type(current).__name__)
    return None if type(value) is type(current) else _article(type(current).__name__)


def _article(type_name: str) -> str:
    return f"{'an' if type_name[0] in 'aeiou' else 'a'} {type_name}"


# ---------------------------------------------------------------------------- patches


def read_patch(patch: Path, repo: Path) -> str:
    """The patch file's text: it must exist, be at most MAX_PATCH_BYTES, be UTF-8 and
    look like a diff. The size is checked before the file is read."""
    if not patch.is_file():
        raise AutoloopError(f"patch file {patch} does not exist: check the path")
    size = patch.stat().st_size
    if size > MAX_PATCH_BYTES:
        raise AutoloopError(
            f"{patch} is {size / 1e6:.1f} MB and a seeded patch is at most {MAX_PATCH_BYTES / 1e6:g} MB "
            "(MAX_PATCH_BYTES): an edit that large is not one idea; commit it to the branch instead"
        )
    data = patch.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AutoloopError(
            f"{patch} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}): ideas are stored as text; "
            f"write the diff as UTF-8 (`git diff > {patch.name}` does for UTF-8 sources; binary files need --binary)"
        ) from None
    check = subprocess.run(["git", "apply", "--numstat", "-"], cwd=repo, input=data, capture_output=True)
    if check.returncode != 0 or not check.stdout.strip():
        first = (check.stderr.decode(errors="replace").strip().splitlines() or ["it contains no changes"])[0]
        raise AutoloopError(f"{patch} is not a usable diff ({first}): make it with `git diff > {patch.name}`")
    return text


# ---------------------------------------------------------------------------- the current best


def current_best(config: Config, repo: Path, tag: str | None):
    """(GitRepo, commit, words for messages): the commit a seeded idea will be applied to."""
    from autoloop.gitops import GitRepo
    from autoloop.store import Store

    git_repo = GitRepo.open(repo)
    db = _db_path(config, repo)
    run = None
    if db.exists():
        with Store(db) as store:
            run = _run_for(store, db, tag)
    if run is None and tag is not None:
        return git_repo, git_repo.head(), f"HEAD (run '{tag}' not started yet: it will start from HEAD)"
    if run is None:
        return git_repo, git_repo.head(), "HEAD (no run yet)"
    sha = run["best_commit"] or run["base_commit"]
    where = f"the best of run '{run['tag']}'" if run["best_commit"] else f"the base of run '{run['tag']}' (no baseline yet)"
    if not sha:
        return git_repo, git_repo.head(), f"HEAD (run '{run['tag']}' has no commit yet)"
    if not git_repo.commit_exists(sha):
        raise AutoloopError(
            f"run '{run['tag']}' is at commit {sha[:12]}, which is not in {git_repo.project_dir}: seed from the clone that ran it"
        )
    return git_repo, sha, where


def _db_path(config: Config, repo: Path) -> Path:
    return Path(config.db) if Path(config.db).is_absolute() else Path(repo) / config.db


def _run_for(store, db: Path, tag: str | None) -> dict | None:
    """The run an idea is checked against: the --tag run (None when it is not started
    yet: the idea waits for it), else the most recent run."""
    if tag is not None:
        return store.get_run(tag)
    runs = store.runs()
    return runs[-1] if runs else None


# ---------------------------------------------------------------------------- train.py's asserts


def _check_invariants(what: str, path: str, old: str | None, new: str | None) -> None:
    """Refuse an idea whose constants break one of train.py's own asserts over them
    (autoloop.invariants), which would otherwise crash the trial as a bare AssertionError."""
    from autoloop.invariants import broken_by

    if old is None or new is None or old == new:
        return
    try:
        problems = broken_by(old, new)
    except SyntaxError:
        return  # validate has judged the file; nothing more to read here
    if problems:
        raise AutoloopError(f"{what} cannot be seeded: {problems[0].describe(path)}: choose values that keep it "
                            "(several --set flags change constants together)")


# ---------------------------------------------------------------------------- seed


def seed_idea(config: Config, repo: Path, description: str, *, sets: list[str], patch: Path | None,
              priority: int = 0, tag: str | None = None) -> dict:
    """Check the idea against the current best (module docstring) and queue it."""
    from autoloop.proposers.proposal import InvalidProposal, materialize, validate
    from autoloop.proposers.seeded import idea_proposal
    from autoloop.store import Store

    repo = Path(repo)
    if not description.strip():
        raise AutoloopError("the idea needs a description: autoloop seed \"what to try\" [--set NAME=VALUE]")
    patch_text = read_patch(Path(patch), repo) if patch is not None else None
    sets_parsed = None
    if sets or patch_text:
        git_repo, best, where = current_best(config, repo, tag)
        read_best = git_repo.file_reader(best)
        what = " ".join(f"--set {pair}" for pair in sets) if sets else Path(patch).name
        if patch_text and sets:
            what = f"{Path(patch).name} with {what}"
        project_dir = str(repo.resolve())
        try:
            if sets:
                target = config.editable[0]
                source = read_best(target)
                if patch_text:  # the constants are set on top of the patched file, as materialize does
                    source = materialize(idea_proposal({"text": description, "patch": patch_text}, config),
                                         project_dir, best, read_best).get(target, source)
                if source is None:
                    raise AutoloopError(f"{target} is not in {best[:7]}, {where}: --set edits constants of {target}")
                sets_parsed = parse_sets(sets, source, target)
            proposal = idea_proposal({"text": description, "sets": sets_parsed, "patch": patch_text}, config)
            files = materialize(proposal, project_dir, best, read_best)
            validate(files, read_best, editable=config.editable, protected=config.protected)
        except InvalidProposal as exc:
            raise AutoloopError(f"{what} cannot be seeded: {exc} (checked against {best[:7]}, {where})") from None
        _check_invariants(what, config.editable[0], read_best(config.editable[0]), files.get(config.editable[0]))
    db = _db_path(config, repo)
    store = Store(db)
    try:
        run = _run_for(store, db, tag) if tag is not None else None
        # A run not started yet: the idea waits for it (run_tag), bound when `autoloop run --tag` creates it.
        return store.add_idea(description, run_id=run["id"] if run else None, run_tag=tag if tag and not run else None,
                              sets=sets_parsed, patch=patch_text, priority=priority, source="human")
    finally:
        store.close()


# ---------------------------------------------------------------------------- text-only ideas

TEXT_READERS = ("llm", "agent")
HOW_TO_READ_TEXT = ("configure an LLM (--llm-model MODEL, or llm-model in [tool.autoloop]) or a coding agent "
                    "(--agent-command 'claude -p'); docs/llm.md")


def reads_text(config: Config) -> bool:
    """Whether the proposer chain of `config` has a proposer that reads a text idea."""
    from autoloop.proposers.base import resolve_names

    return any(name in TEXT_READERS for name in resolve_names(config))


def waiting_reason(config: Config, runs: list[dict]) -> str | None:
    """Why a text-only idea is not taken, or None when a proposer would read it: neither
    `config` (pyproject.toml and the environment) nor the latest run's own settings (flags
    it was started with) has an LLM or an agent in its chain."""
    import dataclasses

    if reads_text(config):
        return None
    latest = (runs[-1].get("config") or {}) if runs else {}
    if latest:
        known = {f.name for f in dataclasses.fields(Config)}
        try:
            if reads_text(dataclasses.replace(config, **{k: v for k, v in latest.items() if k in known})):
                return None
        except (TypeError, ValueError):
            pass
    return f"text only, and no proposer that reads text is configured: {HOW_TO_READ_TEXT}"


def text_only_wait(config: Config, repo: Path, idea: dict) -> str | None:
    """The one line `autoloop seed` prints for a text-only idea nothing will read yet."""
    from autoloop.store import Store

    if idea.get("sets") or idea.get("patch"):
        return None
    db = _db_path(config, repo)
    with Store(db) as store:
        reason = waiting_reason(config, store.runs())
    if reason is None:
        return None
    return (f"idea {idea['id']} is text only: it waits until a proposer that reads text is configured "
            f"(the built-in search reads only --set and --patch ideas): {HOW_TO_READ_TEXT}")
