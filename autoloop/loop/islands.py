"""Lineages and re-queued edits: what several workers add to the one-incumbent loop.

Two search modes with several workers (autoloop.loop.run):

* *shared*: every worker trains proposals from the one best commit. A trial that beats
  its incumbent after another trial was kept while it trained is not kept over the newer
  best (`Islands.stale_keep`): it is discarded with that reason, and its edit, re-based
  onto the new best with a three-way merge of each file (`GitRepo.rebased_files`), goes
  into the `Requeue` when it still applies;
* *islands*: worker k advances lineage `w<k>` on branch `autoloop/<tag>-w<k>`; each
  lineage's incumbent is named in `runs.islands` ({lineage: trial id}, read through
  `Store.best_trial(run, lineage)`), and the run's best commit is the best of them. Every
  `migrate_every` finished trials the best lineage's incumbent is adopted by every
  lineage it beats (`Islands.migrate`).

The serial loop has no lineage (`lineage_of` is None) and never finds a keep stale: one
trial at a time, the incumbent cannot move under it.

The re-queue lives in the db (a discarded trial's decision says `requeued`), so edits an
invocation re-queued and never ran are loaded again by the next (`Requeue.load`). Trial
threads add to it as they finish, the main thread takes from it as it schedules: its
`lock` guards the entries.
"""

from __future__ import annotations

import threading

from autoloop.store import Kind, Status
from autoloop.loop.host import TrialHost


class Islands:
    """The run's lineages (see the module docstring); git moves under `Controller.refs_lock`."""

    def __init__(self, controller: TrialHost):
        self.c = controller

    def lineage_of(self, slot) -> str | None:
        """Islands: worker k advances lineage w<k>; shared (or serial): one lineage for all."""
        return slot.name if self.c.config.search_mode == "islands" and self.c.parallel else None

    def incumbents(self) -> dict[str, int]:
        """{lineage: the trial id of its incumbent}, as the run row has it now."""
        raw = (self.c.store.get_run(self.c.tag) or {}).get("islands")
        return dict(raw) if isinstance(raw, dict) else {}

    def incumbent(self, lineage: str | None) -> dict | None:
        """What a trial of `lineage` is compared with: the run's incumbent, or in islands
        mode the lineage's own."""
        islands = lineage if lineage and self.c.config.search_mode == "islands" else None
        return self.c.store.best_trial(self.c.run_row["id"], lineage=islands)

    def parent_for(self, lineage: str | None) -> str:
        """The commit new proposals of `lineage` start from."""
        if lineage and self.c.config.search_mode == "islands":
            incumbent = self.incumbent(lineage)
            if incumbent is not None and incumbent.get("trial_commit"):
                return incumbent["trial_commit"]
        return self.c.best_commit()

    def branch(self, lineage: str) -> str:
        return f"{self.c.branch}-{lineage}"

    def keep_in_lineage(self, trial: dict, lineage: str) -> str:
        """Islands: `trial` is its lineage's incumbent now; returns the run's best commit
        (the best incumbent over the lineages). Called holding `refs_lock` (a finish)."""
        islands = self.incumbents()
        islands[lineage] = trial["id"]
        self.c.store.update_run(self.c.run_row["id"], islands=islands)
        self.c.repo.set_lineage_branch(self.branch(lineage), trial["trial_commit"])
        return self._best_incumbent(islands, extra=trial)["trial_commit"]

    def _best_incumbent(self, islands: dict[str, int], extra: dict | None = None) -> dict:
        """The lowest metric among the lineages' incumbents (`extra`: a keep not yet recorded)."""
        store = self.c.store
        rows = [store.trial_by_id(tid) for tid in islands.values()]
        if extra is not None:
            rows.append({**store.trial_by_id(extra["id"]), **{k: v for k, v in extra.items() if v is not None}})
        rows = [r for r in rows if r is not None and r.get("metric") is not None]
        return min(rows, key=lambda r: r["metric"])

    def after_trial(self, trial: dict) -> None:
        """In the main thread after each trial: every `migrate_every` finished trials, islands migrate."""
        every = self.c.config.migrate_every
        if self.c.config.search_mode != "islands" or not every or not self.c.parallel:
            return
        finished = [t for t in self.c.store.trials(self.c.run_row["id"])
                    if t["status"] != Status.RUNNING.value and t["kind"] != Kind.BASELINE.value]
        if len(finished) % every == 0:
            self.migrate()

    def migrate(self) -> list[str]:
        """The best lineage's incumbent becomes the incumbent of every lineage it beats."""
        c = self.c
        with c.refs_lock:
            islands = self.incumbents()
            lineages = [self.lineage_of(slot) for slot in (c.executor.slots if c.executor else [])]
            base = c.store.best_trial(c.run_row["id"], lineage="main")
            for lineage in lineages:
                if lineage and lineage not in islands and base is not None:
                    islands[lineage] = base["id"]
            if len(islands) < 2:
                return []
            best = self._best_incumbent(islands)
            moved = []
            for lineage, trial_id in sorted(islands.items()):
                row = c.store.trial_by_id(trial_id)
                if trial_id == best["id"] or row is None or row.get("metric") is None or row["metric"] <= best["metric"]:
                    continue
                islands[lineage] = best["id"]
                c.repo.set_lineage_branch(self.branch(lineage), best["trial_commit"])
                moved.append(f"{lineage} adopts trial {best['number']} ({best['metric']:.4f} < {row['metric']:.4f})")
            if moved:
                c.store.update_run(c.run_row["id"], islands=islands)
                c.event("migration", "; ".join(moved))
                c.say("migration: " + "; ".join(moved))
            return moved

    def stale_keep(self, trial: dict, outcome, lineage: str | None):
        """A keep decided against an incumbent that is no longer the best (another trial was
        kept while it trained) is not kept over the newer best; its edit is re-queued on the
        new best when it still applies. Called holding `refs_lock` (a finish), so the best
        cannot move between this look and the finish."""
        from autoloop.loop.trial import TrialOutcome

        if outcome.status != Status.KEEP or trial["kind"] == Kind.BASELINE.value:
            return outcome
        compared = (outcome.fields.get("decision") or {}).get("incumbent_id")
        current = self.incumbent(lineage)
        if compared is None or current is None or current["id"] == compared:
            return outcome
        c = self.c
        old = c.store.trial_by_id(compared)
        files, problem = rebased(c, trial, current["trial_commit"])
        what = (f"better than its incumbent, trial {old['number'] if old else compared} ({outcome.reason}), but trial "
                f"{current['number']} was kept while it trained")
        if problem:
            reason = f"{what}; not re-queued: {problem}"
        else:
            c.requeue.add(trial["id"], lineage)
            outcome.fields["decision"] = {**(outcome.fields.get("decision") or {}), "requeued": True}
            reason = f"{what}; its edit is re-queued on the new best"
        c.event("rebase", f"trial {trial['number']}: {reason}", trial_id=trial["id"])
        return TrialOutcome(Status.DISCARD, reason, outcome.fields)


