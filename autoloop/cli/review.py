"""The morning-review commands: log, show, diff, best, ablate, finalize, report, export.

Plain functions with typer annotations; `autoloop.cli` registers them. They only parse
options and call `autoloop.review.queries`, `autoloop.review.finalize`, `autoloop.review.report`,
`autoloop.review.export` and `autoloop.review.ablate`. Every one but `ablate` reads the db without
taking a write lock, so each works while a run is writing to it; `ablate` trains, so it
takes the run's lock like `autoloop run`. What they share with `autoloop.cli` lives in
`autoloop.cli.common`, so neither imports the other.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from autoloop.cli.common import echo, open_store, pick_run
from autoloop.errors import AutoloopError

RepoOpt = Annotated[Path, typer.Option("--repo", help="The git repository that holds train.py; the current folder by default.")]
DbOpt = Annotated[Optional[str], typer.Option("--db", help="The trial database, relative to the repository; experiments.db by default.")]
TagOpt = Annotated[Optional[str], typer.Option("--tag", "--run", help="The run's name; the most recent run by default.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of text, for scripts and agents.")]
NumberArg = Annotated[int, typer.Argument(help="The trial number, as `autoloop log` shows it.")]
RemeasureOpt = Annotated[bool, typer.Option("--remeasure/--no-remeasure", help="Re-measure the best at fresh seeds no decision used when it has not been (it trains; refused while the run is going), so the reported figure is not the selection mean.")]


def _headline(repo: Path, db: str | None, tag: str | None, remeasure: bool) -> str | None:
    """Measure the run's reserve when it lacks one (autoloop.review.remeasure); the note
    to print when it could not be."""
    if not remeasure:
        return None
    from autoloop.cli.display import Display
    from autoloop.review.remeasure import ensure_headline

    with _Session(repo, db, tag) as s:
        run = s.run
    return ensure_headline(repo, run, db=db, display=Display())


def _nothing_kept(repo: Path, db: str | None, tag: str | None, what: str) -> str | None:
    """The one line to print instead when the run kept no change (autoloop.review.nothing_kept)."""
    from autoloop.review.nothing_kept import nothing_kept_line

    with _Session(repo, db, tag) as s:
        return nothing_kept_line(s.store, s.run, what)


class _Session:
    """The store and the chosen run of one command, closed when the command ends."""

    def __init__(self, repo: Path, db: str | None, tag: str | None):

        self.store = open_store(repo, db)
        try:
            self.run = pick_run(self.store, tag)
        except BaseException:
            self.store.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.store.close()


def _dump(value) -> str:
    from autoloop.base.text import strip_controls_in

    return json.dumps(strip_controls_in(value), indent=1, default=str)


def log(
    repo: RepoOpt = Path("."),
    tag: TagOpt = None,
    db: DbOpt = None,
    last: Annotated[Optional[int], typer.Option(help="Show only the last N trials (the text view shows the last 50 by default).")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Show every trial in the text view, not only the last 50.")] = False,
    status_: Annotated[Optional[str], typer.Option("--status", help="Show only trials with these statuses, comma-separated (keep, discard, crash, timeout, invalid, interrupted, running).")] = None,
    kind: Annotated[Optional[str], typer.Option(help="Show only trials of these kinds, comma-separated (baseline, proposal, rerun, drift, ablation, repair, ladder).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print every matching trial as JSON (no default limit), for scripts and agents.")] = False,
):
    """List the trials of a run: what was tried, what was kept, and why."""
    from autoloop.review.queries import DEFAULT_LOG_LAST, count_trials, log_rows
    from autoloop.review.text import format_log

    with _Session(repo, db, tag) as s:
        if as_json:
            echo(_dump(log_rows(s.store, s.run, last=last, status=status_, kind=kind, extra=True)))
            return
        limit = last if last is not None else (None if all_ else DEFAULT_LOG_LAST)
        rows = log_rows(s.store, s.run, last=limit, status=status_, kind=kind)
        total = count_trials(s.store, s.run) if not (status_ or kind) else None
        echo(format_log(s.run, rows, total=total))


def show(
    number: NumberArg,
    repo: RepoOpt = Path("."),
    tag: TagOpt = None,
    db: DbOpt = None,
    lines: Annotated[int, typer.Option(help="How many lines of the trial's log to show.")] = 40,
    no_diff: Annotated[bool, typer.Option("--no-diff", help="Leave the diff out (see `autoloop diff N`).")] = False,
    as_json: JsonOpt = False,
):
    """Show one trial in full: every field, the evidence behind its decision, its diff and the tail of its log."""
    from autoloop.review.queries import trial_detail
    from autoloop.review.text import format_trial

    with _Session(repo, db, tag) as s:
        detail = trial_detail(s.store, s.run, number, repo, log_lines=max(lines, 0))
        echo(_dump(detail) if as_json else format_trial(detail, with_diff=not no_diff))


def diff(number: NumberArg, repo: RepoOpt = Path("."), tag: TagOpt = None, db: DbOpt = None):
    """Print a trial's diff against its parent, ready for `git apply`."""
    from autoloop.review.queries import trial_diff

    with _Session(repo, db, tag) as s:
        text, note = trial_diff(s.store, s.run, number, repo)
    if note:
        echo(note, err=True)
        return
    # On a terminal, stripped like every other output; piped, exact for `git apply` (click
    # would drop its CSI sequences unless told the output takes colour).
    if sys.stdout.isatty():
        echo(text, nl=not text.endswith("\n"))
    else:
        typer.echo(text, nl=not text.endswith("\n"), color=True)


