"""Pipelining: the next proposal is prepared while the current trial trains.

An LLM or agent takes as long as a trial may, so asking it only after a trial ends
would leave the GPU idle for that long. When training starts, the controller calls
`Scheduler.prefetch`, which asks the chain's *slow* proposers (those with `slow = True`:
llm, agent) for a proposal against the current best commit in a background thread.
When the scheduler next needs a proposal, `next_proposal(parent)` walks the chain in
order: fast proposers (ideas, search) are asked then and there, because their answer
depends on the result of the trial that just ended (search would otherwise repeat the
move still training); at the first slow proposer it waits for the thread and then:

* the best did not move (the trial was discarded, crashed, ...): the proposal is used;
* the trial was kept, so the best moved: the proposal is re-applied to the new best
  (materialized and validated against it) when it still applies cleanly, otherwise it
  is released and the slow proposer is asked again, now. Whole-file edits never count
  as applying: they would silently undo the kept change;
* the slow proposers had nothing or were unavailable: they are skipped this turn (they
  just failed) and the walk goes on to the next proposers;
* an error the thread raised is raised here, in the main thread, exactly where a
  synchronous proposal would have raised it.

A prepared proposal that an earlier proposer in the chain pre-empts (the human seeded an
idea meanwhile) waits for the next turn.

Rules that keep this safe:

* Only proposers run in the thread. The controller's crash-safety order is unchanged:
  rows, commits and refs are still written by the trial's own thread (the main thread,
  or with several workers the thread of each trial in flight, autoloop.loop.run), never
  by this one.
* The prepared job is one piece of state shared by threads: trials' threads start it
  as their training starts, the main thread takes it; `job_lock` guards it.
* The thread gets its own `GitRepo` (GitPython keeps persistent `git cat-file`
  processes per repository object, which must not be shared across threads); the Store
  is thread-safe (one connection, an RLock).
* A released proposal hands its idea back to the queue and records the calls it cost
  (marked superseded), so neither ideas nor spending are lost.
* At shutdown (`close`) a finished proposal is released the same way; one still being
  prepared is abandoned after a short wait, and the idea it took (published in
  `ctx.extra["taken_idea"]`) is handed back.
* No prefetch when the run will stop after this trial (`max_trials`, `autoloop stop`),
  so a paid model is not asked for a proposal that will never run.
"""

from __future__ import annotations

import threading

from autoloop.proposers.proposal import InvalidProposal, Proposal, materialize, validate
from autoloop.proposers.base import ProposerChain
from autoloop.store import IdeaStatus
from autoloop.loop.host import TrialHost

CLOSE_WAIT_SECONDS = 5.0


class _Job:
    def __init__(self, parent: str, ctx, repo):
        self.parent = parent
        self.ctx = ctx
        self.repo = repo
        self.proposal: Proposal | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    def run(self, chain) -> None:
        try:
            self.proposal = chain.propose(self.ctx)
        except BaseException as exc:  # handed to the main thread by take()
            self.error = exc
        finally:
            try:
                self.repo.repo.close()
            finally:
                self.done.set()


