"""Live progress of a run on the terminal (rich): the current trial, its step and loss,
time left, and the best so far. Reads the trial's progress file, like `autoloop status`.

A trial of several runs prints one line per run, each saying which run it is: the seed,
and whose code trains (the candidate, the baseline, or the incumbent re-measured for the
candidate). A header given with `later()` is printed only once something else is, so a
run that fails before it starts prints its one-line error alone."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from autoloop.review.queries import last_progress
from autoloop.loop.run import run_words
from autoloop.review.text import format_metric

_STYLE = {"keep": "bold green", "discard": "dim", "crash": "red", "timeout": "red", "invalid": "magenta",
          "interrupted": "yellow"}


class Display:
    def __init__(self, console: Console | None = None):
        self.console = console or Console()
        self._status = None
        self._trial = None
        self._best = None
        self._budget = None
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
        self._budget = f"{config.max_steps} steps" if config.max_steps else f"{config.time_budget:.0f}s"
        self.say(f"trial {trial['number']} [{trial['kind']}] {trial.get('description') or ''}"
                 + run_words(trial, seed, role, owner), "bold")
        if self.console.is_terminal:
            self._status = self.console.status(self._line(None))
            self._status.start()

    def _line(self, progress: dict | None) -> str:
        elapsed = time.monotonic() - self._started
        parts = [f"trial {self._trial['number']}", f"{elapsed:.0f}s elapsed", f"budget {self._budget}"]
        if progress:
            parts.append(f"step {progress.get('step')}")
            if progress.get("loss") is not None:
                parts.append(f"loss {progress['loss']:.4f}")
            if progress.get("seconds_left") is not None:
                parts.append(f"{progress['seconds_left']:.0f}s left")
        parts.append(f"best {format_metric(self._best)}")
        return " | ".join(parts)

    def poll(self, progress_path: Path) -> None:
        if self._status is None or time.monotonic() - self._last_poll < 1.0:
            return
        self._last_poll = time.monotonic()
        self._status.update(self._line(last_progress(progress_path)))

    def trial_finished(self, trial: dict) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
        delta = f" ({trial['delta']:+.6f})" if trial.get("delta") is not None else ""
        self.say(
            f"  -> {trial['status']}: val_bpb {format_metric(trial.get('metric'))}{delta}; {trial.get('reason') or ''}",
            _STYLE.get(trial["status"]),
        )
