"""A model that cannot be reached: when to try it again, and the outages a run recorded.

The schedule (`backoff_seconds`): after the n-th failed request in a row the model is
left alone for `first * 2**(n-1)` seconds, at most `most`. Other sources (ideas, search)
go on meanwhile; with the model as the only source the loop waits for the next try
(autoloop.loop.run), for at most `llm-outage-wait` seconds of one outage and never past
the run's `--hours`.

What the review reads (`outages`): each failed request is a `proposer_unavailable` event
("<proposer>: <why>"), and the first answer after failures a `proposer_back` event. An
outage is the span from the first failure after the last `proposer_back` (or the start)
to the next `proposer_back`; one with no `proposer_back` yet is still going on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone

UNAVAILABLE = "proposer_unavailable"
BACK = "proposer_back"


def backoff_seconds(failures: int, first: float, most: float) -> float:
    """Seconds to leave a source alone after `failures` failed requests in a row."""
    if failures <= 0:
        return 0.0
    return min(first * 2.0 ** min(failures - 1, 60), most)  # the exponent's cap keeps a long outage finite


def clock(when: float | str) -> str:
    """'19:40 UTC' from a Unix time or an event's ISO time."""
    if isinstance(when, str):
        moment = datetime.fromisoformat(when)
        moment = moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)
    else:
        moment = datetime.fromtimestamp(when, timezone.utc)
    return moment.astimezone(timezone.utc).strftime("%H:%M UTC")


@dataclass
class Outage:
    """A source that is unavailable now, as the proposer itself sees it."""

    proposer: str
    where: str  # "the model gpt-4.1 at http://...", for a human
    since: float  # Unix time of the first failure in a row
    error: str  # the latest failure
    failures: int
    retry_at: float | None  # Unix time worth trying again; None: not again in this run (max-cost)

    def describe(self) -> str:
        if self.retry_at is None:
            return f"{self.where}: {self.error}"
        return f"{self.where} was unreachable since {clock(self.since)}: {self.error}"

    def retry_in(self, now: float | None = None) -> float:
        return max(0.0, (self.retry_at or 0.0) - (time.time() if now is None else now))


def outages(events: list[dict]) -> list[dict]:
    """The outages in `events` (oldest first, each with `kind`, `message`, `created_at`):
    [{proposer, since, until (None: still going on), failures, error}], oldest first."""
    found: list[dict] = []
    current: dict[str, dict] = {}
    for event in events:
        proposer, _, message = (event.get("message") or "").partition(": ")
        if event.get("kind") == UNAVAILABLE:
            outage = current.get(proposer)
            if outage is None:
                outage = current[proposer] = {"proposer": proposer, "since": event["created_at"], "until": None,
                                              "failures": 0, "error": ""}
                found.append(outage)
            outage["failures"] += 1
            outage["error"] = message
        elif event.get("kind") == BACK and proposer in current:
            current.pop(proposer)["until"] = event["created_at"]
    return found


def describe_outage(outage: dict) -> str:
    """One line for `status`, the report and the page."""
    failures = f"{outage['failures']} failed request{'s' * (outage['failures'] != 1)}"
    if outage["until"] is None:
        return f"{outage['proposer']} unavailable since {clock(outage['since'])} ({failures}): {outage['error']}"
    return (f"{outage['proposer']} was unavailable {clock(outage['since'])}-{clock(outage['until'])} ({failures}), "
            f"back since; last error: {outage['error']}")


def left_open(store, run_id: int, proposer: str) -> dict | None:
    """The run's outage of `proposer` still going on by its events (None: none), e.g. one an
    earlier invocation recorded before it stopped: the proposer's first answer ends it."""
    events = [e for e in store.events(run_id) if e.get("kind") in (UNAVAILABLE, BACK)]
    return next((o for o in outages(events) if o["proposer"] == proposer and o["until"] is None), None)


def answered(store, run_id: int, proposer: str, where: str, failures: int, since: float | None,
             *, checked: bool, noun: str = "failure") -> None:
    """A proposer answered: write `proposer_back` if it was down, in this invocation
    (`failures` in a row since `since`) or, when not `checked` yet, by an earlier one's events."""
    if failures:
        store.add_event(run_id, BACK, f"{proposer}: {where} answers again after {failures} "
                                      f"{noun}{'s' * (failures != 1)} (since {clock(since)})")
    elif not checked:
        earlier = left_open(store, run_id, proposer)
        if earlier is not None:
            store.add_event(run_id, BACK, f"{proposer}: {where} answers again (down since {clock(earlier['since'])})")

