"""The scale ladder: do the night's kept changes hold at a larger model or a longer budget?

A night tunes a small model in short runs; what the user carries to the real model are
the changes that survive scale. A rung (autoloop.decide.ladder: `"DEPTH=8 MODEL_DIM=512"`,
`budget=4x`, or both) is measured as `autoloop ablate` measures the final context, through
the run's own Controller (same sandbox, harness and seeds logic), at the larger scale:

1. **The commits at scale.** The baseline, the best, and the best with each kept change
   reverted (`reverse_applied`, as ablate does), each with the rung's constants set in
   train.py (as `seed --set` sets them), committed on top of the commit it scales and
   kept reachable under `refs/autoloop/<tag>/ladder/<n>`. Each is a `ladder` trial
   (derived_from: the baseline, the best, or the kept trial; decision: {rung, arm}).
2. **The runs.** Every commit at the same fresh seeds (`seed + 2_000_000 + k`, far from
   the decisions' and the reserve's), with the budget (seconds or steps) multiplied,
   role `ladder`: never in the run's noise, never in a decision. Seed by seed, so an
   interrupted rung has balanced pairs; a measurement already there is not run again, so
   a restart (or `autoloop ladder` again) finds the rung still `running` and goes on.
   With `--workers N` or Ray the runs go to all the run's workers at once, in the same
   order (autoloop.review.ladder_runs); the figures are the same either way.
3. **The figures.** Each kept change: its paired effect (with minus without, by seed) and
   its tag (holds / fades / reverses at the decisions' confidence; autoloop.decide.ladder),
   next to its effect at the night's scale (its latest ablation, else its keep's delta).
   The headline: the best minus the baseline at the rung, paired, with its interval.

The cost is said before the first run (runs x the night's median run x the budget
factor) and again once the baseline's first run at the rung has measured the larger
model's slowdown.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from autoloop.decide.ladder import DEFAULT_SEEDS, RungSpec, level_of, parse_spec, runs_needed, seconds_needed, tag_of
from autoloop.errors import AutoloopError
from autoloop.gitops import REF_PREFIX
from autoloop.loop.host import TrialHost
from autoloop.loop.noise import runs_of
from autoloop.review.ablate import NotRevertible, change_diff, effect_figures, kept_changes, reverse_applied
from autoloop.review.ladder_runs import measure_runs, rung_slots
from autoloop.store import Kind, Status, utcnow

ROLE = "ladder"
SEED_OFFSET = 2_000_000  # the reserve's seeds start at 1_000_000: the ladder's are fresh for both


def ladder_ref(tag: str, number: int) -> str:
    return f"{REF_PREFIX}{tag}/ladder/{int(number)}"


@dataclass
class Arm:
    """One commit measured at the rung."""

    arm: str  # baseline, best, or without
    source: dict  # the trial it scales (the baseline, the best, or the kept change)
    commit: str  # the commit it scales (before the rung's constants)
    files: dict  # what differs from `commit` besides the rung's constants (the reverted change)
    trial: dict | None = None  # its ladder trial
    sha: str | None = None
    reason: str | None = None  # why it was not measured


@dataclass
class TagRow:
    trial: int  # the kept trial
    description: str | None
    tag: str | None = None
    small_effect: float | None = None
    effect: float | None = None
    low: float | None = None
    high: float | None = None
    n: int = 0
    ladder_trial: int | None = None
    reason: str | None = None


@dataclass
class Rung:
    run: str
    spec: str
    rung_id: int
    seeds: list[int]
    best_trial: int
    status: str = "running"
    plan: dict = field(default_factory=dict)
    headline: dict | None = None
    rows: list[TagRow] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------- the commits at scale


def with_overrides(source: str, script: str, overrides: dict[str, str]) -> str:
    """train.py's text with the rung's constants set, each checked as `seed --set` checks it;
    a bad one is one line naming it and the fix."""
    from autoloop.proposers.seeding import parse_sets
    from autoloop.pyconst import parse_value, set_constants

    if not overrides:
        return source
    try:
        sets = parse_sets([f"{k}={v}" for k, v in overrides.items()], source, script)
    except AutoloopError as exc:
        raise AutoloopError(f"--ladder: {str(exc).removeprefix('--set ')}") from None
    return set_constants(source, {k: parse_value(v) for k, v in sets.items()}, path=script)


def check_spec(project_dir: Path | str, config, spec: str | None) -> None:
    """Refuse a --ladder whose constants train.py lacks (or cannot take) before the night
    starts, not after it."""
    parsed = parse_spec(spec)
    if parsed is None or not parsed.overrides:
        return
    script = next((a for a in config.train_argv()[1:] if a.endswith(".py")), None)
    path = Path(project_dir) / script if script else None
    if path is None or not path.is_file():
        return  # the run itself says what is wrong with its train command
    with_overrides(path.read_text(), script, parsed.overrides)


def scaled_files(git, commit: str, files: dict, script: str, overrides: dict[str, str]) -> dict:
    """`files` (what differs from `commit`) with the rung's constants set in train.py."""
    source = files.get(script)
    source = source.decode() if isinstance(source, bytes) else source
    if source is None:
        source = git.show_file(commit, script)
    return {**files, script: with_overrides(source, script, overrides).encode()}


