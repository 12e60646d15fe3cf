"""Live progress of a run on the terminal (rich): the current trial, its step and loss,
time left, and the best so far. Reads the trial's progress file, like `autoloop status`."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

_STYLE = {"keep": "bold green", "discard": "dim", "crash": "red", "timeout": "red", "invalid": "magenta",
          "interrupted": "yellow"}


def last_progress(path: Path) -> dict | None:
    """The last complete progress record of a progress file (cheap: reads only the tail).
    The trial's code writes that file: it is read without following links, only if it is
    a regular file, and only its known numeric fields are kept (autoloop.serve.files)."""
    from autoloop.serve.files import last_progress as read_last

    return read_last(path)


def format_metric(value) -> str:
    return "-" if value is None else f"{value:.6f}"


class Display:
    def __init__(self, console: Console | None = None):
        self.console = console or Console()
        self._status = None
        self._trial = None
        self._best = None
        self._budget = None
        self._started = 0.0
        self._last_poll = 0.0

    def say(self, message: str, style: str | None = None) -> None:
        self.console.print(message, style=style, markup=False, highlight=False)

    def trial_started(self, trial: dict, best: float | None, config) -> None:
        self._trial, self._best, self._started = trial, best, time.monotonic()
        self._budget = f"{config.max_steps} steps" if config.max_steps else f"{config.time_budget:.0f}s"
        self.say(f"trial {trial['number']} [{trial['kind']}] {trial.get('description') or ''}", "bold")
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
