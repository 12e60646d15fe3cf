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
import time
from dataclasses import dataclass
from pathlib import Path

from autoloop.decide.rule import DecisionConfig, estimate
from autoloop.errors import is_disk_full
from autoloop.base import faults
from autoloop.loop import stops
from autoloop.loop.noise import paired_decision, runs_of
from autoloop.loop.recheck import recheck_keep
from autoloop.measure.measurer import Measurement, trial_status
from autoloop.measure.run_folder import RunFolder
from autoloop.measure.runner import gpu_busy_report
from autoloop.proposers.proposal import InvalidProposal, Proposal, materialize, validate
from autoloop.store import IdeaStatus, Kind, MetricSource, Status, utcnow
from autoloop.loop.host import TrialHost


@dataclass(frozen=True)
class TrialContext:
    """Where one trial runs and what it is compared with, passed down to all its code."""

    slot: object  # where its measurements run (autoloop.measure.executors): serial, a worker, a Ray actor
    lineage: str | None = None  # islands mode: the lineage it advances; None: the run's own
    worker: str | None = None  # the worker's name for the trial row (None: the controller's own slot)
    incumbent: dict | None = None  # what it is compared with, read as its measurements begin

    @property
    def moves_branch(self) -> bool:
        """The trial trains in the project folder itself (the serial slot), so the run's
        branch follows it; a worker checks its commit out in a worktree of its own."""
        return bool(getattr(self.slot, "moves_branch", False))

    @property
    def device(self) -> str | None:
        return getattr(self.slot, "device", None)


@dataclass
class TrialOutcome:
    status: Status
    reason: str
    fields: dict  # for the trial row; "curve": the last run's loss curve, stored by finish


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


def _measured(m: Measurement) -> TrialOutcome | None:
    """The trial's end when a run of its own failed, else None."""
    if m.ok:
        return None
    fields = dict(m.fields)
    fields.pop("curve", None)
    return TrialOutcome(trial_status(m.status), m.reason or m.status, fields)


def _interrupted() -> TrialOutcome:
    return TrialOutcome(Status.INTERRUPTED, "interrupted by the user", {})


def guard_on(c: TrialHost) -> bool:
    """Keeps are verified, and so judged by the held-out guard (`verify_keep`)."""
    return c.verifier is not None and bool(c.config.verify)


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
            return _interrupted()
        last = c.measure_commit(commit, seed, owner=trial, role="baseline", ctx=ctx)
        failed = _measured(last)
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
    failed = _measured(m)
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


def judge_drift(c: TrialHost, trial: dict, m: Measurement, before: float, fields: dict) -> TrialOutcome:
    shift = m.metric - before
    noise = c.noise.current()
    sd = noise.pair_sd if noise is not None else 0.0
    # A step-mode repeat at the same seed is bit-identical: any shift beyond rounding is real.
    scale = max(sd, 1e-6)
    sigmas = abs(shift) / scale
    fields["decision"] = {"action": "drift", "shift": shift, "pair_sd": sd, "sigmas": sigmas,
                          "seed": m.seed, "before": before, "after": m.metric}
    what = (f"drift check: the incumbent at seed {m.seed} gave {m.metric:.6f}, {before:.6f} when it was measured "
            f"({shift:+.6f}, {sigmas:.1f} x the paired noise {sd:.4f})")
    if sigmas > c.config.drift_pause_sigmas:
        fields["decision"]["pause"] = True
        c.event("drift", what + ": a large shift", trial_id=trial["id"])
        c.pauses.request(
            f"{what}: the machine or software changed under the run (a throttled GPU, another process, a new "
            "driver?); check it and resume with `autoloop run --tag " + c.tag + "`")
    elif sigmas > c.config.drift_event_sigmas:
        c.event("drift", what, trial_id=trial["id"])
        c.say(what, "yellow")
    return TrialOutcome(Status.DISCARD, what, fields)