def rebased(c: TrialHost, trial: dict, onto: str) -> tuple[dict[str, str], str | None]:
    """The trial's edit (parent -> trial commit) merged onto `onto` (GitRepo.rebased_files),
    else why it cannot be tried there: no commit, a conflict, or `onto` has it already."""
    parent, mine = trial.get("parent_commit"), trial.get("trial_commit")
    if not parent or not mine:
        return {}, "it has no commit"
    files, problem = c.repo.rebased_files(parent, mine, onto)
    if not problem:
        current = c.repo.file_reader(onto)
        if all(text == current(path) for path, text in files.items()):
            # Another worker's trial made the same change and was kept first: the new best
            # holds it already, and an empty edit is nobody's invalid trial.
            problem = "the current best already has its change"
    return files, problem


class Requeue:
    """Edits to try again on the new best: (trial id, its lineage in islands mode)."""

    def __init__(self, controller: TrialHost):
        self.c = controller
        self.lock = threading.Lock()  # guards `_entries`
        self._entries: list[tuple[int, str | None]] = []

    def load(self) -> None:
        """Edits re-queued by an earlier invocation that never ran again (the controller
        stopped or died first): the queue lives in the db, not only in memory."""
        trials = self.c.store.trials(self.c.run_row["id"])
        retried = {t.get("derived_from") for t in trials}
        with self.lock:
            self._entries = [(t["id"], t.get("lineage") if t.get("lineage") != "main" else None) for t in trials
                             if (t.get("decision") or {}).get("requeued") and t["id"] not in retried]

    def add(self, trial_id: int, lineage: str | None) -> None:
        with self.lock:
            self._entries.append((trial_id, lineage))

    def _pop(self, lineage: str | None) -> tuple[int, str | None] | None:
        with self.lock:
            # Islands: a lineage's edit goes back to its own lineage.
            entry = next((e for e in self._entries if lineage is None or e[1] in (None, lineage)), None)
            if entry is not None:
                self._entries.remove(entry)
            return entry

    def take(self, lineage: str | None = None):
        """A re-queued edit as a work item, re-based onto the current best now (it may have
        moved again); None when there is none that still applies."""
        from autoloop.loop.scheduler import Work, WorkItem
        from autoloop.proposers.proposal import Edit, Proposal

        c = self.c
        while True:
            entry = self._pop(lineage)
            if entry is None:
                return None
            trial = c.store.trial_by_id(entry[0])
            parent = c.islands.parent_for(lineage)
            files, problem = rebased(c, trial, parent)
            if problem:
                c.event("rebase", f"trial {trial['number']} is not tried again: {problem}", trial_id=trial["id"])
                continue
            proposal = Proposal(f"{trial.get('description') or 'edit'} (re-based from trial {trial['number']})",
                                [Edit(path=p, content=text) for p, text in files.items()],
                                source=trial.get("proposer") or "controller")
            return WorkItem(Work.PROPOSAL, reason=proposal.description, proposal=proposal, parent=parent,
                            derived_from=trial["id"])