def best(repo: RepoOpt = Path("."), tag: TagOpt = None, db: DbOpt = None, as_json: JsonOpt = False,
         remeasure: RemeasureOpt = True):
    """Show the best commit of a run, its val_bpb and gain re-measured at fresh seeds no decision used, its tier, and held-out val_bpb where verified."""
    from autoloop.review.queries import best_summary
    from autoloop.review.text import format_best

    nothing = _nothing_kept(repo, db, tag, "no gain to report and nothing to finalize")
    if nothing:  # the best is the baseline: no gain to re-measure, and finalize would make nothing
        with _Session(repo, db, tag) as s:
            info = best_summary(s.store, s.run)
        echo(_dump({**info, "nothing_kept": nothing}) if as_json else nothing)
        return
    note = _headline(repo, db, tag, remeasure)
    with _Session(repo, db, tag) as s:
        info = best_summary(s.store, s.run)
    if note:
        echo(note, err=True)
    echo(_dump(info) if as_json else format_best(info))


def finalize(
    repo: RepoOpt = Path("."),
    tag: TagOpt = None,
    db: DbOpt = None,
    branch: Annotated[Optional[str], typer.Option(help="The branch to create; final/<tag> by default. The run's own branch is never touched.")] = None,
    per_trial: Annotated[bool, typer.Option("--per-trial", help="One commit per kept trial instead of one squashed commit.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace the branch if it already exists.")] = False,
    checkout: Annotated[bool, typer.Option("--checkout", help="Check the new branch out afterwards (refused while the run is going or the worktree has uncommitted changes).")] = False,
    drop_null: Annotated[bool, typer.Option("--drop-null", help="Leave out the kept changes that the latest `autoloop ablate` found no benefit from (effect indistinguishable from zero, or harmful).")] = False,
    confirmed_only: Annotated[bool, typer.Option("--confirmed-only", help="Leave out the kept changes that were only adopted (the paired mean was lower, the sequential test did not confirm them): the branch holds confirmed gains only.")] = False,
    holds_at_scale: Annotated[bool, typer.Option("--holds-at-scale", help="Leave out the kept changes that the latest ladder rung (`autoloop ladder`, `run --ladder`) did not tag holds: the branch holds only the changes that survive the larger scale.")] = False,
    remeasure: RemeasureOpt = True,
    as_json: JsonOpt = False,
):
    """Make a clean branch from the run's base with its kept changes, and keep the best trial's checkpoint under .autoloop/<tag>/best/."""
    from autoloop.review.finalize import finalize as make_branch

    nothing = _nothing_kept(repo, db, tag, "nothing to finalize (no branch was made)")
    if nothing:
        echo(_dump({"branch": None, "nothing_kept": nothing}) if as_json else nothing)
        return
    note = _headline(repo, db, tag, remeasure)
    if note:
        echo(note, err=True)
    with _Session(repo, db, tag) as s:
        result = make_branch(s.store, s.run, repo, branch=branch, per_trial=per_trial, force=force, checkout=checkout,
                             drop_null=drop_null, confirmed_only=confirmed_only, holds_at_scale=holds_at_scale)
    if as_json:
        echo(_dump(result.to_dict()))
        return
    kind = f"{len(result.commits)} commits" if per_trial else "one commit"
    kept = _trials_words(result.trials, "kept trial")
    why = ("adopted, never confirmed" if confirmed_only else "did not hold at the larger scale" if holds_at_scale
           else "no benefit in the ablation")
    if result.dropped:
        echo(f"branch {result.branch} at {result.commit[:12]}: {kind} on base {result.base_commit[:12]} with "
                   f"{kept}, leaving out {_trials_words(result.dropped, 'trial')} ({why}); its tree "
                   f"is the best commit's ({result.best_commit[:12]}, trial {result.best_trial}) without "
                   f"{'it' if len(result.dropped) == 1 else 'them'}")
    else:
        echo(f"branch {result.branch} at {result.commit[:12]}: {kind} on base {result.base_commit[:12]} with "
                   f"{kept}; its tree is the best commit's ({result.best_commit[:12]}, trial {result.best_trial})")
    echo(f"checkpoint: {result.checkpoint}" if result.checkpoint else f"checkpoint: none ({result.checkpoint_note})")
    if result.checked_out:
        echo(f"checked out {result.branch}")
    else:
        echo(f"the worktree is unchanged: `git checkout {result.branch}` or `git push origin {result.branch}`")