def compare(c: TrialHost, ctx: TrialContext, trial: dict) -> TrialOutcome:
    """The paired, sequential comparison of a candidate with the incumbent (autoloop.decide.rule)."""
    cfg = c.decision_config()
    incumbent = ctx.incumbent
    seeds = c.seeds(max(cfg.max_runs, cfg.baseline_seeds, 1) + 1)
    last = None
    while True:
        if c.abort_requested:
            return _interrupted()
        device = ctx.device if c.config.allow_mixed_devices else None
        if incumbent is not None and incumbent.get("metric_source") == MetricSource.REPORTED.value:
            cfg = DecisionConfig(rule="strict", margin=c.config.keep_margin)
        # Pairs of runs at different machine speeds are not pairs (autoloop.loop.noise.paired_decision).
        step = paired_decision(c, trial, incumbent, cfg, seeds, device)
        verdict, inc_runs = step.verdict, step.incumbent
        record = {**verdict.figures, **step.figures(), "action": verdict.action, "reason": verdict.reason,
                  "rule": cfg.rule, "incumbent_id": incumbent["id"] if incumbent else None,
                  "incumbent_number": incumbent["number"] if incumbent else None}
        c.store.update_trial(trial["id"], decision=record)
        if verdict.action == "measure":
            if verdict.side == "incumbent":
                if step.confounded_note():
                    c.event("confounded", f"trial {trial['number']}: {step.confounded_note()}", trial_id=trial["id"])
                m = c.measure_commit(incumbent["trial_commit"] or c.best_commit(), verdict.seed,
                                     owner=incumbent, role="incumbent", for_trial=trial, ctx=ctx)
                if not m.ok:
                    status = trial_status(m.status, own=False)
                    if m.status == "aborted":
                        return _interrupted()
                    if m.status == "lost":
                        return TrialOutcome(status, (
                            f"the incumbent's re-measurement at seed {verdict.seed} was lost: {m.reason}"), {})
                    return TrialOutcome(status, (
                        f"the incumbent (trial {incumbent['number']}) failed when re-measured at seed "
                        f"{verdict.seed}: {m.reason}"), {})
                before = step.drift_before(m.metric, m.machine_speed)
                if before is not None:  # the drift check before the first keep: an event (or a pause)
                    judge_drift(c, trial, m, before, {})
                RunFolder(m.run_dir).checkpoint.unlink(missing_ok=True)
            else:
                # The first run of a candidate carries the night's early-stop rule (autoloop.loop.stops).
                early = c.stops.payload(incumbent, verdict.seed) if c.stops is not None and not step.own else None
                last = c.measure_commit(trial["trial_commit"], verdict.seed, owner=trial, role="candidate", ctx=ctx,
                                        early_stop=early)
                if last.status == "stopped":  # a clear loser: discarded, its run never a measurement of it
                    return TrialOutcome(*stops.stopped_outcome(trial, last, record, trial_status(last.status)))
                failed = _measured(last)
                if failed:
                    return failed
            faults.fault_point("between_measurements")
            c.noise.update()
            continue
        noise = c.noise.current()
        fields = trial_fields(c, trial, last)
        mean, se = estimate(list(step.own.values()), noise)  # all its runs, paired or not
        fields.update(metric=mean, metric_sd=se, n_runs=len(step.own))
        best_before = trial.get("best_before")
        if best_before is not None and mean is not None:
            # One definition everywhere (log, show, report, the reason): the paired difference the decision used.
            fields["delta"] = verdict.figures.get("mean_diff", mean - (
                estimate(list(inc_runs.values()), noise)[0] if inc_runs else best_before))
        interval = verdict.figures.get("interval") or [None, None]
        record["distinguishable"] = verdict.action == "keep" or (
            None not in interval and (interval[1] < 0 or interval[0] > 0))
        # A near miss: it looked better, but not distinguishably so.
        record["near_miss"] = verdict.action == "discard" and (
            bool(verdict.figures.get("near_miss"))
            or ((verdict.figures.get("mean_diff") or 0.0) < 0 and not record["distinguishable"]))
        fields["decision"] = record
        # Two tiers (autoloop.decide.rule): adopted (the branch moves) or also confirmed.
        fields["tier"] = verdict.figures.get("tier") or "adopted" if verdict.action == "keep" else None
        if incumbent is not None and incumbent.get("metric_source") != MetricSource.REPORTED.value \
                and any(m.get("role") == "candidate" and m.get("status") == "ok" and m.get("metric") is not None
                        for m in c.store.measurements(trial["id"])) \
                and _metric_source(c, trial) == MetricSource.REPORTED.value:
            return TrialOutcome(Status.INVALID, (
                "only a printed val_bpb (no result JSON): it cannot be checked, so it is not compared with the "
                "harness-measured best"), fields)
        if verdict.action == "discard":
            return TrialOutcome(Status.DISCARD, verdict.reason, fields)
        return verify_keep(c, ctx, trial, TrialOutcome(Status.KEEP, verdict.reason, fields))