def _script(controller: TrialHost) -> str:
    script = controller.train_script()
    if script is None:
        raise AutoloopError(f"the train command {controller.config.train_command!r} names no .py file, so the ladder "
                            "cannot set its constants: use a command like 'python train.py'")
    return script.resolve().relative_to(Path(controller.project_dir).resolve()).as_posix()


def _arms(controller: TrialHost, best: dict, best_commit: str, say) -> list[Arm]:
    store, git, run = controller.store, controller.repo, controller.run_row
    baseline = store.trials(run["id"], kind=Kind.BASELINE.value, status=Status.KEEP.value)
    if not baseline:
        raise AutoloopError(f"run '{run['tag']}' has no kept baseline: the ladder needs one to measure against")
    arms = [Arm("baseline", baseline[0], run["base_commit"], {}), Arm("best", best, best_commit, {})]
    for change in kept_changes(store, run, git, best_commit):
        arm = Arm("without", change, best_commit, {})
        try:
            _tree, arm.files = reverse_applied(git, best_commit, [change_diff(git, change)])
            if not arm.files:
                arm.reason = "reverting it changes nothing in the best commit (a later change undid it)"
        except NotRevertible as exc:
            arm.reason = str(exc)
        if arm.reason:
            say(f"trial {change['number']}: not laddered: {arm.reason}")
        arms.append(arm)
    return arms


def _describe(spec: RungSpec, arm: Arm) -> str:
    if arm.arm == "without":
        return f"ladder {spec.text}: the best without trial {arm.source['number']} ({arm.source.get('description') or '-'})"
    return f"ladder {spec.text}: the {arm.arm} (trial {arm.source['number']}) at scale"


def _trial_for(controller: TrialHost, rung: dict, spec: RungSpec, arm: Arm, script: str, seeds: list[int]) -> None:
    """The arm's ladder trial and commit: found (a resumed rung) or made."""
    store, git, run = controller.store, controller.repo, controller.run_row
    for t in store.trials(run["id"], kind=Kind.LADDER.value):
        d = t.get("decision") or {}
        if d.get("rung") == rung["id"] and d.get("arm") == arm.arm and t.get("derived_from") == arm.source["id"]:
            arm.trial, arm.sha = t, t["trial_commit"]
            if t["status"] != Status.RUNNING.value:
                store.update_trial(t["id"], status=Status.RUNNING)
            return
    files = scaled_files(git, arm.commit, arm.files, script, spec.overrides)
    trial = store.new_trial(run["id"], Kind.LADDER, description=_describe(spec, arm), proposer="ladder",
                            derived_from=arm.source["id"], parent_commit=arm.commit, seed=seeds[0],
                            started_at=utcnow(), decision={"rung": rung["id"], "arm": arm.arm, "spec": spec.text,
                                                           "kept_trial": arm.source["number"]})
    message = f"autoloop {run['tag']} ladder {trial['number']}: {_describe(spec, arm)}"
    sha = git.commit_files(arm.commit, files, message)
    git.set_ref(ladder_ref(run["tag"], trial["number"]), sha)
    store.update_trial(trial["id"], trial_commit=sha, diff=git.diff(arm.commit, sha))
    arm.trial, arm.sha = store.trial_by_id(trial["id"]), sha


# ---------------------------------------------------------------------------- cost


