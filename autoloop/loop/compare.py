"""A candidate against the incumbent: the paired, sequential comparison, and the
verification of a keep before it is kept.

`compare` asks the rule (autoloop.decide.rule, paired by autoloop.loop.noise); while it says
"measure", it runs the side it names at the seed it names; then it concludes. A keep is
first verified in a fresh process (causality, the re-evaluated val_bpb, held-out), and the
verified values decide (`verify_keep`). The drift check of the incumbent is here too: a
re-measurement of it is one.
"""

from __future__ import annotations

import time

from autoloop.base import faults
from autoloop.decide.rule import DecisionConfig, estimate
from autoloop.loop import stops
from autoloop.loop.host import TrialHost
from autoloop.loop.noise import PairedDecision, paired_decision, runs_of
from autoloop.loop.outcome import (
    TrialContext,
    TrialOutcome,
    delete_checkpoints,
    interrupted,
    measured_outcome,
    trial_fields,
)
from autoloop.loop.recheck import recheck_keep
from autoloop.measure.measurer import Measurement, trial_status
from autoloop.measure.run_folder import RunFolder
from autoloop.store import Kind, MetricSource, Status


def guard_on(c: TrialHost) -> bool:
    """Keeps are verified, and so judged by the held-out guard (`verify_keep`)."""
    return c.verifier is not None and bool(c.config.verify)


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
    """The paired, sequential comparison of a candidate with the incumbent (autoloop.decide.rule):
    ask the rule; while it says "measure", run the side it names at the seed it names; then
    conclude on its keep or discard."""
    cfg = c.decision_config()
    seeds = c.seeds(max(cfg.max_runs, cfg.baseline_seeds, 1) + 1)
    last: Measurement | None = None  # the candidate's latest run
    while True:
        if c.abort_requested:
            return interrupted()
        step, record = _ask_the_rule(c, ctx, trial, cfg, seeds)
        if step.verdict.action != "measure":
            return _conclude(c, ctx, trial, step, record, last)
        if step.verdict.side == "incumbent":
            failed = _measure_the_incumbent(c, ctx, trial, step)
        else:
            last, failed = _measure_the_candidate(c, ctx, trial, step, record)
        if failed is not None:
            return failed
        faults.fault_point("between_measurements")
        c.noise.update()


def _ask_the_rule(c: TrialHost, ctx: TrialContext, trial: dict, cfg: DecisionConfig,
                  seeds: list[int]) -> tuple[PairedDecision, dict]:
    """The rule's verdict on the runs so far, recorded on the trial as its decision."""
    incumbent = ctx.incumbent
    device = ctx.device if c.config.allow_mixed_devices else None
    if incumbent is not None and incumbent.get("metric_source") == MetricSource.REPORTED.value:
        cfg = DecisionConfig(rule="strict", margin=c.config.keep_margin)
    # Pairs of runs at different machine speeds are not pairs (autoloop.loop.noise.paired_decision).
    step = paired_decision(c, trial, incumbent, cfg, seeds, device)
    verdict = step.verdict
    record = {**verdict.figures, **step.figures(), "action": verdict.action, "reason": verdict.reason,
              "rule": cfg.rule, "incumbent_id": incumbent["id"] if incumbent else None,
              "incumbent_number": incumbent["number"] if incumbent else None}
    c.store.update_trial(trial["id"], decision=record)
    return step, record


def _measure_the_incumbent(c: TrialHost, ctx: TrialContext, trial: dict, step: PairedDecision) -> TrialOutcome | None:
    """One more run of the incumbent at the rule's seed; an outcome when it failed."""
    incumbent, verdict = ctx.incumbent, step.verdict
    if step.confounded_note():
        c.event("confounded", f"trial {trial['number']}: {step.confounded_note()}", trial_id=trial["id"])
    m = c.measure_commit(incumbent["trial_commit"] or c.best_commit(), verdict.seed,
                         owner=incumbent, role="incumbent", for_trial=trial, ctx=ctx)
    if not m.ok:
        status = trial_status(m.status, own=False)
        if m.status == "aborted":
            return interrupted()
        if m.status == "lost":
            return TrialOutcome(status, f"the incumbent's re-measurement at seed {verdict.seed} was lost: {m.reason}", {})
        return TrialOutcome(status, (
            f"the incumbent (trial {incumbent['number']}) failed when re-measured at seed "
            f"{verdict.seed}: {m.reason}"), {})
    before = step.drift_before(m.metric, m.machine_speed)
    if before is not None:  # the drift check before the first keep: an event (or a pause)
        judge_drift(c, trial, m, before, {})
    RunFolder(m.run_dir).checkpoint.unlink(missing_ok=True)
    return None


def _measure_the_candidate(c: TrialHost, ctx: TrialContext, trial: dict, step: PairedDecision,
                           record: dict) -> tuple[Measurement, TrialOutcome | None]:
    """One more run of the candidate at the rule's seed (its first carries the night's early
    stop, autoloop.loop.stops); an outcome when it failed or was stopped as a clear loser."""
    early = c.stops.payload(ctx.incumbent, step.verdict.seed) if c.stops is not None and not step.own else None
    last = c.measure_commit(trial["trial_commit"], step.verdict.seed, owner=trial, role="candidate", ctx=ctx,
                            early_stop=early)
    if last.status == "stopped":  # a clear loser: discarded, its run never a measurement of it
        return last, TrialOutcome(*stops.stopped_outcome(trial, last, record, trial_status(last.status)))
    return last, measured_outcome(last)


def _conclude(c: TrialHost, ctx: TrialContext, trial: dict, step: PairedDecision, record: dict,
              last: Measurement | None) -> TrialOutcome:
    """The rule's keep or discard as the trial's figures; a keep goes on to verification."""
    incumbent, verdict, inc_runs = ctx.incumbent, step.verdict, step.incumbent
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