class Prefetcher:
    def __init__(self, controller: TrialHost, first_number: int):
        self.controller = controller
        self.first_number = first_number
        self._job: _Job | None = None
        self.job_lock = threading.Lock()  # guards `_job`: trials on several workers start training at once

    @property
    def store(self):
        return self.controller.store

    def _slow(self) -> list:
        return [p for p in self.controller.chain().proposers if getattr(p, "slow", False)]

    def next_proposal(self, parent: str, order: list | None = None) -> Proposal | None:
        """The chain's proposal for `parent`, slow proposers answered by the prefetch;
        `order`: the proposers in this turn's order (autoloop.loop.sources), default the chain's."""
        ctx = self.controller.proposal_context(parent)
        skip_slow = False
        for proposer in self.controller.chain().proposers if order is None else order:
            slow = getattr(proposer, "slow", False)
            if slow and self._prepared():
                ready, proposal = self._take(parent)
                if proposal is not None:
                    return proposal
                skip_slow = ready  # prepared and came to nothing: do not ask again this turn
            if slow and skip_slow:
                continue
            # A one-proposer chain: the same fall-through and bookkeeping as the full chain.
            proposal = ProposerChain([proposer]).propose(ctx)
            if proposal is not None:
                return proposal
        return None

    def _prepared(self) -> bool:
        with self.job_lock:
            return self._job is not None

    def _run_ends_after_current(self) -> bool:
        cfg = self.controller.config
        run_id = self.controller.run_row["id"]
        if self.store.stop_requested(run_id) or self.controller.abort_requested:
            return True
        if cfg.max_trials is None:
            return False
        latest = self.store.trials(run_id, last=1)
        started_here = latest[0]["number"] - self.first_number + 1 if latest else 0
        return started_here >= cfg.max_trials

    def start(self) -> None:
        """Start preparing the next proposal in the background (called as training starts)."""
        with self.job_lock:
            self._start()

    def _start(self) -> None:
        slow = self._slow()
        if self._job is not None or not slow or self._run_ends_after_current():
            return
        from autoloop.gitops import GitRepo

        parent = self.controller.best_commit()
        try:
            repo = GitRepo.open(self.controller.project_dir)
        except Exception as exc:  # never fail the trial that is starting: ask later instead
            self.store.add_event(self.controller.run_row["id"], "prefetch", f"could not prefetch: {exc}")
            return
        job = _Job(parent, self.controller.proposal_context(parent, repo=repo), repo)
        job.thread = threading.Thread(target=job.run, args=(ProposerChain(slow),), name="autoloop-prefetch",
                                      daemon=True)
        self._job = job
        job.thread.start()

    def _take(self, parent: str) -> tuple[bool, Proposal | None]:
        """Wait for the prepared proposal and make it fit `parent`.

        (True, proposal) to use; (True, None) when the slow proposers had nothing;
        (False, None) when it was released because it no longer applies (ask again).
        """
        with self.job_lock:
            job, self._job = self._job, None
        job.done.wait()
        if job.error is not None:
            raise job.error
        proposal = job.proposal
        if proposal is None or job.parent == parent or proposal.meta.get("invalid"):
            return True, proposal
        if self._applies(proposal, parent):
            self.store.add_event(self.controller.run_row["id"], "prefetch",
                                 f"re-applied '{proposal.description}' to the new best {parent[:12]}")
            return True, proposal
        self.release(proposal, f"superseded: does not apply to the new best {parent[:12]}")
        self.store.add_event(self.controller.run_row["id"], "prefetch",
                             f"regenerating: '{proposal.description}' does not apply to the new best {parent[:12]}")
        return False, None

    def _applies(self, proposal: Proposal, parent: str) -> bool:
        if any(edit.content is not None for edit in proposal.edits):
            return False
        ctx = self.controller.proposal_context(parent)
        cfg = self.controller.config
        try:
            files = materialize(proposal, str(self.controller.project_dir), parent, ctx.read_parent_file)
            validate(files, ctx.read_parent_file, editable=cfg.editable, protected=cfg.protected)
        except InvalidProposal:
            return False
        return True

    def release(self, proposal: Proposal, why: str) -> None:
        """A proposal that will not run: its idea waits again, its calls are still counted."""
        run_id = self.controller.run_row["id"]
        if proposal.idea_id:
            self.store.set_idea_status(proposal.idea_id, IdeaStatus.PENDING)
        for call in proposal.meta.get("calls", ()):
            self.store.add_proposal_record(run_id=run_id, **{**call, "error": call.get("error") or why})

    def close(self) -> None:
        """At the end of the run: hand back whatever was prepared and not run."""
        with self.job_lock:
            job, self._job = self._job, None
        if job is None:
            return
        if job.done.wait(CLOSE_WAIT_SECONDS):
            if job.proposal is not None:
                self.release(job.proposal, "superseded: the run stopped before it ran")
            return
        idea = job.ctx.extra.get("taken_idea")
        if idea is not None:
            self.store.set_idea_status(idea, IdeaStatus.PENDING)
        self.store.add_event(self.controller.run_row["id"], "prefetch",
                             "a proposal still being prepared was abandoned when the run stopped")