def median_run_seconds(store, run_id: int) -> float | None:
    rows = store.query("SELECT m.wall_seconds FROM measurements m JOIN trials t ON t.id = m.trial_id "
                       "WHERE t.run_id = ? AND m.status = 'ok' AND m.wall_seconds IS NOT NULL "
                       "AND COALESCE(m.role, '') != ?", (run_id, ROLE))
    walls = [float(r["wall_seconds"]) for r in rows if r["wall_seconds"]]
    return statistics.median(walls) if walls else None


def describe_plan(plan: dict) -> str:
    slow = plan.get("slowdown")
    text = (f"the ladder at {plan['spec']}: {plan['runs']} runs x {plan['run_seconds']:.1f} s x budget "
            f"{plan['budget_factor']:g}x x slowdown {('%.2f' % slow) if slow else '1 (not measured yet)'} "
            f"= about {plan['seconds'] / 60:.1f} min")
    workers = plan.get("workers") or 1
    if workers > 1:  # `seconds` is what the runs cost (GPU time); the night waits for the rounds
        text += f" of runs, about {plan['wall_seconds'] / 60:.1f} min on {workers} workers at once"
    return text


def _plan(spec: RungSpec, kept: int, seeds: int, run_seconds: float | None, slowdown: float | None,
          workers: int = 1) -> dict:
    per_run = run_seconds or 0.0

    def cost(on: int) -> float:
        return seconds_needed(kept, seeds, run_seconds=per_run, budget_factor=spec.budget_factor,
                              slowdown=slowdown or 1.0, workers=on)

    return {"spec": spec.text, "runs": runs_needed(kept, seeds), "run_seconds": per_run,
            "budget_factor": spec.budget_factor, "slowdown": slowdown, "seconds": cost(1),
            "workers": workers, "wall_seconds": cost(workers)}


# ---------------------------------------------------------------------------- the rung


def scaled_config(config, spec: RungSpec, slack_seconds: float):
    """The run's config with the budget multiplied and a grace that lets the larger runs finish."""
    steps = config.max_steps
    return dataclasses.replace(
        config, time_budget=config.time_budget * spec.budget_factor,
        max_steps=max(1, round(steps * spec.budget_factor)) if steps is not None else None,
        grace_seconds=max(config.grace_seconds, slack_seconds))


