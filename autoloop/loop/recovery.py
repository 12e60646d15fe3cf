"""Crash recovery: processes, git and the db made to agree after a dead controller.

On every start, holding the working tree's lock (autoloop.loop.lock), so no live
controller owns what it finds:

* `reap_helpers`: helper processes (coding agents) of this folder's runs that a dead
  controller left running are ended, their temporary clones deleted, for any tag.
* `recover` (a resumed run): a training process group left by the dead controller is
  killed (its recorded pid and start time must match, so a recycled pid is safe; a kept
  trial's too: its reserve run, autoloop.loop.reserve, may have been in flight); a trial
  whose measurements are recorded resumes where it stopped (the run in flight is lost and
  run again; none recorded is repeated); any other `running` trial becomes `interrupted`
  and its idea goes back to the queue; commits of finished trials that lack their archive
  ref get one; a branch tip no trial made is kept under `refs/autoloop/<tag>/orphans/`;
  and the branch and worktree are reset to the db's best commit.

The crash-loop guard: a trial that was recovered once already (a `recovered` event names
it), or a trial of an idea whose earlier trial was, is neither resumed nor re-queued: it
ends `interrupted` saying the controller stopped twice while it ran, and its idea is
done. One proposal that kills the controller (or the machine) cannot end the night.
"""

from __future__ import annotations

from autoloop.base.processes import kill_process_group
from autoloop.store import IdeaStatus, Kind, Status
from autoloop.loop.host import TrialHost

TWICE = ("the controller stopped twice while this trial ran (it had been recovered once already): it is not resumed "
         "or tried again, so that one proposal cannot stop the night")


def reap_helpers(c: TrialHost) -> None:
    """End helper processes (coding agents) of this folder's runs that a dead controller
    left running, and delete their temporary clones (autoloop.proposers.agent). Part of
    recovery, for a new tag too: it runs holding the working tree's lock, so no live
    controller owns them."""
    from autoloop.proposers.agent import reap_helpers as reap

    for run in c.store.runs():
        if run.get("repo") in (None, str(c.project_dir)):  # a db shared with other folders: only ours
            for line in reap(c.store, [run["id"]]):
                c.store.add_event(run["id"], "recovered", f"helper process left by a dead controller: {line}")


def recovered_before(store, run_id: int) -> tuple[set[int], set[int]]:
    """(ids of trials recovered after a dead controller, ids of their ideas)."""
    trial_ids = {e["trial_id"] for e in store.events(run_id, kind="recovered") if e.get("trial_id") is not None}
    ideas = set()
    for trial_id in trial_ids:
        row = store.trial_by_id(trial_id)
        if row is not None and row.get("idea_id"):
            ideas.add(row["idea_id"])
    return trial_ids, ideas


def recover(c: TrialHost) -> list[int]:
    """Make processes, git and db agree after a dead controller. Returns recovered trial numbers."""
    store = c.store
    run_id = c.run_row["id"]
    recovered = []
    ours_dirty = False
    trials_before, ideas_before = recovered_before(store, run_id)
    for trial in store.running_trials(run_id):
        if trial.get("pgid"):
            kill_process_group(trial["pgid"], expected_pid=trial.get("pid"), expected_start_time=trial.get("pid_start_time"))
        recovered.append(trial["number"])
        ours_dirty = True
        if trial["id"] in trials_before or (trial.get("idea_id") and trial["idea_id"] in ideas_before):
            store.update_trial(trial["id"], status=Status.INTERRUPTED, reason=TWICE)
            if trial.get("idea_id"):
                store.set_idea_status(trial["idea_id"], IdeaStatus.DONE, trial_id=trial["id"])
            c.event("recovered", f"trial {trial['number']} interrupted: the controller stopped twice while it ran",
                    trial_id=trial["id"])
            continue
        done = store.measurements_for(trial["id"])
        # An ablation or a ladder rung is not the loop's to resume: its command (`ablate`,
        # `ladder`, `run --ladder`) finds it and goes on.
        if done and trial.get("trial_commit") and trial["kind"] not in (Kind.ABLATION.value, Kind.LADDER.value):
            # Its measurements are recorded: the trial goes on where it stopped (the run in
            # flight is lost and run again; none recorded is repeated).
            c.event("recovered", f"trial {trial['number']} resumes after a dead controller with "
                    f"{len(done)} measurement{'s' if len(done) != 1 else ''} recorded", trial_id=trial["id"])
            continue
        store.update_trial(
            trial["id"], status=Status.INTERRUPTED,
            reason="the controller stopped while this trial ran; recovered at the next start",
        )
        if trial.get("idea_id"):
            # The idea was never evaluated: give it back to the queue.
            store.set_idea_status(trial["idea_id"], IdeaStatus.PENDING)
        c.event("recovered", f"trial {trial['number']} interrupted by a dead controller", trial_id=trial["id"])
    for trial in store.trials(run_id, status=Status.KEEP):
        if trial.get("pgid"):  # a reserve run of the best (autoloop.loop.reserve) left by the dead controller
            kill_process_group(trial["pgid"], expected_pid=trial.get("pid"), expected_start_time=trial.get("pid_start_time"))
    for idea in store.ideas(run_id, status=IdeaStatus.TAKEN):
        # Taken for a proposal that never became a trial (possibly prepared in the
        # background), or whose trial ended just before the controller died.
        trial = store.trial_by_id(idea["trial_id"]) if idea.get("trial_id") else None
        if trial is None or trial["status"] == Status.INTERRUPTED.value:
            store.set_idea_status(idea["id"], IdeaStatus.PENDING)
        elif trial["status"] != Status.RUNNING.value:
            store.set_idea_status(idea["id"], IdeaStatus.DONE)
    archived = c.repo.archived(c.tag)
    best = c.best_commit()
    for trial in store.trials(run_id):
        sha = trial.get("trial_commit")
        if sha and trial["kind"] != Kind.BASELINE.value and trial["status"] != Status.KEEP.value \
                and sha != best and trial["number"] not in archived and c.repo.commit_exists(sha):
            c.repo.archive(c.tag, trial["number"], sha)
    tip = c.repo.branch_commit(c.branch)
    if tip is not None and tip != best:
        known = {t.get("trial_commit") for t in store.trials(run_id)} | {c.run_row["base_commit"]}
        if tip not in known:
            # A commit on the run's branch that no trial made: keep it reachable.
            ref = f"refs/autoloop/{c.tag}/orphans/{tip[:12]}"
            c.repo.set_ref(ref, tip)
            c.event("recovered", f"branch tip {tip[:12]} had no trial row; archived as {ref}")
        ours_dirty = True
    if ours_dirty or (tip is not None and tip != best):
        c.checkout(best)
    return recovered
