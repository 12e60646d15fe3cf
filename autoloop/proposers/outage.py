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

import threading
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


class Availability:
    """One source's failures in a row, its wait before the next try, and its outage: what
    the LLM and the agent proposer each keep (the prefetch thread and a repair may ask at once)."""

    def __init__(self, first: float, most: float):
        self.first, self.most = first, most
        self._lock = threading.Lock()
        self.failures = 0
        self._cool_until = 0.0  # monotonic time before which the source is not asked
        self._since: float | None = None  # Unix time of the first failure in a row
        self._error = ""
        self._checked = False  # whether an outage an earlier invocation left open was looked for

    def cooling(self) -> float:
        """Seconds still to leave the source alone (0: ask it)."""
        return max(0.0, self._cool_until - time.monotonic())

    def failed(self, error: str) -> float:
        """Count a failure; the seconds the source is now left alone."""
        with self._lock:
            self.failures += 1
            pause = backoff_seconds(self.failures, self.first, self.most)
            self._cool_until = time.monotonic() + pause
            self._since = self._since or time.time()
            self._error = error
        return pause

    def outage(self, proposer: str, where: str) -> Outage | None:
        with self._lock:
            if self._since is None:
                return None
            return Outage(proposer, where, self._since, self._error, self.failures, time.time() + self.cooling())

    def answered(self, store, run_id: int, proposer: str, where: str, noun: str = "failure") -> None:
        """The source answered: a `proposer_back` event if it was down, in this invocation
        or, the first time it answers, by an earlier invocation's events."""
        with self._lock:
            failures, since, self.failures, self._since = self.failures, self._since, 0, None
            checked, self._checked = self._checked, True
        if failures:
            store.add_event(run_id, BACK, f"{proposer}: {where} answers again after {failures} "
                                          f"{noun}{'s' * (failures != 1)} (since {clock(since)})")
        elif not checked:
            earlier = left_open(store, run_id, proposer)
            if earlier is not None:
                store.add_event(run_id, BACK, f"{proposer}: {where} answers again (down since {clock(earlier['since'])})")