def ladder(controller: TrialHost, spec: RungSpec | str, *, seeds: int = DEFAULT_SEEDS, say=None) -> Rung:
    """Measure one rung for the controller's run (the controller is open: it holds the
    run's lock). Returns the rung; its figures are in ladder_rungs and ladder_tags."""
    from autoloop.review.queries import best_trial

    spec = parse_spec(spec) if isinstance(spec, str) else spec
    if spec is None:
        raise AutoloopError("no ladder spec: give one like --ladder \"DEPTH=8 MODEL_DIM=512\" or --ladder budget=4x")
    if seeds < 2:
        raise AutoloopError(f"--ladder-seeds {seeds} cannot tell a change from noise: give 2 or more (3 by default)")
    store, run = controller.store, controller.run_row
    say = say or (lambda message: None)
    best = best_trial(store, run)
    best_commit = controller.best_commit()
    if best is None or best.get("trial_commit") != best_commit:
        raise AutoloopError(f"run '{run['tag']}' has no measured best commit yet: let its baseline finish first")
    script = _script(controller)
    arms = _arms(controller, best, best_commit, say)
    kept = [a for a in arms if a.arm == "without"]
    if not kept:
        raise AutoloopError(f"run '{run['tag']}' kept no change over its baseline: there is nothing to ladder")
    measured = [a for a in arms if a.reason is None]
    with_overrides(controller.repo.show_file(best_commit, script), script, spec.overrides)  # refused before any record

    same = [r for r in store.rungs(run["id"]) if r["spec"] == spec.text and r["best_commit"] == best_commit
            and len(r.get("seeds") or []) == seeds]
    if same and same[-1]["status"] == "done":  # measured already: its figures stand, nothing is trained again
        say(f"the ladder at {spec.text} was measured already for this best commit (rung {same[-1]['id']})")
        return stored_rung(store, run, same[-1])
    rung = same[-1] if same else None
    seed_list = [controller.config.seed + SEED_OFFSET + k for k in range(seeds)]
    run_seconds = median_run_seconds(store, run["id"])
    if rung is None:
        plan = _plan(spec, len(measured) - 2, seeds, run_seconds, None)
        rung = store.add_rung(run["id"], spec.text, overrides=spec.overrides, budget_factor=spec.budget_factor,
                              seeds=seed_list, best_trial_id=best["id"], best_commit=best_commit, plan=plan,
                              status="running")
        say(describe_plan(plan))
        store.add_event(run["id"], "ladder", describe_plan(plan))
    else:
        seed_list = list(rung["seeds"] or seed_list)
        store.update_rung(rung["id"], status="running", reason=None)
        say(f"the ladder at {spec.text}: resuming its unfinished rung")
    result = Rung(run=run["tag"], spec=spec.text, rung_id=rung["id"], seeds=seed_list, best_trial=best["number"],
                  plan=dict(rung.get("plan") or {}))
    for a in measured:
        _trial_for(controller, rung, spec, a, script, seed_list)

    original = controller.config
    slack = 4.0 * (run_seconds or original.time_budget) * spec.budget_factor * 4.0
    failed: dict[int, str] = {}
    interrupted = False
    workers = 1

    def record(a: Arm, seed: int, m) -> bool:
        """One run read back (in the main thread, whichever slot trained it); True: start nothing more."""
        nonlocal interrupted
        if _get(m, "status") == "aborted" or controller.abort_requested:
            interrupted = True
            return True
        if _get(m, "status") not in (None, "ok") or _get(m, "metric") is None:
            failed[a.trial["id"]] = f"failed at seed {seed} at the larger scale: {_get(m, 'reason')}"
        wall = _wall(store, a.trial, _get(m, "id"))
        if a.arm == "baseline" and seed == seed_list[0] and run_seconds and wall:
            slowdown = wall / (run_seconds * spec.budget_factor)
            result.plan = _plan(spec, len(measured) - 2, seeds, run_seconds, slowdown, workers)
            store.update_rung(rung["id"], plan=result.plan)
            say(describe_plan(result.plan))
        return False

    # Seed by seed, so an interrupted rung has balanced pairs; a run already recorded is not run again.
    queue = [(a, seed) for seed in seed_list for a in measured if seed not in runs_of(store, a.trial, (ROLE,))]
    with rung_slots(controller, say) as slots:  # the run's workers, or None: the serial slot
        if slots and len(slots) > 1 and rung.get("plan"):  # the plan's wall time, now that the workers are known
            workers = len(slots)
            result.plan = _plan(spec, len(measured) - 2, seeds, run_seconds, result.plan.get("slowdown"), workers)
            store.update_rung(rung["id"], plan=result.plan)
            say(describe_plan(result.plan))
        controller.config = scaled_config(original, spec, slack)  # every job reads it as it is built
        try:
            measure_runs(controller, slots, queue, skip=lambda a: a.trial["id"] in failed, record=record, role=ROLE)
        finally:
            controller.config = original
            controller.converge_git()
    _finish_trials(controller, measured, failed, interrupted)
    if interrupted:
        store.update_rung(rung["id"], status="interrupted", reason="interrupted by the user")
        result.status = "interrupted"
        return result
    _figures(controller, rung, spec, arms, seed_list, result)
    say(describe_rung(result))
    return result


def _wall(store, trial: dict, measurement_id: int | None) -> float | None:
    """The wall seconds of one recorded run (the row the measurer wrote)."""
    row = next((m for m in store.measurements(trial["id"]) if m["id"] == measurement_id), None)
    return float(row["wall_seconds"]) if row and row.get("wall_seconds") else None


def _get(measurement, name: str):
    return measurement.get(name) if isinstance(measurement, dict) else getattr(measurement, name, None)


def _finish_trials(controller: TrialHost, measured: list[Arm], failed: dict[int, str], interrupted: bool) -> None:
    store = controller.store
    for a in measured:
        runs = runs_of(store, a.trial, (ROLE,))
        walls = sum(m.get("wall_seconds") or 0.0 for m in store.measurements(a.trial["id"])) or None
        mean = sum(runs.values()) / len(runs) if runs else None
        if a.trial["id"] in failed:
            status, reason = Status.CRASH, failed[a.trial["id"]]
        elif interrupted:
            status, reason = Status.INTERRUPTED, "interrupted by the user"
        else:
            status, reason = Status.DISCARD, f"measured at the rung: {len(runs)} runs"
        store.update_trial(a.trial["id"], status=status, reason=reason, metric=mean, n_runs=len(runs),
                           wall_seconds=walls, finished_at=utcnow())
        a.trial = store.trial_by_id(a.trial["id"])


