"""The training budget, kept by the harness so every trial is timed the same way."""

from __future__ import annotations

from autoloop.harness.constants import UNTIMED_WARMUP_STEPS


class TrainingClock:
    """Counts optimizer steps and timed training seconds against the budget.

    The first UNTIMED_WARMUP_STEPS steps (compilation, autotuning) are timed separately
    as `compile_seconds` and not charged to the budget. In step mode (max_steps set)
    progress is steps / max_steps and time is only reported, which makes tests
    deterministic. The caller synchronizes CUDA before measuring a step, so the seconds
    it reports are real.

    Under the controller (AUTOLOOP_FEED set) every finished step also ticks the harness's
    data feed, which times the ticks with the controller's own clock: the budget is
    judged from those times (autoloop.trust.budget), not from the seconds reported here.
    """

    def __init__(self, spec=None, *, time_budget: float | None = None, max_steps: int | None = None,
                 warmup_steps: int = UNTIMED_WARMUP_STEPS):
        if spec is not None:
            time_budget, max_steps = spec.time_budget, spec.max_steps
        if time_budget is None and max_steps is None:
            raise ValueError("TrainingClock needs a time budget or a step budget")
        self.time_budget = time_budget
        self.max_steps = max_steps
        self.warmup_steps = warmup_steps
        self.steps = 0
        self.training_seconds = 0.0
        self.compile_seconds = 0.0
        from autoloop.harness.feed import active_feed

        self._feed = active_feed()

    @property
    def step_mode(self) -> bool:
        return self.max_steps is not None

    @property
    def progress(self) -> float:
        """Fraction of the budget used before the next step, in [0, 1]."""
        if self.step_mode:
            return min(self.steps / self.max_steps, 1.0)
        return min(self.training_seconds / self.time_budget, 1.0)

    @property
    def done(self) -> bool:
        if self.step_mode:
            return self.steps >= self.max_steps
        return self.training_seconds >= self.time_budget

    def step_finished(self, seconds: float) -> None:
        if self.steps < self.warmup_steps:
            self.compile_seconds += seconds
        else:
            self.training_seconds += seconds
        self.steps += 1
        if self._feed is not None:
            self._feed.tick(self.steps)
