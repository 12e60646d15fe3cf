"""One trial, end to end, in the order that keeps every crash recoverable.

1. A proposal is materialized from its parent (the best commit, or its lineage's) and
   validated; an invalid one becomes an `invalid` row with nothing committed.
2. The trial row is written `running` with the parent and the edits (the intent).
3. The commit is created through a temporary index (the worktree is untouched), its sha
   and diff go into the row, and only then does the branch move to it (when the trial
   trains in the project folder itself: the serial slot).
4. Training runs in its own process group; its pgid, pid and start time go into the row
   before the controller waits on it (autoloop.measure.measurer).
5. It is measured as often as its decision needs (`compare`: paired with the incumbent at
   the same seeds and machine speed, autoloop.decide.rule, autoloop.loop.noise); a trial
   the decision would keep is first verified in a fresh process (causality, re-evaluated
   val_bpb, held-out), and the verified values decide (`verify_keep`).
6. `finish`: the decision and the run's new best commit are written in one transaction
   (the db is the truth), then git is made to agree: a kept commit stays on the branch;
   any other is archived under refs/autoloop/<tag>/trials/<n> and the branch is reset.

Each window is reachable by fault injection (autoloop.base.faults). Recovery after a dead
controller is autoloop.loop.recovery; a full disk anywhere here, autoloop.loop.disk.

The trial's code gets its context as an argument, a `TrialContext`: the slot its
measurements run on, the lineage it advances (islands mode) and, once its measurements
begin, the incumbent it is compared with. Nothing here depends on the calling thread:
with several workers each trial runs this same code in a thread of its own. What threads
share is owned elsewhere, each with its lock: git refs and finishes (`Controller.refs_lock`),
the noise (autoloop.loop.noise), the re-queue (autoloop.loop.islands), the pending pause
(autoloop.loop.run).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

from autoloop.decide.rule import DecisionConfig, estimate
from autoloop.errors import is_disk_full
from autoloop.base import faults
from autoloop.loop.compare import compare, guard_on, judge_drift, verify_keep
from autoloop.loop.noise import runs_of
from autoloop.loop.outcome import (  # noqa: F401 - TrialContext and TrialOutcome are the trial's names too
    TrialContext,
    TrialOutcome,
    delete_checkpoints,
    interrupted,
    measured_outcome,
    progress_curve,
    trial_fields,
)
from autoloop.measure.runner import gpu_busy_report
from autoloop.proposers.proposal import InvalidProposal, Proposal, materialize, validate
from autoloop.store import IdeaStatus, Kind, Status, utcnow
from autoloop.loop.host import TrialHost


def _metric(trial: dict | None) -> float | None:
    return trial["metric"] if trial else None


# ---------------------------------------------------------------------------- starting one


def common_fields(c: TrialHost, ctx: TrialContext, proposal: Proposal | None = None) -> dict:
    # An LLM/agent proposal carries the hash of the program.md it was written from.
    program_hash = (proposal.meta.get("program_hash") if proposal else None) or program_md_hash(c.project_dir)
    fields = {"seed": c.config.seed, "program_hash": program_hash, "started_at": utcnow()}
    if ctx.worker is not None:
        fields["worker"] = ctx.worker
    if ctx.lineage:
        fields["lineage"] = ctx.lineage
    return fields


def program_md_hash(project_dir: Path) -> str | None:
    path = project_dir / "program.md"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.exists() else None


def record_proposal_calls(c: TrialHost, proposal: Proposal, trial_id: int) -> None:
    """Tokens, cost and latency of the calls that produced the proposal, now that its trial exists."""
    for call in proposal.meta.get("calls", ()):
        c.store.add_proposal_record(run_id=c.run_row["id"], trial_id=trial_id, **call)
    if proposal.meta.get("transcript"):
        c.event("transcript", f"{proposal.source}: {proposal.meta['transcript']}", trial_id=trial_id)


def record_invalid(c: TrialHost, ctx: TrialContext, proposal: Proposal, parent: str, reason: str, kind: Kind,
                   derived_from=None) -> dict:
    trial = c.store.new_trial(
        c.run_row["id"], kind, status=Status.INVALID, reason=reason, description=proposal.description,
        proposer=proposal.source, idea_id=proposal.idea_id, parent_commit=parent, edits=json.loads(proposal.to_json()),
        model=proposal.model, derived_from=derived_from, best_before=_metric(c.islands.incumbent(ctx.lineage)),
        **common_fields(c, ctx, proposal),
    )
    c.store.update_trial(trial["id"], status=Status.INVALID)  # stamps finished_at
    record_proposal_calls(c, proposal, trial["id"])
    if proposal.idea_id:
        c.store.set_idea_status(proposal.idea_id, IdeaStatus.DONE, trial_id=trial["id"])
    c.say(f"trial {trial['number']} invalid: {reason}", "red")
    return c.store.trial_by_id(trial["id"])


def invalid_reason(exc: Exception) -> str:
    """One line for a proposal that could not be materialized or validated."""
    if isinstance(exc, InvalidProposal):
        return str(exc)
    text = " ".join(str(exc).split())[:300]
    return f"the proposal cannot be applied: {type(exc).__name__}" + (f": {text}" if text else "")


def execute_proposal(c: TrialHost, ctx: TrialContext, proposal: Proposal, parent: str, *, derived_from=None,
                     kind=Kind.PROPOSAL) -> dict:
    pctx = c.proposal_context(parent, lineage=ctx.lineage)
    if proposal.meta.get("invalid"):
        # The proposer already judged it (an LLM answer still unusable after repairs, a duplicate).
        return record_invalid(c, ctx, proposal, parent, proposal.meta["invalid"], kind, derived_from)
    try:
        files = materialize(proposal, str(c.project_dir), parent, pctx.read_parent_file)
        changed = validate(files, pctx.read_parent_file, editable=c.config.editable, protected=c.config.protected)
    except Exception as exc:  # whatever the cause, an unusable proposal is one invalid trial
        if is_disk_full(exc):
            raise
        return record_invalid(c, ctx, proposal, parent, invalid_reason(exc), kind, derived_from)
    trial = c.store.new_trial(
        c.run_row["id"], kind, description=proposal.description, proposer=proposal.source,
        idea_id=proposal.idea_id, parent_commit=parent, edits=json.loads(proposal.to_json()), model=proposal.model,
        derived_from=derived_from, best_before=_metric(c.islands.incumbent(ctx.lineage)),
        **common_fields(c, ctx, proposal),
    )
    record_proposal_calls(c, proposal, trial["id"])
    if proposal.idea_id:
        c.store.set_idea_status(proposal.idea_id, IdeaStatus.TAKEN, trial_id=trial["id"])
    faults.fault_point("after_row")
    message = f"autoloop {c.tag} trial {trial['number']}: {proposal.description}"
    with c.refs_lock:
        sha = c.repo.commit_files(parent, changed, message)
        c.store.update_trial(trial["id"], trial_commit=sha, diff=c.repo.diff(parent, sha))
    faults.fault_point("after_commit")
    if ctx.moves_branch:  # a worker checks the commit out in its own worktree
        c.checkout(sha)
    return train_and_decide(c, ctx, c.store.trial_by_id(trial["id"]))


def execute_rerun(c: TrialHost, ctx: TrialContext, kind: Kind, reason: str, derived_from=None) -> dict:
    """A trial of the best commit itself: the baseline, a circuit-breaker re-run, a drift check."""
    best = c.best_commit()
    trial = c.store.new_trial(
        c.run_row["id"], kind, description=reason, proposer="controller", parent_commit=best,
        trial_commit=best, derived_from=derived_from, best_before=_metric(c.islands.incumbent(ctx.lineage)),
        **common_fields(c, ctx),
    )
    faults.fault_point("after_row")
    if ctx.moves_branch:
        c.converge_git()
    return train_and_decide(c, ctx, c.store.trial_by_id(trial["id"]))


# ---------------------------------------------------------------------------- measure and decide


def train_and_decide(c: TrialHost, ctx: TrialContext, trial: dict) -> dict:
    """Measure the trial as often as its decision needs, then keep or discard it."""
    trial_dir = c.trial_dir(trial["number"])
    if not c.store.measurements(trial["id"]) and trial_dir.exists():
        shutil.rmtree(trial_dir)  # left by an interrupted attempt with this number
    trial_dir.mkdir(parents=True, exist_ok=True)
    busy = gpu_busy_report()
    if busy:
        message = "the GPU is held by other processes: " + "; ".join(busy)
        c.event("gpu_busy", message, trial_id=trial["id"])
        c.say(message, "yellow")
    if not c.noise.known():
        c.noise.update()
    ctx = dataclasses.replace(ctx, incumbent=c.islands.incumbent(ctx.lineage))
    kind = trial["kind"]
    if kind == Kind.BASELINE.value:
        outcome = measure_baseline(c, ctx, trial)
    elif kind in (Kind.RERUN.value, Kind.DRIFT.value):
        outcome = measure_incumbent_again(c, ctx, trial)
    else:
        outcome = compare(c, ctx, trial)
    return finish(c, ctx, trial, outcome)


def baseline_seed_count(c: TrialHost, cfg: DecisionConfig) -> int:
    """How many seeds the baseline runs at: the rule's count (one under strict, as in
    autoresearch), but with verification on `baseline_seeds` under every rule. The held-out
    guard weighs a keep's held-out gap against the measured noise; with one baseline run
    and one run per candidate (strict) nothing is ever repeated, so there is no noise, and
    the guard refused honest gains (a real CPU night: six of strict's, TOTAL_BATCH_TOKENS
    x2's -0.23 bpb among them). `--baseline-seeds 1` asks for that on purpose, and the
    baseline says what it costs (`measure_baseline`)."""
    if not guard_on(c):
        return max(1, cfg.baseline_runs)
    return max(1, cfg.baseline_seeds)


def measure_baseline(c: TrialHost, ctx: TrialContext, trial: dict) -> TrialOutcome:
    """The unmodified script at `baseline_seed_count` seeds: the first incumbent and the
    first measure of the noise."""
    cfg = c.decision_config()
    seeds = c.seeds(baseline_seed_count(c, cfg))
    if len(seeds) == 1 and guard_on(c) and not runs_of(c.store, trial):
        c.say("--baseline-seeds 1: the run has no noise estimate until something is measured twice, so the "
              "held-out check of a keep allows only a tenth of its val gain (2 or more seeds measure the noise)",
              "yellow")
    commit = trial["trial_commit"]
    last = None
    for seed in seeds:
        if seed in runs_of(c.store, trial):
            continue
        if c.abort_requested:
            return interrupted()
        last = c.measure_commit(commit, seed, owner=trial, role="baseline", ctx=ctx)
        failed = measured_outcome(last)
        if failed:
            return failed
    c.noise.update()
    runs = runs_of(c.store, trial)
    outcome = TrialOutcome(Status.KEEP, "", trial_fields(c, trial, last))
    noise = c.noise.current()
    mean, se = estimate(list(runs.values()), noise)
    outcome.fields.update(metric=mean, metric_sd=se, n_runs=len(runs), tier="baseline")
    outcome.reason = f"baseline: val_bpb {_pm(mean, se)} over {len(runs)} seed{'s' if len(runs) > 1 else ''}" + (
        f"; run-to-run noise {noise.run_sd:.4f} bpb" if noise is not None else "")
    return verify_keep(c, ctx, trial, outcome)


def measure_incumbent_again(c: TrialHost, ctx: TrialContext, trial: dict) -> TrialOutcome:
    """A `rerun` (circuit breaker) or `drift` trial: the incumbent at its first seed."""
    incumbent = c.store.best_trial(c.run_row["id"])
    seed = c.seeds(1)[0]
    m = c.measure_commit(incumbent["trial_commit"] or c.best_commit(), seed, owner=trial,
                         role="drift" if trial["kind"] == Kind.DRIFT.value else "rerun", ctx=ctx)
    failed = measured_outcome(m)
    if failed:
        return failed
    fields = trial_fields(c, trial, m)
    fields.update(metric=m.metric, n_runs=1)
    before = c.incumbent_runs(incumbent).get(seed)
    if trial["kind"] == Kind.RERUN.value or before is None:
        best = _metric(c.islands.incumbent(ctx.lineage))  # now: a trial on another worker may have been kept
        reason = (f"re-run of the incumbent: val_bpb {m.metric:.6f} (best {best:.6f})" if best is not None
                  else f"re-run: val_bpb {m.metric:.6f}")
        return TrialOutcome(Status.DISCARD, reason, fields)
    return judge_drift(c, trial, m, before, fields)


# ---------------------------------------------------------------------------- finishing


def finish(c: TrialHost, ctx: TrialContext, trial: dict, outcome: TrialOutcome) -> dict:
    """Record the decision and the new best in one transaction, then make git agree.
    Finishes take turns (`refs_lock`): each keep is judged against the best as it is at
    that moment (`Islands.stale_keep`)."""
    with c.refs_lock:
        return _finish_now(c, trial, c.islands.stale_keep(trial, outcome, ctx.lineage))


def _finish_now(c: TrialHost, trial: dict, outcome: TrialOutcome) -> dict:
    status, reason, fields = outcome.status, outcome.reason, dict(outcome.fields)
    keep = status == Status.KEEP
    number = trial["number"]
    curve = fields.pop("curve", None) or progress_curve(trial, c.store)
    if "metric" not in fields:
        # A trial that ended without a metric of its own has none, whatever the row holds
        # (a run that wrote to the db may have set one).
        fields.update(metric=None, metric_source=None)
    if not keep:
        fields["tier"] = None  # a tier is a kept trial's (a keep that failed verification has none)
    if curve:
        from autoloop.decide.diagnosis import diagnose

        flags = diagnose(curve)
        if flags:
            fields["flags"] = flags
    lineage = trial.get("lineage") if c.config.search_mode == "islands" else None
    best = trial["trial_commit"]
    if keep and lineage and lineage != "main":
        best = c.islands.keep_in_lineage({**trial, "metric": fields.get("metric")}, lineage)
    with c.store.transaction():
        c.store.update_trial(trial["id"], status=status, reason=reason, **fields)
        if keep:
            c.store.update_run(c.run_row["id"], best_commit=best)
    if keep and fields.get("heldout_metric") is not None:
        _watch_overfitting(c, trial)
    faults.fault_point("during_reset")
    if curve:
        c.store.add_curve(trial["id"], curve)
    if not keep and trial["kind"] not in (Kind.BASELINE.value, Kind.RERUN.value, Kind.DRIFT.value) \
            and trial.get("trial_commit"):
        c.repo.archive(c.tag, number, trial["trial_commit"])
    c.converge_git()
    if trial.get("idea_id"):
        c.store.set_idea_status(
            trial["idea_id"], IdeaStatus.PENDING if status == Status.INTERRUPTED else IdeaStatus.DONE,
            trial_id=trial["id"],
        )
    if not keep:
        delete_checkpoints(c, trial, keep_last=False)
    final = c.store.trial_by_id(trial["id"])
    c.notifier.trial_finished(final)  # a keep or a confirmed gain, for --notify
    if c.display is not None:
        c.display.trial_finished(final)
    return final


def _watch_overfitting(c: TrialHost, trial: dict) -> None:
    from autoloop.decide.overfit import watch

    signal_ = watch(c.store.trials(c.run_row["id"], status=Status.KEEP))
    if signal_ is not None:
        c.event("overfitting", signal_["message"], trial_id=trial["id"])
        c.say(signal_["message"], "yellow")


def _pm(mean: float | None, se: float | None) -> str:
    if mean is None:
        return "-"
    return f"{mean:.6f}" if not se else f"{mean:.6f} ± {se:.6f}"
