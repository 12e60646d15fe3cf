"""Seeding ideas: checked against train.py when seeded, so a typo fails now, not at 3 a.m."""

from __future__ import annotations

import subprocess
from pathlib import Path

from autoloop.config import Config
from autoloop.errors import AutoloopError
from autoloop.pyconst import parse_value, read_constants

MAX_PATCH_BYTES = 1_000_000


def parse_sets(pairs: list[str], source: str, path: str) -> dict[str, str]:
    """`NAME=VALUE` pairs -> {NAME: value text}, each NAME checked against the file's constants."""
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
            raise AutoloopError(
                f"--set {name}: {path} has no UPPER_CASE constant {name}: use one of {', '.join(sorted(known)) or 'none'}"
            )
        parse_value(value)  # raises a clear error for text that is not a value
        sets[name] = value
    return sets


def seed_idea(config: Config, repo: Path, description: str, *, sets: list[str], patch: Path | None,
              priority: int = 0, tag: str | None = None) -> dict:
    from autoloop.store import Store

    repo = Path(repo)
    if not description.strip():
        raise AutoloopError("the idea needs a description: autoloop seed \"what to try\" [--set NAME=VALUE]")
    target = config.editable[0]
    sets_parsed = None
    if sets:
        path = repo / target
        if not path.exists():
            raise AutoloopError(f"{path} does not exist: --set edits constants of {target}; run from the project folder or pass --repo")
        sets_parsed = parse_sets(sets, path.read_text(), target)
    patch_text = None
    if patch is not None:
        if not patch.exists():
            raise AutoloopError(f"patch file {patch} does not exist: check the path")
        patch_text = patch.read_text()
        check = subprocess.run(["git", "apply", "--numstat", "-"], cwd=repo, input=patch_text.encode(), capture_output=True)
        if check.returncode != 0 or not check.stdout.strip():
            first = (check.stderr.decode().strip().splitlines() or ["it contains no changes"])[0]
            raise AutoloopError(f"{patch} is not a usable diff ({first}): make it with `git diff > {patch.name}`")
    db = Path(config.db) if Path(config.db).is_absolute() else repo / config.db
    store = Store(db)
    try:
        run_id = None
        if tag is not None:
            run = store.get_run(tag)
            if run is None:
                raise AutoloopError(f"no run tagged '{tag}' in {db}: seed without --tag to let any run take it")
            run_id = run["id"]
        return store.add_idea(description, run_id=run_id, sets=sets_parsed, patch=patch_text, priority=priority, source="human")
    finally:
        store.close()
