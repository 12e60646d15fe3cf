"""The scheduler: which work item comes next.

The loop is a scheduler of work items over an executor, so new kinds of work (re-runs,
repairs, ablations, parallel lineages) are new items, not new loops. Its state is
derived from the db, so a resumed run continues where it stopped.

Order: the unmodified baseline first (until one succeeds); after K consecutive
crashes or timeouts, a re-run of the incumbent (if that fails too, the run pauses with a
diagnosis instead of burning the night); after a proposal that crashed with a plain
error, one `repair` of it by the proposer that made it (llm, agent); otherwise the
proposer chain's next proposal, prepared while the previous trial trained
(`autoloop.prefetch`).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from autoloop.prefetch import Prefetcher
from autoloop.proposers.proposal import Proposal
from autoloop.proposers.base import ProposerUnavailable
from autoloop.store import Kind, Status

_FAILED = (Status.CRASH.value, Status.TIMEOUT.value)
_LOW_DISK_BYTES = 1 << 30


@dataclass
class WorkItem:
    kind: str  # "baseline" | "rerun" | "proposal" | "pause"
    reason: str = ""
    proposal: Proposal | None = None
    parent: str | None = None
    derived_from: int | None = None
    trial_kind: Kind = Kind.PROPOSAL


class Scheduler:
    def __init__(self, controller):
        self.controller = controller
        self.exhausted_reason = ""
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

    def next_item(self) -> WorkItem | None:
        trials = self._recent()
        baselines = [t for t in self._trials(kind=Kind.BASELINE) if t["status"] != Status.INTERRUPTED.value]
        if not any(t["status"] == Status.KEEP.value for t in baselines):
            failed = [t for t in baselines if t["number"] >= self.first_number]
            if failed:
                return WorkItem("pause", reason=self._diagnose(f"the baseline fails: {failed[-1]['reason']}"))
            return WorkItem("baseline", reason="baseline: the unmodified training script", trial_kind=Kind.BASELINE)
        tail = self._failure_tail(trials)
        limit = max(1, self.controller.config.max_consecutive_failures)
        if tail and tail[-1]["kind"] == Kind.RERUN.value:
            return WorkItem("pause", reason=self._diagnose(f"the incumbent itself failed on re-run: {tail[-1]['reason']}"))
        if len(tail) >= limit:
            best = self.store.best_trial(self.controller.run_row["id"])
            return WorkItem(
                "rerun", reason=f"circuit breaker: {len(tail)} failures in a row; re-running the incumbent",
                derived_from=best["id"] if best else None, trial_kind=Kind.RERUN,
            )
        repair = self._repair_item(trials)
        if repair is not None:
            return repair
        parent = self.controller.best_commit()
        proposal = self.prefetcher.next_proposal(parent)
        if proposal is None:
            self.exhausted_reason = (
                f"no more proposals: the idea queue is empty and the proposers ({', '.join(self.controller.chain().names)}) "
                "have nothing to offer; seed ideas with `autoloop seed` and run again"
            )
            return None
        return WorkItem("proposal", reason=proposal.description, proposal=proposal, parent=parent)

    def observe(self, trial: dict) -> None:
        """Hook for schedulers that learn from results; the state lives in the db."""

    def prefetch(self, trial: dict) -> None:
        """Training of `trial` has started: prepare the next proposal meanwhile (autoloop.prefetch)."""
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
        return WorkItem("proposal", reason=proposal.description, proposal=proposal, parent=parent,
                        derived_from=last["id"], trial_kind=Kind.REPAIR)

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
        from autoloop.runner import gpu_busy_report

        free = shutil.disk_usage(self.controller.repo_dir).free
        if is_disk_full(what):  # the failure itself says so ("No space left on device"), whatever is free now
            return f"{what}; the disk is full ({free >> 20} MB free now): free some space and resume"
        if free < _LOW_DISK_BYTES:
            return f"{what}; the disk is almost full ({free >> 20} MB free): free some space and resume"
        busy = gpu_busy_report()
        if busy:
            return f"{what}; the GPU is held by other processes ({'; '.join(busy)}): stop them and resume"
        return f"{what}: check the trial's log, fix the cause and resume with `autoloop run --tag {self.controller.tag}`"
