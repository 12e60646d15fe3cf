"""What every command module shares: the error wrapper, the config, the store and the run.

`autoloop.cli` and the command modules beside it (`cli.review`, `cli.prepare`,
`cli.search`) import from here, never from each other's internals, so there is no import
cycle between them.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import typer

from autoloop.errors import AutoloopError


def echo(text: str, **kwargs) -> None:
    """typer.echo for text that may quote a trial or a model (a reason, a log's tail, a
    description): without control characters but newline and tab (autoloop.base.text),
    so that a row or a log written before they were stripped on the way in prints clean."""
    from autoloop.base.text import strip_controls

    typer.echo(strip_controls(text), **kwargs)


def handles_errors(command):
    """Turn a user-fixable error into one line on stderr and exit status 1."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except AutoloopError as exc:
            echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None

    return wrapper


def config_for(repo: Path, **flags):
    from autoloop.config import resolve

    return resolve(repo, flags)


def open_store(repo: Path, db: str | None):
    from autoloop.store import Store

    config = config_for(repo, db=db)
    path = Path(config.db)
    path = path if path.is_absolute() else repo / path
    if not path.exists():
        raise AutoloopError(f"no trial database at {path}: start a run with `autoloop run`, or point --db at one")
    return Store(path)


def explicit_tag(tag: str | None) -> str | None:
    return tag or os.environ.get("AUTOLOOP_TAG") or None


def pick_run(store, tag: str | None) -> dict:
    """The run named by --tag (or AUTOLOOP_TAG), else the most recent one."""
    from autoloop.review.queries import pick_run as pick

    return pick(store, explicit_tag(tag))


def run_settings(repo: Path, db: str, tag: str | None) -> dict:
    """The stored settings of run `tag` (else the most recent run) with its tag, or {}
    when the repository has no db or no such run: what `autoloop check` plans for."""
    from autoloop.store import Store

    path = Path(db)
    path = path if path.is_absolute() else Path(repo) / path
    if not path.exists():
        return {}
    store = Store(path)
    try:
        run = store.get_run(tag) if tag else (store.runs() or [None])[-1]
    finally:
        store.close()
    if run is None:
        return {}
    return {**(run.get("config") or {}), "tag": run["tag"]}
