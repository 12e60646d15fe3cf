"""`autoloop ablate`: what each kept change is worth in the final result.

A run keeps a chain of changes, each judged against the incumbent of its day. Later
changes can make an earlier one redundant, and a keep can be a lucky draw. So, after
the night, each kept change is taken out of the best commit on its own and the result
is measured against the best at the same seeds:

1. **The kept changes** are the kept trials of kind proposal or repair whose commits lie
   on the path from the run's base to its best commit, in trial order.
2. **Revert** a change: its diff (the trial row's `diff`, else `git diff parent..commit`)
   is applied in reverse to the best commit's tree in a temporary index (`git apply
   --cached -R`), so the worktree, the real index and the branch are untouched. Where
   only neighbouring lines changed since (another constant tuned later), the change's
   own lines are matched without their context (`-C0`). A change that no longer reverts
   cleanly (a later change rewrote the same lines) is skipped with git's reason. The reverted tree is committed through `GitRepo.commit_files` on
   top of the best commit and kept reachable under `refs/autoloop/<tag>/ablations/<n>`.
3. **Record** an `ablation` trial (derived_from = the kept trial, parent = the best
   commit, trial commit = the reverted one), then **measure** both sides at the same K
   seeds (the run's seed sequence) through the controller
   (`Controller.measure_commit`): the reverted commit as role `ablation` on the ablation
   trial, the best commit as role `incumbent` on the best trial (a seed the best already
   has is not trained again, so K ablations share the best's K runs).
4. **Effect** = `paired_effect(best runs, ablated runs)` (autoloop.decide.rule): val_bpb with
   the change minus without it, paired by seed, with a 95% interval from the run's pooled
   noise (or the pairs' own spread before the noise is measured). Negative: the change
   helps. An interval that contains 0 marks the change `null`, a candidate to drop; one
   entirely above 0 means the change hurts in the final context (also a candidate to
   drop: `drop`). The figures go into the ablation trial's `decision`:
   {effect, low, high, n, null, drop, level, kept_trial, seeds}.

The ablation trial's status is `discard` (the branch never moves to it); if the reverted
commit fails to train, the trial is a `crash` whose reason says that later changes need
this one. `autoloop finalize --drop-null` leaves out the changes whose latest ablation
marked them `drop` (see autoloop.review.finalize); `show`, `log` and the report show the
figures.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from autoloop.decide.effects import ablation_effect, ablation_verdict, format_interval
from autoloop.errors import AutoloopError
from autoloop.gitops import REF_PREFIX, GitRepo
from autoloop.loop.noise import runs_of
from autoloop.store import Kind, Status, utcnow
from autoloop.loop.host import TrialHost

DEFAULT_SEEDS = 3
LEVEL = 0.95
REVERTABLE_KINDS = (Kind.PROPOSAL.value, Kind.REPAIR.value)


class NotRevertible(Exception):
    """The change no longer reverts cleanly from the commit (the reason is git's)."""


# ---------------------------------------------------------------------------- git


def ablation_ref(tag: str, number: int) -> str:
    return f"{REF_PREFIX}{tag}/ablations/{int(number)}"


def change_diff(git: GitRepo, trial: dict) -> str:
    """The change a trial made: its stored diff, else recomputed from its commits."""
    if trial.get("diff"):
        return trial["diff"]
    parent, commit = trial.get("parent_commit"), trial.get("trial_commit")
    if parent and commit and git.commit_exists(parent) and git.commit_exists(commit):
        return git.diff(parent, commit)
    return ""


def _git_bytes(git: GitRepo, *args: str, env: dict | None = None, stdin: bytes | None = None) -> bytes:
    done = subprocess.run(["git", *args], cwd=git.project_dir, env={**os.environ, **(env or {})}, input=stdin,
                          capture_output=True)
    if done.returncode != 0:
        raise NotRevertible(done.stderr.decode(errors="replace").strip() or f"git {args[0]} failed")
    return done.stdout


def reverse_applied(git: GitRepo, commit: str, diffs: list[str]) -> tuple[str, dict[str, bytes | None]]:
    """(tree, files): `commit`'s tree with each diff applied in reverse, in the order
    given, in a temporary index; `files` maps every path that differs from `commit` to
    its new content (None: deleted), as `GitRepo.commit_files` takes it. Raises
    NotRevertible with git's reason when a diff does not reverse-apply cleanly."""
    tmpdir = tempfile.mkdtemp(prefix="autoloop-ablate-")
    try:
        env = {"GIT_INDEX_FILE": os.path.join(tmpdir, "index")}
        _git_bytes(git, "read-tree", commit, env=env)
        for diff in diffs:
            if not diff.strip():
                raise NotRevertible("the trial recorded no diff")
            text = diff if diff.endswith("\n") else diff + "\n"
            apply = ["apply", "--cached", "-R", "--whitespace=nowarn"]
            try:
                _git_bytes(git, *apply, "-", env=env, stdin=text.encode())
            except NotRevertible as exc:
                # A neighbouring line changed since (the constant on the next line was tuned
                # later): the change's own lines must still match exactly, its context need
                # not. A merge (`git revert`) would call adjacent edits a conflict.
                try:
                    _git_bytes(git, *apply, "-C0", "-", env=env, stdin=text.encode())
                except NotRevertible:
                    first = str(exc).splitlines()[0] if str(exc) else "git apply failed"
                    raise NotRevertible(f"it no longer reverts cleanly ({first})") from None
        tree = _git_bytes(git, "write-tree", env=env).decode().strip()
        names = _git_bytes(git, "diff", "--cached", "--name-only", "--no-renames", "-z", commit, env=env).decode()
        files: dict[str, bytes | None] = {}
        for path in filter(None, names.split("\0")):
            staged = _git_bytes(git, "ls-files", "-s", "-z", "--", path, env=env).decode().strip("\0")
            if not staged:
                files[path] = None
                continue
            blob = staged.split()[1]
            files[path] = _git_bytes(git, "cat-file", "blob", blob, env=env)
        return tree, files
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def kept_changes(store, run: dict, git: GitRepo, best_commit: str) -> list[dict]:
    """The kept proposals and repairs on the path from the run's base to `best_commit`,
    in trial order (full rows)."""
    base = run.get("base_commit")
    return [t for t in store.trials(run["id"], status=Status.KEEP.value)
            if t["kind"] in REVERTABLE_KINDS and t.get("trial_commit") and t["trial_commit"] != base
            and git.commit_exists(t["trial_commit"]) and git.is_ancestor(t["trial_commit"], best_commit)]


# ---------------------------------------------------------------------------- figures


def effect_figures(best_runs: dict[int, float], ablated_runs: dict[int, float], noise, *, kept_trial: int,
                   level: float = LEVEL) -> dict:
    """The ablation trial's decision: the paired effect of the change (best minus best
    without it) over the seeds both sides have, its interval, and the verdicts."""
    from autoloop.decide.rule import paired_effect

    effect, low, high = paired_effect(best_runs, ablated_runs, noise, level)
    seeds = sorted(set(best_runs) & set(ablated_runs))
    finite = lambda x: x if math.isfinite(x) else None  # an unbounded interval (one pair, no noise) is stored as null
    null = low <= 0.0 <= high
    return {"effect": effect, "low": finite(low), "high": finite(high), "n": len(seeds), "null": null,
            "drop": null or low > 0.0, "level": level, "kept_trial": kept_trial, "seeds": seeds,
            "noise_pair_sd": getattr(noise, "pair_sd", None), "noise_df": getattr(noise, "df", None)}


# ---------------------------------------------------------------------------- the ablation


@dataclass
class AblationRow:
    trial: int  # the kept trial whose change is reverted
    description: str | None
    ablation: int | None = None  # the ablation trial's number (None: skipped)
    commit: str | None = None
    ref: str | None = None
    status: str = "skipped"
    reason: str | None = None
    effect: float | None = None
    low: float | None = None
    high: float | None = None
    n: int = 0
    null: bool | None = None
    drop: bool | None = None


@dataclass
class Ablation:
    run: str
    best_trial: int
    best_commit: str
    seeds: list[int]
    rows: list[AblationRow] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _get(measurement, name: str):
    """A measurement's field, whether the controller returns an object or a row."""
    return measurement.get(name) if isinstance(measurement, dict) else getattr(measurement, name, None)


def _ok(measurement) -> bool:
    return _get(measurement, "status") in (None, "ok") and _get(measurement, "metric") is not None


def ablate(controller: TrialHost, *, seeds: int = DEFAULT_SEEDS, say=None) -> Ablation:
    """Ablate every kept change of the controller's run (the controller is open: it holds
    the run's lock). Returns the table; the figures are in the ablation trials."""
    if seeds < 1:
        raise AutoloopError(f"--seeds {seeds} measures nothing: give 1 or more (3 by default)")
    from autoloop.review.queries import best_trial

    store, git, run = controller.store, controller.repo, controller.run_row
    say = say or (lambda message: None)
    best = best_trial(store, run)
    best_commit = controller.best_commit()
    if best is None or best.get("trial_commit") != best_commit:
        raise AutoloopError(f"run '{run['tag']}' has no measured best commit yet: let its baseline finish first")
    changes = kept_changes(store, run, git, best_commit)
    if not changes:
        raise AutoloopError(f"run '{run['tag']}' kept no change over its baseline: there is nothing to ablate")
    seed_list = controller.seeds(seeds)
    result = Ablation(run=run["tag"], best_trial=best["number"], best_commit=best_commit, seeds=seed_list)
    try:
        for change in changes:
            row = AblationRow(trial=change["number"], description=change.get("description"))
            result.rows.append(row)
            try:
                _tree, files = reverse_applied(git, best_commit, [change_diff(git, change)])
            except NotRevertible as exc:
                row.reason = str(exc)
            else:
                if not files:
                    row.reason = "reverting it changes nothing in the best commit (a later change undid it)"
            if row.reason:
                store.add_event(run["id"], "ablation", f"trial {change['number']} not ablated: {row.reason}")
                say(f"trial {change['number']}: skipped: {row.reason}")
                continue
            _ablate_one(controller, best, best_commit, change, files, seed_list, row, say)
            if controller.abort_requested:
                break
    finally:
        controller.converge_git()
    return result


def _ablate_one(controller: TrialHost, best: dict, best_commit: str, change: dict, files: dict, seeds: list[int],
                row: AblationRow, say) -> None:
    store, git, run = controller.store, controller.repo, controller.run_row
    label = change.get("description") or "(no description)"
    trial = store.new_trial(
        run["id"], Kind.ABLATION, description=f"ablation: trial {change['number']} reverted ({label})",
        proposer="ablate", derived_from=change["id"], parent_commit=best_commit, best_before=best["metric"],
        seed=seeds[0], started_at=utcnow(),
    )
    message = f"autoloop {run['tag']} ablation {trial['number']}: the best commit without trial {change['number']}"
    sha = git.commit_files(best_commit, files, message)
    ref = ablation_ref(run["tag"], trial["number"])
    git.set_ref(ref, sha)
    store.update_trial(trial["id"], trial_commit=sha, diff=git.diff(best_commit, sha))
    trial = store.trial_by_id(trial["id"])
    row.ablation, row.commit, row.ref, row.status = trial["number"], sha, ref, Status.RUNNING.value
    say(f"trial {trial['number']}: the best commit without trial {change['number']} ({label}), at {len(seeds)} seeds")

    failure = None
    for seed in seeds:
        if seed not in controller.incumbent_runs(best):
            m = controller.measure_commit(best_commit, seed, owner=best, role="incumbent", for_trial=trial)
            if _get(m, "status") == "aborted" or controller.abort_requested:
                failure = (Status.INTERRUPTED, "interrupted by the user")
                break
            if not _ok(m):
                failure = (Status.CRASH, f"the best commit failed at seed {seed}: {_get(m, 'reason')}")
                break
        m = controller.measure_commit(sha, seed, owner=trial, role="ablation")
        if _get(m, "status") == "aborted" or controller.abort_requested:
            failure = (Status.INTERRUPTED, "interrupted by the user")
            break
        if not _ok(m):
            failure = (Status.CRASH, f"without trial {change['number']}'s change the code fails at seed {seed} "
                                     f"({_get(m, 'reason')}): later changes need it")
            break
    measured = store.measurements(trial["id"])
    fields = {"wall_seconds": sum(m.get("wall_seconds") or 0.0 for m in measured) or None,
              "finished_at": utcnow()}
    if failure is not None:
        status, reason = failure
        store.update_trial(trial["id"], status=status, reason=reason, **fields)
        row.status, row.reason = status.value, reason
        say(f"trial {trial['number']}: {reason}")
        return

    from autoloop.decide.rule import estimate

    noise = controller.update_noise()
    best_runs, ablated = controller.incumbent_runs(best), runs_of(store, trial, ("ablation",))
    figures = effect_figures(best_runs, ablated, noise, kept_trial=change["number"])
    mean, se = estimate(list(ablated.values()), noise)
    best_mean = sum(best_runs[s] for s in figures["seeds"]) / len(figures["seeds"])
    a = ablation_effect({"decision": figures})
    reason = (f"effect of trial {change['number']}'s change: {figures['effect']:+.4f} "
              f"({format_interval(figures['low'], figures['high'], LEVEL) or 'interval unbounded'}, "
              f"{figures['n']} paired runs): {ablation_verdict(a)}")
    store.update_trial(trial["id"], status=Status.DISCARD, reason=reason, metric=mean, metric_sd=se,
                       n_runs=len(ablated), delta=mean - best_mean, decision=figures, **fields)
    row.status, row.reason = Status.DISCARD.value, reason
    row.effect, row.low, row.high, row.n, row.null, row.drop = (
        figures["effect"], figures["low"], figures["high"], figures["n"], figures["null"], figures["drop"])
    say(f"trial {trial['number']}: {reason}")


# ---------------------------------------------------------------------------- the command's pieces


def ablate_run(repo: Path, run: dict, *, db: str | None = None, seeds: int = DEFAULT_SEEDS, display=None, say=None,
               **controller_options) -> Ablation:
    """`autoloop ablate`: open the run's controller with the run's own config (it takes
    the run's lock, so this is refused while `autoloop run` is going), ablate, and leave
    the run's status as it was. `controller_options` go to Controller (e.g.
    `verifier=None` for a fake training script)."""
    import signal

    from autoloop.loop.controller import Controller

    if seeds < 1:
        raise AutoloopError(f"--seeds {seeds} measures nothing: give 1 or more (3 by default)")
    controller = Controller(run_config(repo, run, db), repo, display=display, **controller_options)
    previous_handlers = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:  # Ctrl-C stops the current measurement cleanly, as in `autoloop run`
            previous_handlers[sig] = signal.signal(sig, controller.on_signal)
        except ValueError:  # not the main thread
            pass
    try:
        controller.open()
        try:
            previous = run.get("status")
            try:
                return ablate(controller, seeds=seeds, say=say)
            finally:
                if previous is not None:  # ablating is not running: a finished run stays finished
                    controller.store.update_run(controller.run_row["id"], status=previous)
        finally:
            controller.close()
    finally:
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)