def small_effect(store, run_id: int, kept: dict) -> float | None:
    """A kept change's effect at the night's scale: its latest ablation's, else its keep's delta."""
    ablations = [t for t in store.trials(run_id, kind=Kind.ABLATION.value)
                 if t.get("derived_from") == kept["id"] and (t.get("decision") or {}).get("effect") is not None]
    if ablations:
        return float(ablations[-1]["decision"]["effect"])
    return kept.get("delta")


def _figures(controller: TrialHost, rung: dict, spec: RungSpec, arms: list[Arm], seeds: list[int], result: Rung) -> None:
    from autoloop.decide.rule import paired_effect

    store, run = controller.store, controller.run_row
    level = level_of(controller.decision_config().alpha)
    by_arm = {a.arm: a for a in arms if a.arm != "without"}
    best_runs = runs_of(store, by_arm["best"].trial, (ROLE,))
    base_runs = runs_of(store, by_arm["baseline"].trial, (ROLE,))
    if set(best_runs) & set(base_runs):
        delta, low, high = paired_effect(best_runs, base_runs, None, level)
        finite = lambda x: x if x == x and abs(x) != float("inf") else None  # noqa: E731
        result.headline = {"delta": delta, "low": finite(low), "high": finite(high), "level": level,
                           "n": len(set(best_runs) & set(base_runs)),
                           "best": sum(best_runs.values()) / len(best_runs),
                           "baseline": sum(base_runs.values()) / len(base_runs)}
    for a in (a for a in arms if a.arm == "without"):
        row = TagRow(trial=a.source["number"], description=a.source.get("description"),
                     small_effect=small_effect(store, run["id"], a.source))
        result.rows.append(row)
        if a.reason is not None:
            row.reason = a.reason
            continue
        row.ladder_trial = a.trial["number"]
        without = runs_of(store, a.trial, (ROLE,))
        if not set(best_runs) & set(without) or a.trial["status"] != Status.DISCARD.value:
            row.reason = a.trial.get("reason") or "not measured at the rung"
            continue
        f = effect_figures(best_runs, without, None, kept_trial=row.trial, level=level)
        row.effect, row.low, row.high, row.n = f["effect"], f["low"], f["high"], f["n"]
        row.tag = tag_of(row.effect, row.low, row.high)
        store.set_ladder_tag(rung["id"], a.source["id"], ladder_trial_id=a.trial["id"], tag=row.tag,
                             small_effect=row.small_effect, effect=row.effect, low=row.low, high=row.high, n=row.n,
                             level=level)
        store.update_trial(a.trial["id"], reason=f"at {spec.text}, trial {row.trial}'s change {row.tag}: "
                                                 f"{_effect_words(row)}")
    result.status = "done"
    store.update_rung(rung["id"], status="done", finished_at=utcnow(),
                      result={"headline": result.headline, "rows": [asdict(r) for r in result.rows]})
    store.add_event(run["id"], "ladder", describe_rung(result))


# ---------------------------------------------------------------------------- words


def _effect_words(row: TagRow) -> str:
    interval = (f"{row.low:+.4f}..{row.high:+.4f}" if row.low is not None and row.high is not None else "unbounded")
    return f"effect {row.effect:+.4f} ({interval}, {row.n} paired runs)"


def describe_headline(spec: str, headline: dict | None) -> str:
    if not headline:
        return f"at {spec}: the best and the baseline have no pair of runs"
    interval = (f", {headline['level']:.0%} interval {headline['low']:+.4f}..{headline['high']:+.4f}"
                if headline.get("low") is not None else "")
    return (f"at {spec}: the best is worth {headline['delta']:+.4f} bpb over the baseline "
            f"({headline['best']:.4f} vs {headline['baseline']:.4f}, best minus baseline{interval})")