def _trials_words(numbers: list[int], noun: str) -> str:
    """'kept trial 2', 'kept trials 2 and 4', 'kept trials 2, 4 and 7'."""
    shown = [str(n) for n in numbers]
    if len(shown) == 1:
        return f"{noun} {shown[0]}"
    return f"{noun}s {', '.join(shown[:-1])} and {shown[-1]}"


def ablate(
    repo: RepoOpt = Path("."),
    tag: TagOpt = None,
    db: DbOpt = None,
    seeds: Annotated[int, typer.Option(help="Seeds to measure each reverted commit (and the best commit) at.")] = 3,
    as_json: JsonOpt = False,
):
    """Measure what each kept change is worth: revert it from the best commit, train at the same seeds as the best, and mark changes whose effect is indistinguishable from zero as candidates to drop."""
    from autoloop.review.ablate import ablate_run, format_ablation
    from autoloop.cli.display import Display

    if seeds < 1:
        raise AutoloopError(f"--seeds {seeds} measures nothing: give 1 or more (3 by default)")
    nothing = _nothing_kept(repo, db, tag, "nothing to ablate")
    if nothing:
        echo(_dump({"rows": [], "nothing_kept": nothing}) if as_json else nothing)
        return
    with _Session(repo, db, tag) as s:
        run = s.run
    display = None if as_json else Display()
    result = ablate_run(repo, run, db=db, seeds=seeds, display=display, say=display.say if display else None)
    echo(_dump(result.to_dict()) if as_json else format_ablation(result))


def ladder(
    spec: Annotated[Optional[str], typer.Argument(help="The larger scale, e.g. 'DEPTH=8 MODEL_DIM=512', 'budget=4x' or both; the run's --ladder by default.")] = None,
    repo: RepoOpt = Path("."),
    tag: TagOpt = None,
    db: DbOpt = None,
    seeds: Annotated[Optional[int], typer.Option(help="Fresh seeds each commit is measured at (the run's ladder-seeds, 3 by default; 2 at least).")] = None,
    as_json: JsonOpt = False,
):
    """Re-measure the kept changes at a larger scale: the best, the baseline and the best with each kept change left out, at the same fresh seeds; tag each change holds, fades or reverses (an unfinished rung goes on where it stopped)."""
    from autoloop.review.ladder import format_rung, ladder_run
    from autoloop.cli.display import Display

    nothing = _nothing_kept(repo, db, tag, "nothing to ladder")
    if nothing:
        echo(_dump({"rows": [], "nothing_kept": nothing}) if as_json else nothing)
        return
    with _Session(repo, db, tag) as s:
        run = s.run
    stored = run.get("config") or {}
    spec = spec or stored.get("ladder")
    if not spec:
        raise AutoloopError(f"run '{run['tag']}' has no --ladder: name the scale, e.g. "
                            f"`autoloop ladder 'DEPTH=8 MODEL_DIM=512' --tag {run['tag']}`")
    display = None if as_json else Display()
    result = ladder_run(repo, run, spec, db=db, seeds=seeds or stored.get("ladder_seeds") or 3, display=display,
                        say=display.say if display else None)
    echo(_dump(result.to_dict()) if as_json else format_rung(result))


def report(
    repo: RepoOpt = Path("."),
    tag: TagOpt = None,
    db: DbOpt = None,
    out: Annotated[Optional[Path], typer.Option(help="The folder for report.html (its charts are inline); .autoloop/<tag>/report/ by default.")] = None,
    remeasure: RemeasureOpt = True,
):
    """Write a self-contained HTML report of a run (headline, progress chart, loss curves, kept changes, failures, ideas)."""
    from autoloop.review.report import build_report, default_out_dir

    note = _headline(repo, db, tag, remeasure)
    if note:
        echo(note, err=True)
    with _Session(repo, db, tag) as s:
        result = build_report(s.store, s.run, out if out is not None else default_out_dir(repo, s.run["tag"]))
    head = result.data["headline"]
    echo(f"wrote {result.html_path} ({head['trials']} trials, {head['kept']} kept; one self-contained file)")


def export(
    repo: RepoOpt = Path("."),
    tag: TagOpt = None,
    db: DbOpt = None,
    format_: Annotated[str, typer.Option("--format", help="tsv (autoresearch's results.tsv columns first), csv or json.")] = "tsv",
    out: Annotated[Optional[Path], typer.Option(help="Write to this file instead of standard output.")] = None,
):
    """Export a run's trials as TSV, CSV or JSON; the TSV reads in autoresearch's analysis notebook."""
    from autoloop.review.export import write_export

    left_out: list[int] = []
    with _Session(repo, db, tag) as s:
        text = write_export(s.store, s.run, format_, out, left_out)
    if left_out:
        trials = ", ".join(map(str, left_out))
        echo(f"note: trial {trials} (baseline attempts that failed before the measured baseline) left out: "
                   "autoresearch's notebook reads the first row as the baseline; --format csv has every trial", err=True)
    if out is None:
        echo(text, nl=False)
    else:
        echo(f"wrote {out}", err=True)
