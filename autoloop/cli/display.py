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

from autoloop.loop.progress import PLAIN_EVERY, PlainProgress, duration, progress_words  # noqa: F401
from autoloop.review.queries import last_progress
from autoloop.loop.run import run_words
from autoloop.review.text import format_metric

_STYLE = {"keep": "bold green", "discard": "dim", "crash": "red", "timeout": "red", "invalid": "magenta",
          "interrupted": "yellow"}
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
        from autoloop.base.redact import redact
        from autoloop.base.text import strip_controls

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
