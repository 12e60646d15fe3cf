"""A running trial's progress as words, and as plain lines at most every few seconds.

Read from train.py's own progress file, which is the trial's and so untrusted: through
autoloop.trust.untrusted (length-capped lines, finite numbers of a sane size, nothing
evaluated). The console (autoloop.cli.display) shows the words in its live line on a
terminal and the plain lines elsewhere; with several workers the loop's SharedDisplay
prints the plain lines, one per trial (autoloop.loop.run).
"""

from __future__ import annotations

import time
from pathlib import Path

from autoloop.trust.untrusted import last_progress

PLAIN_EVERY = 10.0  # seconds between two plain progress lines: ~30 lines for a 5-minute run


def duration(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def progress_words(record: dict, *, max_steps: int | None, time_budget: float | None) -> list[str]:
    """A progress record (already validated: numbers only) as 'step 40/120', 'loss 3.5123',
    '1,234 tok/s', '80 steps left (~35 s)' or '4.1 min left': what is known of them.

    Time left is read from train.py's own clock (its training seconds), so it is the
    training still to do, not counting the evaluation after it."""
    words = []
    step = record.get("step")
    trained = record.get("training_seconds")
    if step is not None:
        words.append(f"step {step}/{max_steps}" if max_steps else f"step {step}")
    if record.get("loss") is not None:
        words.append(f"loss {record['loss']:.4f}")
    if record.get("tokens_per_second") is not None:
        words.append(f"{record['tokens_per_second']:,.0f} tok/s")
    if max_steps and step is not None:
        steps_left = max(max_steps - step, 0)
        estimate = ""
        if trained is not None and step > 0 and trained > 0:
            estimate = f" (~{duration(steps_left * trained / step)})"
        words.append(f"{steps_left} steps left{estimate}")
    elif record.get("seconds_left") is not None:
        words.append(f"{duration(record['seconds_left'])} left")
    elif time_budget and trained is not None:
        words.append(f"{duration(time_budget - trained)} left")
    return words


class PlainProgress:
    """One run's plain progress lines: at most one every `every` seconds, never the same
    step twice. `line()` reads the run's progress file (autoloop.trust.untrusted) and
    returns the line to print now, or None."""

    def __init__(self, label: str, config, every: float):
        self.label = label
        self.max_steps = config.max_steps or None
        self.time_budget = None if config.max_steps else config.time_budget
        self.every = every
        self.started = time.monotonic()
        self._last_line: float | None = None
        self._last_step = None

    def words(self, progress: dict | None) -> list[str]:
        if not progress:
            return []
        return progress_words(progress, max_steps=self.max_steps, time_budget=self.time_budget)

    def line(self, progress_path: Path) -> str | None:
        now = time.monotonic()
        if self._last_line is not None and now - self._last_line < self.every:
            return None
        progress = last_progress(progress_path)
        words = self.words(progress)
        if not words or progress.get("step") == self._last_step:
            return None
        self._last_line, self._last_step = now, progress.get("step")
        return f"  {self.label}: " + " | ".join(words) + f" | {now - self.started:.0f} s elapsed"