def _metric_source(c: TrialHost, trial: dict) -> str | None:
    row = c.store.trial_by_id(trial["id"])
    return row.get("metric_source") if row else None


def verify_keep(c: TrialHost, ctx: TrialContext, trial: dict, outcome: TrialOutcome) -> TrialOutcome:
    """A keep stands only on verified numbers: every run of the trial with a checkpoint
    is re-checked (causality, held-out) on the trial's slot; then the held-out guard
    against `ctx.incumbent` (none for the baseline)."""
    incumbent = ctx.incumbent if trial["kind"] != Kind.BASELINE.value else None
    fields = outcome.fields
    source = _metric_source(c, trial)
    if source == MetricSource.REPORTED.value:
        fields["metric_source"] = MetricSource.REPORTED.value
        c.say(f"trial {trial['number']}: only a printed val_bpb (no result JSON), so it cannot be verified; "
              "it is kept as reported (unverified)", "yellow")
        return outcome
    if not guard_on(c):
        failed = recheck_keep(c, ctx.slot, trial, fields) if c.verifier is not None else None
        if failed is not None:
            return _verification_failed(c, *failed, fields)
        fields["metric_source"] = source or MetricSource.HARNESS.value
        return outcome
    started = time.monotonic()
    c.say(f"verifying trial {trial['number']} in a fresh process: causality, val_bpb, held-out")
    heldouts = {}
    role = "baseline" if trial["kind"] == Kind.BASELINE.value else "candidate"
    for row in c.store.measurements(trial["id"]):
        if row.get("role") != role or row.get("status") != "ok":
            continue
        ok, reason, heldout = c.measurer.verify(trial, trial, row, slot=ctx.slot, power=not heldouts)
        if not ok:
            fields["verify_seconds"] = time.monotonic() - started
            return _verification_failed(c, ok, reason, fields)
        heldouts[int(row["seed"])] = heldout
    fields["verify_seconds"] = time.monotonic() - started
    fields["metric_source"] = MetricSource.VERIFIED.value
    if heldouts:
        mean, se = estimate(list(heldouts.values()), c.noise.current())
        fields["heldout_metric"], fields["heldout_sd"] = mean, se
    if incumbent is not None and heldouts:
        inc_heldouts = {int(r["seed"]): float(r["heldout_metric"]) for r in c.store.measurements(incumbent["id"])
                        if r.get("heldout_metric") is not None and r.get("seed") is not None}
        problem = heldout_problem(c, trial, incumbent, heldouts, inc_heldouts)
        if problem:
            return TrialOutcome(Status.INVALID, problem, fields)
    delete_checkpoints(c, trial, keep_last=True)
    c.say(f"trial {trial['number']} verified in {fields['verify_seconds']:.1f} s: held-out "
          f"{fields.get('heldout_metric', float('nan')):.6f}, causal", "green")
    return outcome


