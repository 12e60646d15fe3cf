"""When a run kept nothing: the one line `ablate`, `finalize` and `best` print instead.

A short night (the README's first command, a run on a busy machine) can end with no
change adopted over the baseline. Then there is nothing to ablate, no branch to make and
no gain to report, and that is an answer, not an error: each of the three commands says so
in one line (what was tried, how it ended, the closest try) with what to do next, and
exits 0. A run "kept nothing" when its best trial is the baseline (or the baseline measured
again: a drift check, a re-run), or its best commit is still the base commit.
"""

from __future__ import annotations

from autoloop.review.queries import CHANGE_KINDS, PROPOSAL_KINDS, baseline_trial, best_trial, select
from autoloop.store import Kind, Status

# What to try next, in the order it usually helps on a short night.
_NEXT_TRIAL_COUNT = 10


def kept_nothing(store, run: dict) -> bool:
    """Whether the run adopted no change over its baseline (its best is the base commit)."""
    best = best_trial(store, run)
    if best is None or best["kind"] not in CHANGE_KINDS or best["kind"] == Kind.ABLATION.value:
        return True
    return bool(run.get("base_commit")) and best.get("trial_commit") == run["base_commit"]


def nothing_kept_line(store, run: dict, what: str) -> str | None:
    """The one line saying why there is `what` (e.g. "nothing to ablate") and what to try,
    or None when the run kept a change. None too when the run has no baseline yet: the
    commands' own errors say that."""
    if baseline_trial(store, run) is None or not kept_nothing(store, run):
        return None
    tag = run["tag"]
    marks = ",".join("?" * len(PROPOSAL_KINDS))
    rows = select(store, f"SELECT number, status, metric FROM trials WHERE run_id = ? AND kind IN ({marks}) "
                         "ORDER BY number", (run["id"], *PROPOSAL_KINDS))
    resume = f"`autoloop run --tag {tag} --max-trials {_NEXT_TRIAL_COUNT}` resumes it with more trials"
    if not rows:
        return (f"run '{tag}' tried no change yet (only its baseline ran), so there is {what}: {resume}, "
                "and `autoloop seed` queues your own ideas first")
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    how = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    tried = f"{len(rows)} change{'s' if len(rows) != 1 else ''} tried ({how})"
    discarded = [r for r in rows if r["status"] == Status.DISCARD.value and r["metric"] is not None]
    closest = ""
    if discarded:
        near = min(discarded, key=lambda r: r["metric"])["number"]
        closest = f"; the closest was trial {near} (`autoloop show {near}`)"
    return (f"run '{tag}' kept no change over its baseline, so there is {what}: {tried}, none adopted over the "
            f"baseline{closest}. Next: {resume}, `autoloop seed` queues your own ideas first, and a longer budget "
            "(--max-steps, --time-budget) on a new tag lets a change show")