def describe_rung(rung: Rung) -> str:
    lines = [describe_headline(rung.spec, rung.headline)]
    for r in rung.rows:
        if r.tag:
            small = f"{r.small_effect:+.4f}" if r.small_effect is not None else "-"
            lines.append(f"  trial {r.trial} {r.tag}: {_effect_words(r)}; at the night's scale {small}"
                         f" ({_cut(r.description, 50)})")
        else:
            lines.append(f"  trial {r.trial}: no tag: {r.reason} ({_cut(r.description, 50)})")
    return "\n".join(lines)


def format_rung(rung: Rung) -> str:
    lines = [f"ladder of run '{rung.run}' at {rung.spec}: the best (trial {rung.best_trial}), the baseline and each "
             f"kept change left out, at seeds {', '.join(map(str, rung.seeds))}",
             f"{'trial':>5} {'tag':>8} {'effect':>9} {'interval':>19} {'n':>3} {'small':>9}  change"]
    for r in rung.rows:
        small = f"{r.small_effect:+.4f}" if r.small_effect is not None else "-"
        if r.tag:
            interval = f"{r.low:+.4f}..{r.high:+.4f}" if r.low is not None and r.high is not None else "unbounded"
            lines.append(f"{r.trial:>5} {r.tag:>8} {r.effect:>+9.4f} {interval:>19} {r.n:>3} {small:>9}  "
                         f"{_cut(r.description, 50)}")
        else:
            lines.append(f"{r.trial:>5} {'-':>8} {'-':>9} {'-':>19} {'-':>3} {small:>9}  {_cut(r.description, 50)}: "
                         f"{r.reason}")
    lines.append(describe_headline(rung.spec, rung.headline))
    lines.append("effect = val_bpb with the change minus without it at the rung, paired by seed (negative: it helps); "
                 "small = the same at the night's scale")
    return "\n".join(lines)


def _cut(text: str | None, width: int) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= width else text[: width - 1] + "…"


# ---------------------------------------------------------------------------- the command's pieces


def ladder_run(repo: Path, run: dict, spec: str, *, db: str | None = None, seeds: int = DEFAULT_SEEDS, display=None,
               say=None, **controller_options) -> Rung:
    """`autoloop ladder`: open the run's controller with the run's own config (as `autoloop
    ablate` does: its lock, so refused while the run is going), measure the rung, and leave
    the run's status as it was."""
    import signal

    from autoloop.loop.controller import Controller
    from autoloop.review.ablate import run_config

    parsed = parse_spec(spec)
    if parsed is None:
        raise AutoloopError("no ladder spec: give one like \"DEPTH=8 MODEL_DIM=512\" or budget=4x")
    controller = Controller(run_config(repo, run, db), repo, display=display, **controller_options)
    previous_handlers = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous_handlers[sig] = signal.signal(sig, controller.on_signal)
        except ValueError:  # not the main thread
            pass
    try:
        controller.open()
        try:
            previous = run.get("status")
            try:
                return ladder(controller, parsed, seeds=seeds, say=say)
            finally:
                if previous is not None:
                    controller.store.update_run(controller.run_row["id"], status=previous)
        finally:
            controller.close()
    finally:
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)


def stored_rung(store, run: dict, row: dict) -> Rung:
    """A rung as the db holds it (its figures once done)."""
    best = store.trial_by_id(row["best_trial_id"]) if row.get("best_trial_id") else None
    result = row.get("result") or {}
    return Rung(run=run["tag"], spec=row["spec"], rung_id=row["id"], seeds=list(row.get("seeds") or []),
                best_trial=best["number"] if best else 0, status=row["status"], plan=row.get("plan") or {},
                headline=result.get("headline"), rows=[TagRow(**r) for r in result.get("rows") or []])


def latest_rungs(store, run: dict) -> list[Rung]:
    """The run's latest finished rung of each spec, in the order they were first measured."""
    latest: dict[str, dict] = {}
    for row in store.rungs(run["id"]):
        if row["status"] == "done":
            latest[row["spec"]] = row
    return [stored_rung(store, run, row) for row in latest.values()]


def latest_tags(store, run_id: int) -> dict[int, dict]:
    """{kept trial id: its tag row at the run's latest finished rung, with the rung's spec}."""
    done = [r for r in store.rungs(run_id) if r["status"] == "done"]
    if not done:
        return {}
    rung = done[-1]
    return {t["kept_trial_id"]: {**t, "spec": rung["spec"]} for t in store.ladder_tags(rung["id"])}