def _verification_failed(c: TrialHost, ok: bool | None, reason: str | None, fields: dict) -> TrialOutcome:
    """A keep candidate whose verification failed. Its figures were not reproduced or not
    causal, so none of them is the trial's val_bpb: the row's metric is NULL and the failed
    figures are in the reason (and the failed run's measurement row)."""
    if c.abort_requested:
        return TrialOutcome(Status.INTERRUPTED, "interrupted by the user during verification", fields)
    if ok is None:  # the worker was lost: not the trial's fault
        return TrialOutcome(Status.INTERRUPTED, reason or "the worker was lost during verification", fields)
    fields.update(metric=None, metric_sd=None, metric_source=None, delta=None, heldout_metric=None, heldout_sd=None)
    decision = fields.get("decision")
    if isinstance(decision, dict) and "mean_diff" in decision:  # the log's delta: a failed figure's gain
        fields["decision"] = {**decision, "mean_diff": None, "unverified_mean_diff": decision["mean_diff"]}
    return TrialOutcome(Status.INVALID, reason or "failed verification", fields)


def heldout_problem(c: TrialHost, trial, incumbent, heldouts: dict, inc_heldouts: dict) -> str | None:
    from autoloop.decide.heldout import heldout_guard

    if not inc_heldouts:
        return None
    cand_val = runs_of(c.store, trial, ("candidate",))
    inc_val = c.incumbent_runs(incumbent)
    shared = [s for s in heldouts if s in inc_heldouts and s in cand_val and s in inc_val]
    if shared:
        val_delta = sum(cand_val[s] - inc_val[s] for s in shared) / len(shared)
        heldout_delta = sum(heldouts[s] - inc_heldouts[s] for s in shared) / len(shared)
        n = len(shared)
    else:
        val_delta = sum(cand_val.values()) / len(cand_val) - sum(inc_val.values()) / len(inc_val)
        heldout_delta = sum(heldouts.values()) / len(heldouts) - sum(inc_heldouts.values()) / len(inc_heldouts)
        n = 1
    # None: nothing measured twice yet (`--baseline-seeds 1`, or a run resumed from before the
    # baseline measured the noise under verification): the guard allows only its floor and
    # the splits' share, and says the noise is unknown.
    noise = c.noise.current()
    return heldout_guard(val_delta, heldout_delta, noise.pair_sd if noise is not None else None, n)


def trial_fields(c: TrialHost, trial: dict, m: Measurement | None) -> dict:
    """The trial row's fields from its last run (`curve` too, for `finish` to store)."""
    if m is None:
        rows = [r for r in c.store.measurements(trial["id"]) if r.get("status") == "ok"]
        return {"wall_seconds": rows[-1].get("wall_seconds")} if rows else {}
    fields = dict(m.fields)
    fields["checkpoint_path"] = str(m.checkpoint) if m.checkpoint.exists() else None
    if not fields.get("curve"):
        fields.pop("curve", None)
    return fields


def progress_curve(trial: dict, store) -> list[dict] | None:
    """The curve of the trial's last run from its progress lines, for a run that ended
    without a result (a divergence that stopped with FAIL, a crash): the diagnosis reads it.
    The file is the trial's: read as untrusted data (autoloop.trust.untrusted)."""
    from autoloop.trust.untrusted import progress_records

    rows = [r for r in store.measurements(trial["id"]) if r.get("log_path")]
    if not rows:
        return None
    points = [{k: record.get(k) for k in ("step", "loss", "lr", "grad_norm")}
              | {"seconds": record.get("training_seconds")}
              for record in progress_records(RunFolder(Path(rows[-1]["log_path"]).parent).progress)
              if "loss" in record]
    return points or None


def delete_checkpoints(c: TrialHost, trial: dict, keep_last: bool) -> None:
    """Only one checkpoint per kept trial is worth the disk (finalize copies it)."""
    rows = [r for r in c.store.measurements(trial["id"]) if r.get("log_path")]
    keep = Path(rows[0]["log_path"]).parent if (keep_last and rows) else None
    runs = c.trial_dir(trial["number"]) / "runs"
    if not runs.exists():
        return
    for run_dir in runs.iterdir():
        if run_dir != keep:
            RunFolder(run_dir).checkpoint.unlink(missing_ok=True)


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