def run_config(repo: Path, run: dict, db: str | None = None):
    """The Config the run was started with (its stored config, so the measurements use
    the run's budget, seed and dataset), for the run's tag."""
    from autoloop.config import Config, resolve

    base = resolve(repo, {"tag": run["tag"], "db": db})
    known = {f.name for f in dataclasses.fields(Config)}
    stored = {k: v for k, v in (run.get("config") or {}).items()
              if k in known and k not in ("tag", "db", "max_trials", "hours") and v is not None}
    return dataclasses.replace(base, **stored)


def format_ablation(result: Ablation) -> str:
    lines = [f"ablation of run '{result.run}': each kept change reverted from the best commit "
             f"(trial {result.best_trial}, {result.best_commit[:12]}), measured at seeds "
             f"{', '.join(map(str, result.seeds))}",
             f"{'trial':>5} {'effect':>9} {'95% interval':>19} {'n':>3} {'ablation':>8}  change / verdict"]
    for r in result.rows:
        if r.effect is not None:
            interval = f"{r.low:+.4f}..{r.high:+.4f}" if r.low is not None and r.high is not None else "unbounded"
            verdict = "candidate to drop" if r.drop else "helps"
            if r.drop and not r.null:
                verdict = "hurts: candidate to drop"
            lines.append(f"{r.trial:>5} {r.effect:>+9.4f} {interval:>19} {r.n:>3} {r.ablation:>8}  "
                         f"{_cut(r.description, 50)}: {verdict}")
        else:
            lines.append(f"{r.trial:>5} {'-':>9} {'-':>19} {'-':>3} {r.ablation or '-':>8}  "
                         f"{_cut(r.description, 50)}: {r.status}: {r.reason}")
    lines.append("effect = val_bpb with the change minus without it, paired by seed (negative: the change helps)")
    drops = [r.trial for r in result.rows if r.drop]
    if drops:
        lines.append(f"candidates to drop: trial {', '.join(map(str, drops))}; `autoloop finalize --drop-null` "
                     "leaves them out")
    return "\n".join(lines)


def _cut(text: str | None, width: int) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= width else text[: width - 1] + "…"
