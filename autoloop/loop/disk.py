"""A full disk, wherever it surfaces in a trial, is not the proposal's fault, unless the
trial filled it.

A trial that wrote more than half of what the disk had free when it started (or more
than its own disk limit) is stopped by its resource watch (autoloop.measure.limits) and
is `invalid` with the limit named: its own fault, its out/ deleted, the run goes on.
Every other full disk is the machine's:

The training log ("No space left on device" from saving a checkpoint), git (which names
`index.lock` as the file it could not create), the db or our own writes: `Controller.execute`
catches it in any of them, the trial it hit becomes `interrupted` (its idea goes back to
the queue), the db is left with no `running` row, and the run pauses with that diagnosis
(`pause_for_full_disk`, the pause taken by the loop before its next work item). When not
even the db can be written, `DiskFull` says so and the next start recovers it. At exit,
git that cannot be reset to the best commit is said, not raised (`converge_git_at_exit`).
"""

from __future__ import annotations

import shutil

from autoloop.errors import DiskFull, disk_full_what, is_disk_full
from autoloop.measure.limits import is_limit_reason
from autoloop.base.processes import kill_process_group
from autoloop.store import IdeaStatus, Kind, Status
from autoloop.loop.host import TrialHost


def disk_full_line(*texts: str | None) -> str | None:
    """The last line of a training log tail (or reason) that says the disk is full."""
    for text in texts:
        for line in reversed((text or "").splitlines()):
            if is_disk_full(line):
                return line.strip()[:200]
    return None


def failed_for_full_disk(trial: dict) -> str | None:
    """The log line saying the disk is full, for a trial that crashed, timed out or failed
    its checks (the verifier's evaluation can run out of space too)."""
    if trial.get("status") not in (Status.CRASH.value, Status.TIMEOUT.value, Status.INVALID.value):
        return None
    if trial.get("status") == Status.INVALID.value and is_limit_reason(trial.get("reason")):
        return None  # over its own limits (a disk it filled included): the trial's fault
    return disk_full_line(trial.get("error_tail"), trial.get("reason"))


def pause_for_full_disk(c: TrialHost, what: str, trial: dict | None = None) -> dict:
    """The trial the disk filled up in (and any other `running` one) ends `interrupted`,
    its idea back in the queue; the run pauses before the next work item. Returns the
    trial's row."""
    try:
        free = f", {shutil.disk_usage(c.state_dir).free >> 20} MB free"
    except OSError:
        free = ""
    reason = (f"the disk is full ({what}{free}): free some space, then resume with "
              f"`autoloop run --tag {c.tag}`")
    run_id = c.run_row["id"]
    try:
        hit = {t["id"]: t for t in c.store.running_trials(run_id)}
        if trial is not None:
            hit[trial["id"]] = trial
        for row in hit.values():
            if row.get("pgid"):
                kill_process_group(row["pgid"], expected_pid=row.get("pid"),
                                   expected_start_time=row.get("pid_start_time"))
            c.store.update_trial(row["id"], status=Status.INTERRUPTED, reason=reason)
            if row.get("idea_id"):
                c.store.set_idea_status(row["idea_id"], IdeaStatus.PENDING)
            archive_quietly(c, row)
        c.event("disk_full", reason, trial_id=next(iter(hit), None))
    except Exception as exc:
        if is_disk_full(exc):  # not even the db can be written: the next start recovers it
            raise DiskFull(f"{reason}; experiments.db could not be updated either (the next start recovers it)") from exc
        raise
    c.say(reason, "red")
    c.pauses.request(reason)
    latest = c.store.trials(run_id, last=1)
    return c.store.trial_by_id(trial["id"]) if trial is not None else (latest[0] if latest else {})


def archive_quietly(c: TrialHost, trial: dict) -> None:
    """Archive a non-kept trial's commit now if the disk allows; else recovery does it."""
    sha = trial.get("trial_commit")
    if not sha or trial["kind"] in (Kind.BASELINE.value, Kind.RERUN.value) or sha == c.best_commit():
        return
    try:
        c.repo.archive(c.tag, trial["number"], sha)
    except Exception as exc:
        if not is_disk_full(exc):
            raise


def converge_git_at_exit(c: TrialHost) -> None:
    """Leave git on the best commit; on a full disk say so: the next start does it."""
    try:
        c.converge_git()
    except Exception as exc:
        if not is_disk_full(exc):
            raise
        c.say(f"git is not reset to the best commit ({disk_full_what(exc)}): the next start does it", "yellow")
