"""The scheduler: which work item comes next.

The loop is a scheduler of work items over an executor, so new kinds of work (re-runs,
repairs, ablations, parallel lineages) are new items, not new loops. Its state is
derived from the db, so a resumed run continues where it stopped.

Order: a trial left running by a dead controller with measurements recorded resumes
first; the unmodified baseline (until one succeeds); every `drift_every` trials a `drift`
re-measurement of the incumbent; after K consecutive
crashes or timeouts, a re-run of the incumbent (if that fails too, the run pauses with a
diagnosis instead of burning the night); after a proposal that crashed with a plain
error, one `repair` of it by the proposer that made it (llm, agent); with
`requeue_near_misses`, a discard that was within the noise of an incumbent that has since
changed, tried once more on the new best; otherwise the proposer chain's next proposal,
prepared while the previous trial trained (`autoloop.loop.prefetch`), the chain in its
order or, with `schedule = "yield"`, in this turn's order (`autoloop.loop.sources`).

A model that cannot be reached (its `outage`, autoloop.proposers.outage) is said on the
console once when it goes and once when it is back; while it is away the other sources
go on, and when nothing else has a proposal the loop waits for the model's next try (a
`wait` item) for at most `llm_outage_wait` seconds of one outage, then stops with the
outage as its reason.
"""

from __future__ import annotations

import enum
import json
import shutil
import time
from dataclasses import dataclass

from autoloop.loop.prefetch import Prefetcher
from autoloop.loop.sources import SourceSchedule
from autoloop.proposers.proposal import Edit, Proposal
from autoloop.proposers.base import ProposerUnavailable
from autoloop.store import Kind, Status
from autoloop.loop.host import TrialHost

_FAILED = (Status.CRASH.value, Status.TIMEOUT.value)
# Proposals in a row that could not be tried (a duplicate, an edit that does not apply, a
# forbidden file: invalid before any training) before the night stops. Each costs no
# training but up to three model calls (the answer and two repairs): a model that only
# repeats itself would otherwise be asked all night.
UNTRIED_IN_A_ROW = 10
_LOW_DISK_BYTES = 1 << 30


class Work(str, enum.Enum):
    """What a work item does: one vocabulary. Each kind that starts a trial has the value of
    that trial's `store.Kind` (the schema's CHECK constraint), so `Kind(work.value)` is its
    row's kind; RESUME goes on with a trial left running, PAUSE pauses the run."""

    BASELINE = Kind.BASELINE.value  # the unmodified script, the first incumbent
    PROPOSAL = Kind.PROPOSAL.value  # an edit to try
    REPAIR = Kind.REPAIR.value  # an edit that fixes a crashed one (the proposer's, or out of memory)
    RERUN = Kind.RERUN.value  # circuit breaker: is the incumbent itself still fine?
    DRIFT = Kind.DRIFT.value  # the incumbent measured again: did the machine change?
    RESUME = "resume"
    PAUSE = "pause"
    WAIT = "wait"  # nothing to propose while a model is unreachable: wait for its next try


# Items whose answer every next trial needs (the first incumbent; is the machine broken?):
# nothing new starts beside them.
BLOCKING = frozenset({Work.BASELINE, Work.RERUN, Work.DRIFT})
# Items that measure the run's own incumbent, shared by every lineage.
OF_THE_INCUMBENT = frozenset({Kind.BASELINE, Kind.RERUN, Kind.DRIFT})


@dataclass
class WorkItem:
    kind: Work
    reason: str = ""
    proposal: Proposal | None = None
    parent: str | None = None
    derived_from: int | None = None  # the trial it continues (RESUME) or comes from (a repair, a re-base)
    resumed_kind: Kind | None = None  # RESUME: the kind of the trial it goes on with
    wait_until: float | None = None  # WAIT: the Unix time of the model's next try

    @property
    def trial_kind(self) -> Kind | None:
        """The kind of the trial this item runs (None for a pause)."""
        if self.kind is Work.RESUME:
            return self.resumed_kind
        return None if self.kind in (Work.PAUSE, Work.WAIT) else Kind(self.kind.value)


