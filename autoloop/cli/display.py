"""Live progress of a run on the terminal (rich): the current trial, its step and loss,
tokens/s, time left, and the best so far. Reads the trial's progress file, like
`autoloop status`.

A trial of several runs prints one line per run, each saying which run it is: the seed,
and whose code trains (the candidate, the baseline, or the incumbent re-measured for the
candidate). A header given with `later()` is printed only once something else is, so a
run that fails before it starts prints its one-line error alone.

On a terminal the running trial's figures are one live status line. Anywhere else (a
pipe, `nohup autoloop run > night.log`) they are plain lines, at most one every
`PLAIN_EVERY` seconds so that a night's log stays readable, and nothing is wrapped at 80
columns: a line of the log is a line of the run. The figures are train.py's own progress
records, read as untrusted data (`autoloop.trust.untrusted.progress_record`: a bounded
line, finite numbers of a sane size, nothing evaluated), and every line printed passes
through `strip_controls`.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.text import Text

from autoloop.review.queries import last_progress
from autoloop.review.text import format_metric, run_words

_STYLE = {"keep": "bold green", "discard": "dim", "crash": "red", "timeout": "red", "invalid": "magenta",
          "interrupted": "yellow"}
PLAIN_EVERY = 10.0  # seconds between two plain progress lines: ~30 lines for a 5-minute run


def _duration(seconds: float) -> str:
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
            estimate = f" (~{_duration(steps_left * trained / step)})"
        words.append(f"{steps_left} steps left{estimate}")
    elif record.get("seconds_left") is not None:
        words.append(f"{_duration(record['seconds_left'])} left")
    elif time_budget and trained is not None:
        words.append(f"{_duration(time_budget - trained)} left")
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


class Display:
    def __init__(self, console: Console | None = None, *, plain_every: float | None = None):
        self.console = console or Console()
        if not self.console.is_terminal:
            self.console.soft_wrap = True  # a pipe or a log file: a line of the run is one line, never cut at 80
        self.plain_every = PLAIN_EVERY if plain_every is None else plain_every
        self._status = None
        self._trial = None
        self._best = None
        self._budget = None
        self._plain: PlainProgress | None = None  # the running run's figures
        self._started = 0.0
        self._last_poll = 0.0
        self._later: list[tuple[str, str | None]] = []

    def later(self, message: str, style: str | None = None) -> None:
        """Print `message` before the next thing said (never, if nothing is)."""
        self._later.append((message, style))

    def say(self, message: str, style: str | None = None) -> None:
        from autoloop.trust.redact import redact
        from autoloop.trust.text import strip_controls

        pending, self._later = self._later, []
        for text, text_style in pending:
            self.console.print(redact(strip_controls(text)), style=text_style, markup=False, highlight=False)
        self.console.print(redact(strip_controls(message)), style=style, markup=False, highlight=False)

    def trial_started(self, trial: dict, best: float | None, config, *, seed: int | None = None,
                      role: str | None = None, owner: dict | None = None) -> None:
        self._trial, self._best, self._started = trial, best, time.monotonic()
        self._plain = PlainProgress(f"trial {trial['number']}", config, self.plain_every)
        self._budget = f"{config.max_steps} steps" if config.max_steps else f"{config.time_budget:.0f}s"
        self.say(f"trial {trial['number']} [{trial['kind']}] {trial.get('description') or ''}"
                 + run_words(trial, seed, role, owner), "bold")
        if self.console.is_terminal:
            self._status = self.console.status(self._line(None))
            self._status.start()

    def _line(self, progress: dict | None) -> Text:
        elapsed = time.monotonic() - self._started
        parts = [f"trial {self._trial['number']}", f"{elapsed:.0f}s elapsed", f"budget {self._budget}"]
        parts.extend(self._plain.words(progress))
        parts.append(f"best {format_metric(self._best)}")
        return Text(" | ".join(parts))  # a Text, not a str: nothing in it is read as rich markup

    def poll(self, progress_path: Path, trial: dict | None = None) -> None:
        """Show the running run's progress (`trial`: which one, for a console shared by
        several; one run at a time here)."""
        if self._plain is None or time.monotonic() - self._last_poll < 1.0:
            return
        self._last_poll = time.monotonic()
        if self._status is not None:
            self._status.update(self._line(last_progress(progress_path)))
            return
        line = self._plain.line(progress_path)
        if line is not None:
            self.say(line)

    def trial_finished(self, trial: dict) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
        delta = f" ({trial['delta']:+.6f})" if trial.get("delta") is not None else ""
        self.say(
            f"  -> {trial['status']}: val_bpb {format_metric(trial.get('metric'))}{delta}; {trial.get('reason') or ''}",
            _STYLE.get(trial["status"]),
        )
