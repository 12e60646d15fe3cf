"""`autoloop search-plan`: what the built-in search would tune in train.py, and how.

It reads the working tree's training script (no run, no db) so a user can check the
hint comments before a night's run. The main CLI registers it with
`app.command("search-plan")(search_plan)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from autoloop.config import resolve
from autoloop.errors import AutoloopError
from autoloop.proposers.search import target_path
from autoloop.proposers.search_space import GROUP_LABELS, explain_space


def search_plan(
    repo: Annotated[
        Path, typer.Option(help="The git repository that holds train.py; the current folder by default.")
    ] = Path("."),
    max_steps: Annotated[
        Optional[int],
        typer.Option(help="Show the plan for step mode (runs with --max-steps), where speed knobs are not searched."),
    ] = None,
) -> None:
    """Show which constants of train.py the search proposer tunes, in its order of attack, and how each moves."""
    config = resolve(repo, {"max_steps": max_steps})
    path = target_path(config)
    script = Path(repo) / path
    if not script.exists():
        raise AutoloopError(f"{script} does not exist: run this in the repository that holds {path}, or pass --repo")
    try:
        params, skipped = explain_space(script.read_text(), step_mode=bool(config.max_steps), path=path)
    except SyntaxError as exc:
        raise AutoloopError(f"{path} does not parse (line {exc.lineno}: {exc.msg}): fix it first") from None
    mode = "step mode" if config.max_steps else "time budget"
    typer.echo(f"search plan for {path} ({mode}): {len(params)} constants, in this order")
    width = max((len(p.name) for p in params), default=0)
    for i, param in enumerate(params, 1):
        typer.echo(f"{i:>3}. {param.name:<{width}}  {param.source:<10}  {GROUP_LABELS[param.group]}: {param.summary()}")
    if skipped:
        typer.echo("not searched:")
        for name, why in skipped:
            typer.echo(f"     {name}: {why}")