class Scheduler:
    def __init__(self, controller: TrialHost):
        self.controller = controller
        self.exhausted_reason = ""
        self.announced: dict[str, float] = {}  # proposer -> the start of the outage the console was told of
        # Failures before this invocation do not count: after a pause the user fixes the
        # cause and resumes, and the run must not pause again on the old evidence.
        self.first_number = max((t["number"] for t in self._trials(last=1)), default=0) + 1
        self.prefetcher = Prefetcher(controller, self.first_number)

    @property
    def store(self):
        return self.controller.store

    def _trials(self, **filters) -> list[dict]:
        return self.store.trials(self.controller.run_row["id"], **filters)

    def _recent(self) -> list[dict]:
        """This invocation's latest trials, enough to see the failure tail: reading only
        the tail keeps the per-trial cost flat however long the run gets."""
        window = max(1, self.controller.config.max_consecutive_failures) + 50
        return [t for t in self._trials(last=window)
                if t["status"] != Status.INTERRUPTED.value and t["number"] >= self.first_number]

    def next_item(self, lineage: str | None = None, busy=()) -> WorkItem | None:
        """The next work item; with several workers, `lineage` is the free worker's
        (islands mode) and `busy` the trials in flight (never resumed twice)."""
        running = [t for t in self.store.running_trials(self.controller.run_row["id"])
                   if t["id"] not in busy and t["number"] < self.first_number]
        if running:
            return WorkItem(Work.RESUME, reason=f"resume trial {running[0]['number']}", derived_from=running[0]["id"],
                            resumed_kind=Kind(running[0]["kind"]))
        limit = max(1, self.controller.config.max_consecutive_failures)
        lost = self._lost_tail(limit)
        if lost:
            return WorkItem(Work.PAUSE, reason=(
                f"{len(lost)} trials in a row lost their worker (last: {lost[-1]['reason']}): a node or GPU is down, "
                f"or something kills the workers; fix it and resume with `autoloop run --tag {self.controller.tag}`"))
        trials = self._recent()
        baselines = [t for t in self._trials(kind=Kind.BASELINE) if t["status"] != Status.INTERRUPTED.value]
        if not any(t["status"] == Status.KEEP.value for t in baselines):
            failed = [t for t in baselines if t["number"] >= self.first_number]
            if failed:
                return WorkItem(Work.PAUSE, reason=self._diagnose(f"the baseline fails: {failed[-1]['reason']}"))
            return WorkItem(Work.BASELINE, reason="baseline: the unmodified training script")
        tail = self._failure_tail(trials)
        if tail and tail[-1]["kind"] == Kind.RERUN.value:
            return WorkItem(Work.PAUSE, reason=self._diagnose(f"the incumbent itself failed on re-run: {tail[-1]['reason']}"))
        if len(tail) >= limit:
            best = self.store.best_trial(self.controller.run_row["id"])
            return WorkItem(
                Work.RERUN, reason=f"circuit breaker: {len(tail)} failures in a row; re-running the incumbent",
                derived_from=best["id"] if best else None,
            )
        repair = self._oom_repair_item(trials) or self._repair_item(trials)
        if repair is not None:
            return repair
        drift = self._drift_item()
        if drift is not None:
            return drift
        requeued = self.controller.requeue.take(lineage)
        if requeued is not None:
            return requeued
        parent = self.controller.islands.parent_for(lineage)
        again = self._near_miss_item(parent)
        if again is not None:
            return again
        untried = self._untried_tail(trials)
        if len(untried) >= UNTRIED_IN_A_ROW and not self.store.ideas(self.controller.run_row["id"], status="pending"):
            self.exhausted_reason = (
                f"no more proposals: the last {len(untried)} proposals could not be tried (the last: "
                f"{untried[-1]['reason']}); seed ideas with `autoloop seed`, or change the model or program.md, "
                f"and resume with `autoloop run --tag {self.controller.tag}`")
            return None
        if self.controller.config.schedule == "yield":
            proposal = SourceSchedule(self.controller, self.prefetcher).next_proposal(parent)
        else:
            proposal = self.prefetcher.next_proposal(parent)
        away = self.announce_outages(proposal is not None)
        if proposal is None:
            waiting = [o for o in away if o.retry_at is not None
                       and time.time() - o.since < self.controller.config.llm_outage_wait]
            if waiting:
                first = min(waiting, key=lambda o: o.retry_at)
                return WorkItem(Work.WAIT, reason=first.describe(), wait_until=first.retry_at)
            if away:
                self.exhausted_reason = "no more proposals: " + "; ".join(o.describe() for o in away) + (
                    f"; check the server and resume with `autoloop run --tag {self.controller.tag}`"
                    if any(o.retry_at is not None for o in away) else "")
                return None
            self.exhausted_reason = (
                f"no more proposals: the idea queue is empty and the proposers ({', '.join(self.controller.chain().names)}) "
                "have nothing to offer; seed ideas with `autoloop seed` and run again"
            )
            return None
        return WorkItem(Work.PROPOSAL, reason=proposal.description, proposal=proposal, parent=parent)

    def outages(self) -> list:
        """The chain's sources that cannot propose now (autoloop.proposers.outage.Outage)."""
        return [o for p in self.controller.chain().proposers if (o := getattr(p, "outage", None)) is not None]

    def announce_outages(self, others_go_on: bool) -> list:
        """One console line when a source goes away and one when it is back; the outages now."""
        away = self.outages()
        for outage in away:
            if self.announced.get(outage.proposer) != outage.since:
                self.announced[outage.proposer] = outage.since
                if outage.retry_at is None:
                    self.controller.say(f"{outage.proposer} will not be asked again in this run: {outage.describe()}",
                                        "yellow")
                    continue
                meanwhile = "the other sources go on meanwhile" if others_go_on else "nothing else to propose: waiting"
                self.controller.say(f"{outage.proposer} unavailable: {outage.describe()}; trying again in "
                                    f"{outage.retry_in():.0f} s ({meanwhile})", "yellow")
        for name in set(self.announced) - {o.proposer for o in away}:
            del self.announced[name]
            self.controller.say(f"{name} is back: its requests are answered again", "green")
        return away

    def observe(self, trial: dict) -> None:
        """Hook for schedulers that learn from results; the state lives in the db."""

    def prefetch(self, trial: dict) -> None:
        """Training of `trial` has started: prepare the next proposal meanwhile (autoloop.loop.prefetch)."""
        self.prefetcher.start()

    def close(self) -> None:
        """The run ends: hand back a proposal prepared for a trial that will not run."""
        self.prefetcher.close()

    def _repair_item(self, trials: list[dict]) -> WorkItem | None:
        """One repair of the last trial if it was a proposal that crashed with a plain error
        and its proposer can repair (llm, agent): a `repair` trial linked to the crash."""
        last = trials[-1] if trials else None
        if last is None or last["status"] != Status.CRASH.value or last["kind"] != Kind.PROPOSAL.value:
            return None
        chain = self.controller.chain()
        proposer = next((p for p in chain.proposers if p.name == last["proposer"] and hasattr(p, "repair")), None)
        parent = self.controller.best_commit()
        if proposer is None or last.get("parent_commit") != parent \
                or any(t.get("derived_from") == last["id"] for t in trials):
            return None
        try:
            proposal = proposer.repair(self.controller.proposal_context(parent), last)
        except ProposerUnavailable as exc:
            self.store.add_event(self.controller.run_row["id"], "proposer_unavailable",
                                 f"{proposer.name}: no repair of trial {last['number']}: {exc}")
            return None
        if proposal is None:
            return None
        return WorkItem(Work.REPAIR, reason=proposal.description, proposal=proposal, parent=parent,
                        derived_from=last["id"])

    def _oom_repair_item(self, trials: list[dict]) -> WorkItem | None:
        """A trial that ran out of memory, again with half the per-device batch and twice the
        gradient accumulation (the same total batch, so the comparison stays fair): a
        `repair` trial linked to it. A repair that runs out of memory too takes the next
        step down the ladder, up to `oom_repairs` steps."""
        from autoloop.errors import AutoloopError
        from autoloop.pyconst import read_constants, set_constants

        last = trials[-1] if trials else None
        limit = self.controller.config.oom_repairs
        if last is None or last["status"] != Status.CRASH.value or not limit or not is_out_of_memory(last):
            return None
        if last["kind"] not in (Kind.PROPOSAL.value, Kind.REPAIR.value):
            return None  # the baseline is the user's own script: its pause names the error
        if any(t.get("derived_from") == last["id"] for t in trials):
            return None
        depth, origin = 0, last
        by_id = {t["id"]: t for t in trials}
        while origin["kind"] == Kind.REPAIR.value and origin.get("derived_from") in by_id \
                and is_out_of_memory(origin):
            depth, origin = depth + 1, by_id[origin["derived_from"]]
        name = self.controller.config.oom_batch_constant
        script = self.controller.config.editable[0]
        commit = last.get("trial_commit") or last.get("parent_commit")
        why = None
        if depth >= limit:
            why = f"still out of memory after {depth} halvings of {name} (oom-repairs = {limit})"
        elif last.get("parent_commit") != self.controller.best_commit() or not commit:
            why = "the incumbent changed since"
        else:
            try:
                source = self.controller.repo.show_file(commit, script)
                value = read_constants(source).get(name)
            except (AutoloopError, SyntaxError):
                value, source = None, ""
            if value is None or not isinstance(value.value, int) or isinstance(value.value, bool):
                why = f"{script} has no integer {name} to halve" + (
                    f" (its value is not evaluated: {value.unreadable})" if value is not None and value.unreadable else "")
            elif value.value < 2:
                why = f"{name} is already {value.value}"
        if why is not None:
            reason = f"{last['reason']} (out of memory; not repaired: {why})"
            self.store.update_trial(last["id"], reason=reason)
            self.store.add_event(self.controller.run_row["id"], "oom", f"trial {last['number']}: {reason}",
                                 trial_id=last["id"])
            return None
        half = value.value // 2
        proposal = Proposal(
            f"repair of trial {last['number']} (out of memory): {name} {value.value} -> {half}, twice the gradient "
            f"accumulation, the same total batch",
            edits=[Edit(path=script, content=set_constants(source, {name: half}, path=script))],
            source="oom-repair",
        )
        return WorkItem(Work.REPAIR, reason=proposal.description, proposal=proposal, parent=last["parent_commit"],
                        derived_from=last["id"])

    def _drift_item(self) -> WorkItem | None:
        """Every `drift_every` trials (counted since the last drift check or the baseline),
        the incumbent again at its first seed: a shift beyond the noise is a changed machine."""
        every = self.controller.config.drift_every
        if not every or self.controller.config.decision_rule == "strict":
            return None
        recent = self._trials(last=every + 1)
        if any(t["kind"] in (Kind.DRIFT.value, Kind.BASELINE.value) for t in recent[-every:]) or len(recent) < every:
            return None
        best = self.store.best_trial(self.controller.run_row["id"])
        if best is None:
            return None
        return WorkItem(Work.DRIFT, reason=f"drift check: the incumbent (trial {best['number']}) measured again",
                        derived_from=best["id"])

    def _near_miss_item(self, parent: str) -> WorkItem | None:
        """A discard within the noise of an earlier incumbent, tried once on the new best."""
        if not self.controller.config.requeue_near_misses:
            return None
        trials = self._trials(last=200)
        retried = {t.get("derived_from") for t in trials if t.get("derived_from")}
        for trial in trials:
            decision = trial.get("decision") or {}
            if trial["status"] != Status.DISCARD.value or not decision.get("near_miss") or trial["id"] in retried \
                    or trial.get("parent_commit") == parent or not trial.get("edits") \
                    or trial["kind"] not in (Kind.PROPOSAL.value, Kind.REPAIR.value):
                continue
            edits, patch = Proposal.edits_from_json(json.dumps(trial["edits"]))
            proposal = Proposal(
                f"again on the new best (near miss of trial {trial['number']}): {trial.get('description') or ''}",
                edits=edits, patch=patch, source=trial.get("proposer") or "controller",
            )
            return WorkItem(Work.PROPOSAL, reason=proposal.description, proposal=proposal, parent=parent,
                            derived_from=trial["id"])
        return None

    def _lost_tail(self, limit: int) -> list[dict]:
        """This invocation's last `limit` trials, if every one was interrupted by a lost
        worker: their ideas go back to the queue, so without this a dead node would take
        them (and the night) one after another."""
        window = [t for t in self._trials(last=limit) if t["number"] >= self.first_number]
        if len(window) < limit:
            return []
        if all(t["status"] == Status.INTERRUPTED.value and "lost" in (t.get("reason") or "") for t in window):
            return window
        return []

    def _untried_tail(self, trials: list[dict]) -> list[dict]:
        """The trailing run of proposals that were never measured (invalid before training)."""
        tail = []
        for trial in reversed(trials):
            if (trial["kind"] not in (Kind.PROPOSAL.value, Kind.REPAIR.value) or trial["status"] != Status.INVALID.value
                    or self.store.measurements_for(trial["id"])):
                break
            tail.append(trial)
            if len(tail) >= UNTRIED_IN_A_ROW:
                break
        return list(reversed(tail))

    @staticmethod
    def _failure_tail(trials: list[dict]) -> list[dict]:
        """The trailing run of crashed/timed-out trials (invalid proposals do not count)."""
        tail = []
        for trial in reversed(trials):
            if trial["status"] == Status.INVALID.value and trial["kind"] != Kind.RERUN.value:
                continue
            if trial["status"] not in _FAILED:
                break
            tail.append(trial)
        return list(reversed(tail))

    def _diagnose(self, what: str) -> str:
        from autoloop.errors import is_disk_full
        from autoloop.measure.runner import gpu_busy_report

        free = shutil.disk_usage(self.controller.project_dir).free
        if is_disk_full(what):  # the failure itself says so ("No space left on device"), whatever is free now
            return f"{what}; the disk is full ({free >> 20} MB free now): free some space and resume"
        if free < _LOW_DISK_BYTES:
            return f"{what}; the disk is almost full ({free >> 20} MB free): free some space and resume"
        busy = gpu_busy_report()
        if busy:
            return f"{what}; the GPU is held by other processes ({'; '.join(busy)}): stop them and resume"
        return f"{what}: check the trial's log, fix the cause and resume with `autoloop run --tag {self.controller.tag}`"


# What torch says when memory runs out: CUDA's allocator, and the CPU allocator's.
_OOM_MARKERS = ("CUDA out of memory", "OutOfMemoryError", "DefaultCPUAllocator: can't allocate memory",
                "DefaultCPUAllocator: not enough memory", "MemoryError", "HIP out of memory", "MPS backend out of memory")


def is_out_of_memory(trial: dict) -> bool:
    text = f"{trial.get('reason') or ''}\n{trial.get('error_tail') or ''}"
    return any(marker in text for marker in _OOM_MARKERS)
