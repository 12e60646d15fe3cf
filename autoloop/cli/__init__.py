"""The `autoloop` command line: it parses options and calls the library, nothing more.

Errors a user can cause (`AutoloopError`) are printed as one line, without a
traceback, and the command exits with status 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from autoloop.cli.common import config_for, echo, explicit_tag, handles_errors, open_store, pick_run, run_settings
from autoloop.errors import AutoloopError
from autoloop.base.text import strip_controls_in

app = typer.Typer(
    help="autoloop: an autonomous, verified research loop over train.py. "
    "It proposes an edit, trains for a fixed budget, keeps it if val_bpb improved, and logs every trial.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Help text is plain text: with rich markup, `pip install -e '.[ray]'` would print as 'autoloop'.
    rich_markup_mode=None,
)

RepoOpt = Annotated[Path, typer.Option("--repo", help="The git repository that holds train.py; the current folder by default.")]
DbOpt = Annotated[Optional[str], typer.Option("--db", help="The trial database, relative to the repository; experiments.db by default.")]
TagOpt = Annotated[Optional[str], typer.Option("--tag", help="The run's name; the most recent run by default.")]


def _print_version(value: bool) -> None:
    if value:
        from autoloop import __version__

        echo(f"autoloop {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print autoloop's version and exit.")] = False,
) -> None:
    """autoloop: an autonomous, verified research loop over train.py."""


# ---------------------------------------------------------------------------- run


@app.command()
@handles_errors
def run(
    repo: RepoOpt = Path("."),
    tag: Annotated[Optional[str], typer.Option(help="The run's name: it works on branch autoloop/<tag>. Today's date (e.g. nov29) by default; an existing tag resumes that run.")] = None,
    db: DbOpt = None,
    max_trials: Annotated[Optional[int], typer.Option(help="Stop after this many trials in this invocation, the baseline included (0: only recover a run left by a dead controller, then stop).")] = None,
    hours: Annotated[Optional[float], typer.Option(help="Stop before starting a trial that could not finish within this many hours.")] = None,
    time_budget: Annotated[Optional[float], typer.Option(help="Seconds of timed training per trial (300 by default).")] = None,
    max_steps: Annotated[Optional[int], typer.Option(help="Train each trial for this many optimizer steps instead of a time budget (deterministic).")] = None,
    grace_seconds: Annotated[Optional[float], typer.Option(help="Seconds allowed on top of the budget for start-up, compilation and evaluation before a trial is killed.")] = None,
    proposers: Annotated[Optional[str], typer.Option(help="Comma-separated proposer chain, asked in order, e.g. 'ideas,search'.")] = None,
    keep_margin: Annotated[Optional[float], typer.Option(help="With --decision-rule strict: keep a trial only if it beats the best val_bpb by more than this.")] = None,
    decision_rule: Annotated[Optional[str], typer.Option(help="'two-tier' (default: adopt when the paired mean at the incumbent's seeds is lower, confirmed when the sequential test says so; docs/decisions.md), 'confirmed-only' (only confirmed changes move the branch, alpha 0.2), 'paired' (the same at alpha 0.05) or 'strict' (one run, lower wins).")] = None,
    baseline_seeds: Annotated[Optional[int], typer.Option(help="Seeds the baseline runs at: the first measure of the noise (3 by default).")] = None,
    max_runs: Annotated[Optional[int], typer.Option(help="Most runs of one candidate before it is discarded as not distinguishable (5 by default).")] = None,
    alpha: Annotated[Optional[float], typer.Option(help="Null proposals confirmed per proposal that changes nothing (0.05 by default; 0.2 under confirmed-only).")] = None,
    reserve_seeds: Annotated[Optional[int], typer.Option(help="Fresh seeds no decision used at which the night's best is re-measured for the reported figures (4 by default, fewer in a short night; 0: none).")] = None,
    no_early_stop: Annotated[bool, typer.Option("--no-early-stop", help="Never stop a clear loser's run early (by default it is stopped once the night's own curves calibrate the rule).")] = False,
    drift_every: Annotated[Optional[int], typer.Option(help="Re-measure the incumbent every N trials to catch a drifting machine (10 by default; 0: never).")] = None,
    requeue_near_misses: Annotated[Optional[bool], typer.Option("--requeue-near-misses", help="Try a discard that was within the noise once more after the incumbent changes.")] = None,
    seed: Annotated[Optional[int], typer.Option(help="The training seed passed to every trial.")] = None,
    dataset: Annotated[Optional[str], typer.Option(help="A prepared dataset name or folder (see `autoloop prepare`); the embedded corpus by default.")] = None,
    train_command: Annotated[Optional[str], typer.Option(help="The training command, run in the repository; 'python train.py' by default.")] = None,
    allow_env_change: Annotated[Optional[bool], typer.Option("--allow-env-change", help="Resume even if the GPU, torch version, data or harness changed (recorded in the run).")] = None,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Do not verify keep candidates in a fresh process (not recommended).")] = False,
    no_check: Annotated[bool, typer.Option("--no-check", help="Skip `autoloop check` (overfit one batch, LR range test, budget plan) before a new run's baseline.")] = False,
    no_sandbox: Annotated[bool, typer.Option("--no-sandbox", help="Run trials without the bubblewrap sandbox (recorded on the run; not recommended).")] = False,
    llm_model: Annotated[Optional[str], typer.Option(help="Model name for the llm proposer (an OpenAI-compatible API); setting it adds the llm to the default chain.")] = None,
    llm_base_url: Annotated[Optional[str], typer.Option(help="Base URL of the OpenAI-compatible API (vLLM, Ollama, OpenRouter, ...); OPENAI_BASE_URL by default.")] = None,
    agent_command: Annotated[Optional[str], typer.Option(help="A coding-agent command (e.g. 'claude -p'); setting it adds the agent proposer to the default chain.")] = None,
    max_cost: Annotated[Optional[float], typer.Option(help="Stop the run before its next trial would take its spending past this many US dollars: model tokens at llm-prices, GPU time at gpu-hour-price.")] = None,
    workers: Annotated[Optional[int], typer.Option(help="Train this many trials at once, one per GPU, each in its own git worktree (the local executor; on a CPU machine, pretend devices). 0: one per visible GPU.")] = None,
    executor: Annotated[Optional[str], typer.Option(help="'serial' (default, one trial at a time), 'local' (one worker per GPU of this machine) or 'ray' (one per GPU of a Ray cluster; pip install -e '.[ray]').")] = None,
    ray_address: Annotated[Optional[str], typer.Option(help="With --executor ray: the cluster to join ('auto', 'ray://head:10001'); none starts a local one.")] = None,
    search_mode: Annotated[Optional[str], typer.Option(help="With several workers: 'shared' (default, every worker from the one best commit) or 'islands' (a lineage per worker, the best migrating).")] = None,
    migrate_every: Annotated[Optional[int], typer.Option(help="Islands: the best lineage migrates to the others every N trials (10 by default; 0: never).")] = None,
    allow_mixed_devices: Annotated[Optional[bool], typer.Option("--allow-mixed-devices", help="Allow workers on different GPU models; each candidate is then compared with the incumbent measured on its own kind.")] = None,
    notify: Annotated[Optional[str], typer.Option(help="A shell command run on events (a keep, a confirmed gain, a pause, a lost worker, the end of the run), the event as JSON on stdin; killed after --notify-timeout seconds, and never slows the run (docs/serve.md).")] = None,
    notify_timeout: Annotated[Optional[float], typer.Option(help="Seconds a --notify command may take before it is killed (10 by default).")] = None,
    memory_db: Annotated[Optional[str], typer.Option(help="Another experiments.db of this project (another clone's or machine's) whose runs the proposers remember, beside every earlier tag of this db: what was tried, kept and discarded; an edit discarded there on the same parent is not proposed again unless seeded.")] = None,
    ladder: Annotated[Optional[str], typer.Option(help="A larger scale the kept changes are re-measured at when the night ends, e.g. 'DEPTH=8 MODEL_DIM=512', 'budget=4x' or both: each kept change is tagged holds, fades or reverses there (docs/review.md); its cost is planned into --hours.")] = None,
    ladder_seeds: Annotated[Optional[int], typer.Option(help="Fresh seeds each commit is measured at on the ladder (3 by default, 2 at least).")] = None,
    ladder_every: Annotated[Optional[int], typer.Option(help="With --ladder: also measure the ladder after every K-th kept change, during the night (serial runs; 0 by default: at the end only).")] = None,
    schedule: Annotated[Optional[str], typer.Option(help="'chain' (default: the proposers in order, the first answer wins) or 'yield' (seeded ideas first, the search re-tunes after a model's structural keep and takes a model's constant-only answers, each source's share of proposals following its yield per GPU-minute; docs/search.md).")] = None,
):
    """Run the research loop: baseline first, then proposals, until a stop condition."""
    from autoloop.loop.controller import Controller
    from autoloop.cli.display import Display
    config = config_for(
        repo, tag=tag, db=db, max_trials=max_trials, hours=hours, time_budget=time_budget, max_steps=max_steps,
        grace_seconds=grace_seconds, proposers=proposers, keep_margin=keep_margin, decision_rule=decision_rule,
        baseline_seeds=baseline_seeds, max_runs=max_runs, alpha=alpha, drift_every=drift_every,
        reserve_seeds=reserve_seeds, early_stop=False if no_early_stop else None,
        requeue_near_misses=requeue_near_misses, seed=seed, dataset=dataset,
        train_command=train_command, allow_env_change=allow_env_change, verify=False if no_verify else None,
        sandbox="off" if no_sandbox else None, check=False if no_check else None, llm_model=llm_model, llm_base_url=llm_base_url, agent_command=agent_command, max_cost=max_cost,
        workers=workers, executor=executor or ("local" if workers and workers > 0 and executor is None else None),
        ray_address=ray_address, search_mode=search_mode, migrate_every=migrate_every,
        allow_mixed_devices=allow_mixed_devices, notify=notify, notify_timeout=notify_timeout, memory_db=memory_db,
        ladder=ladder, ladder_seeds=ladder_seeds, ladder_every=ladder_every,
        schedule=schedule,
    )
    from autoloop.proposers.memory import memory_db_path
    from autoloop.review.ladder import check_spec

    memory_db_path(config, repo)  # a --memory-db that is no file: refused before the night starts
    check_spec(repo, config, config.ladder)  # a bad spec is refused before the night, not after it
    display = Display()
    # Printed with the first thing the run says: a run that fails before it starts prints its error alone.
    display.later(f"autoloop run '{config.tag}' on branch autoloop/{config.tag} ({config.db})", "bold")
    controller = Controller(config, repo, display=display)
    if config.ladder and config.ladder_every:
        controller.ladder_hook = ladder_hook(config, display)
    summary = controller.run()
    for text, style in end_lines(summary, config.tag):
        display.say(text, style)
    nothing = None
    if summary.trials_run and not summary.paused:
        nothing = _nothing_kept_after_run(repo, config.db, config.tag)
        if nothing:  # the README's next steps (ablate, finalize) would only say this again
            display.say(nothing, "yellow")
    if config.ladder and ladder_at_the_end(summary) and not (nothing or _nothing_kept_after_run(repo, config.db, config.tag)):
        _ladder_after_run(repo, config, display)
    if summary.paused:
        raise typer.Exit(3)


def end_lines(summary, tag: str) -> list[tuple[str, str | None]]:
    """The last lines of `autoloop run` (text, style): why it stopped, the trials (the
    baseline counted apart), and baseline -> best as one pair, signed as everywhere
    (autoloop.decide.figures): the re-measured best once it has been, never a selection
    mean beside a re-measured gain."""
    from autoloop.decide.figures import baseline_to_best, counts_text, pair_text

    lines: list[tuple[str, str | None]] = [
        (f"stopped: {summary.stop_reason}", "bold"),
        (f"this invocation ran {summary.trials_run} trial(s); the run has {counts_text(summary.counts or summary.statuses)}",
         None)]
    pair = baseline_to_best(summary.baseline_metric, summary.best_metric, summary.headline)
    if pair is not None:
        lines.append((f"{pair_text(pair)}; best at {(summary.best_commit or '')[:12]} (branch autoloop/{tag})", "green"))
    return lines


def ladder_at_the_end(summary) -> bool:
    """The ladder runs after a night that ended by its limit, as the reserve does (not
    after Ctrl-C, `autoloop stop` or a pause: the next `autoloop run` or `autoloop ladder`
    measures it, and an unfinished rung goes on where it stopped). A stop that came while the
    reserve re-measured the best counts too: the night's limit was reached, the user's stop
    came after it."""
    return not (summary.paused or summary.stopped)


def ladder_hook(config, display):
    """`--ladder-every K`: the rung the loop measures after every K-th keep, on its own controller."""
    from autoloop.review.ladder import ladder

    return lambda controller: ladder(controller, config.ladder, seeds=config.ladder_seeds,
                                     say=display.say if display else None)


def _ladder_after_run(repo: Path, config, display) -> None:
    from autoloop.review.ladder import ladder_run

    store = open_store(repo, config.db)
    try:
        run_row = store.get_run(config.tag)
    finally:
        store.close()
    ladder_run(repo, run_row, config.ladder, db=config.db, seeds=config.ladder_seeds, display=display,
               say=display.say)


def _nothing_kept_after_run(repo: Path, db: str, tag: str) -> str | None:
    from autoloop.review.nothing_kept import nothing_kept_line

    store = open_store(repo, db)
    try:
        run_row = store.get_run(tag)
        return nothing_kept_line(store, run_row, "nothing to ablate or finalize") if run_row else None
    finally:
        store.close()


@app.command()
@handles_errors
def stop(repo: RepoOpt = Path("."), tag: TagOpt = None, db: DbOpt = None):
    """Ask a running `autoloop run` to stop after its current trial."""
    store = open_store(repo, db)
    run_row = pick_run(store, tag)
    store.request_stop(run_row["tag"])
    typer.echo(f"asked run '{run_row['tag']}' to stop after its current trial")


@app.command()
@handles_errors
def status(repo: RepoOpt = Path("."), tag: TagOpt = None, db: DbOpt = None,
           as_json: Annotated[bool, typer.Option("--json", help="Print the status as JSON.")] = False):
    """Show what is running (its step, loss and time left), and the best so far."""
    from autoloop.review.queries import run_status

    store = open_store(repo, db)
    info = run_status(store, pick_run(store, tag), repo)
    if as_json:
        echo(json.dumps(strip_controls_in(info), indent=1, default=str))
        return
    from autoloop.review.text import format_status

    echo(format_status(info))


@app.command()
@handles_errors
def check(
    repo: RepoOpt = Path("."),
    tag: Annotated[Optional[str], typer.Option(help="Store the result on this run (runs.check_result); the most recent run by default, if the repository has one.")] = None,
    db: DbOpt = None,
    hours: Annotated[Optional[float], typer.Option(help="Plan for a night of this many hours: how many training runs fit.")] = None,
    time_budget: Annotated[Optional[float], typer.Option(help="Seconds of timed training per trial to plan for (300 by default).")] = None,
    max_steps: Annotated[Optional[int], typer.Option(help="Plan for this many optimizer steps per trial instead of a time budget.")] = None,
    dataset: Annotated[Optional[str], typer.Option(help="A prepared dataset name or folder; the embedded corpus by default.")] = None,
    parts: Annotated[str, typer.Option(help="Comma-separated parts to run: overfit, lr, budget, device, and model (one request to the configured LLM endpoint, the agent command found; not run by default).")] = "overfit,lr,budget,device",
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole result as JSON at the end.")] = False,
):
    """Check train.py before a night: overfit one batch, LR range test, budget plan, device health."""
    from autoloop.check import PARTS, run_check, store_result

    chosen = tuple(p.strip() for p in parts.split(",") if p.strip())
    unknown = [p for p in chosen if p not in PARTS + ("model",)]
    if unknown:
        raise AutoloopError(f"unknown check part {', '.join(unknown)}: use some of {', '.join(PARTS + ('model',))}")
    if "model" in chosen:  # before bed: the model the night will ask, tried as `autoloop run` tries it
        from autoloop.proposers.base import check_models

        check_models(config_for(repo, db=db), say=typer.echo)
        chosen = tuple(p for p in chosen if p != "model")
        if not chosen:
            return
    config = config_for(repo, db=db)
    # The run the result is stored on is the run it plans for: its own budget, not the default.
    planned = run_settings(repo, config.db, explicit_tag(tag))
    given = {"hours": hours, "time_budget": time_budget, "max_steps": max_steps, "dataset": dataset}
    if planned and time_budget is None and max_steps is None:
        given.update(time_budget=planned.get("time_budget"), max_steps=planned.get("max_steps"))
    for name in ("hours", "dataset"):
        if planned and given[name] is None:
            given[name] = planned.get(name)
    config = config_for(repo, db=db, **given)
    if planned and (time_budget, max_steps) == (None, None):
        budget = f"{config.max_steps} steps" if config.max_steps else f"{config.time_budget:g} s"
        typer.echo(f"planning for run '{planned['tag']}': {budget} per trial (--time-budget or --max-steps to plan "
                   "for another budget)")
    data_dir = None
    if config.dataset:
        from autoloop.prepare import resolve_data_dir

        data_dir = resolve_data_dir(config.dataset)
    result = run_check(repo, time_budget=config.time_budget, max_steps=config.max_steps, hours=config.hours,
                       parts=chosen, data_dir=data_dir, say=typer.echo)
    stored = store_result(repo, config.db, explicit_tag(tag), result)
    typer.echo(f"check took {result['seconds']:.0f} s; result in {Path(repo) / '.autoloop' / 'check' / 'check.json'}"
               + (f" and on run '{stored}'" if stored else ""))
    if as_json:
        typer.echo(json.dumps(result, indent=1, default=str))
    if not result["ok"]:
        raise typer.Exit(1)


# ---------------------------------------------------------------------------- ideas


@app.command()
@handles_errors
def seed(
    description: Annotated[str, typer.Argument(help="What the idea is, in a sentence; it becomes the trial's description.")],
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="NAME=VALUE: set an UPPER_CASE constant of train.py (repeatable).")] = None,
    patch: Annotated[Optional[Path], typer.Option(help="A unified diff (git diff format, UTF-8, at most 1 MB) against train.py at the current best.")] = None,
    priority: Annotated[int, typer.Option(help="Higher priorities are tried first; ties go oldest first.")] = 0,
    repo: RepoOpt = Path("."),
    tag: Annotated[Optional[str], typer.Option(help="Only this run may take the idea (a run not started yet gets it when `autoloop run --tag` starts it); any run by default.")] = None,
    db: DbOpt = None,
):
    """Queue an idea for the loop; a running loop picks it up at its next proposal.

    It is checked now, with the loop's own rules, against the current best commit (of the --tag run, else the most recent run, else HEAD): a bad idea is refused in one line instead of failing at night.
    """
    from autoloop.proposers.seeding import seed_idea, text_only_wait

    config = config_for(repo, db=db)
    idea = seed_idea(config, repo, description, sets=set_ or [], patch=patch, priority=priority, tag=explicit_tag(tag))
    echo(f"seeded idea {idea['id']}: {description}")
    if idea.get("run_tag"):
        echo(f"run '{idea['run_tag']}' is not started yet: the idea waits for `autoloop run --tag {idea['run_tag']}`")
    waiting = text_only_wait(config, repo, idea)
    if waiting:
        echo(waiting)


@app.command()
@handles_errors
def ideas(repo: RepoOpt = Path("."), db: DbOpt = None,
          as_json: Annotated[bool, typer.Option("--json", help="Print the ideas as JSON.")] = False,
          cancel: Annotated[Optional[int], typer.Option(help="Cancel the pending idea with this number: it stays listed, marked cancelled, and is never proposed.")] = None,
          memory_db: Annotated[Optional[str], typer.Option(help="Another experiments.db of this project: a pending idea tried there (or in any run of this db) says so, with its outcome.")] = None):
    """List the seeded ideas and what became of them (--cancel N to cancel one)."""
    from autoloop.proposers.seeding import waiting_reason
    from autoloop.review.text import format_ideas

    store = open_store(repo, db)
    if cancel is not None:
        idea = store.cancel_idea(cancel)
        echo(f"cancelled idea {idea['id']}: {idea['text']}")
        return
    rows = store.ideas()
    waiting = waiting_reason(config_for(repo, db=db), store.runs())
    for idea in rows:  # why a pending idea is not taken, where it is known
        idea["waiting"] = waiting if idea["status"] == "pending" and not (idea.get("sets") or idea.get("patch")) else None
    from autoloop.proposers.memory import earlier_trials, memory_db_path, tried_before, tried_before_text

    earlier = earlier_trials(store, None, memory_db_path(config_for(repo, db=db, memory_db=memory_db), repo))
    for idea in rows:  # a pending idea already tried in some run of the project says so
        before = tried_before(idea, earlier) if idea["status"] == "pending" else None
        idea["tried_before"] = tried_before_text(before) if before else None
    echo(json.dumps(strip_controls_in(rows), indent=1, default=str) if as_json else format_ideas(store, rows))


def _register_commands() -> None:
    """Commands that live in their own modules (the morning review, dataset preparation)."""
    from autoloop.cli import review as cli_review
    from autoloop.cli.prepare import prepare
    from autoloop.cli.search import search_plan

    app.command("log")(handles_errors(cli_review.log))
    app.command("show")(handles_errors(cli_review.show))
    app.command("diff")(handles_errors(cli_review.diff))
    app.command("best")(handles_errors(cli_review.best))
    app.command("finalize")(handles_errors(cli_review.finalize))
    app.command("ablate")(handles_errors(cli_review.ablate))
    app.command("ladder")(handles_errors(cli_review.ladder))
    app.command("report")(handles_errors(cli_review.report))
    app.command("export")(handles_errors(cli_review.export))
    app.command("prepare")(handles_errors(prepare))
    app.command("search-plan")(handles_errors(search_plan))
    from autoloop.cli.serve import serve  # the [serve] extra is imported only when the command runs

    app.command("serve")(handles_errors(serve))


_register_commands()


def main() -> None:
    from autoloop.base.openmp import apply_openmp_defaults

    apply_openmp_defaults()  # before anything imports torch: `autoloop check` trains in this process
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
