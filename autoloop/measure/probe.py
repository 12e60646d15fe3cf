"""A short, fixed speed probe of the machine, taken in the worker's process around each
training run.

In time mode a run trains as many steps as the machine gives it in the budget, so a
candidate measured while another process eats half the CPU trains half the steps and
looks worse (or, measured when the load went away, better) for reasons that are not its
code's. The feed's throughput (tokens per second) cannot tell the two apart: a change to
the model changes it too. A fixed piece of work can: `machine_speed()` times the same
work every time (a few hundredths of a second on a quiet core) and returns its speed.
The worker takes it right before training starts and again right after it ends, and
records the mean of the two with the measurement (`measurements.machine_speed`);
`autoloop.decide.confound` compares the two runs of a pair with it.

What it measures is one core's worth of plain Python as this process gets it from the
scheduler: a busy machine (burners, another project's loop) gives it a smaller share, a
throttled CPU runs it slower. It is single-threaded on purpose: a BLAS's threads
busy-wait for each other on an oversubscribed machine and turn the reading into noise
(a numpy matmul probe spread 0.4-3.2 GFLOP/s between consecutive readings at load 10 on
2 cores). It does not start CUDA (the controller would then hold a CUDA context on the
GPU its trials train on); a throttled GPU shows in the drift checks instead.

The probe's own noise was measured on this project's 2-core development machine (bench/
probe_noise.py prints it); autoloop.decide.confound holds the tolerance derived from it.
In step mode (`--max-steps`) a run's result does not depend on the machine's speed, so
no probe is taken.
"""

from __future__ import annotations

import time

# The fixed work: LOOPS iterations of a little integer arithmetic, about 0.04 s on a quiet
# core of the development machine (0.1 s at load 9): several of the scheduler's time
# slices (a burner sharing the core shows as a lower speed), and nothing next to a
# training run (it runs twice per run, before and after).
LOOPS = 300_000


def machine_speed(loops: int = LOOPS) -> float:
    """Million loop iterations per second of a fixed piece of pure Python in this process.
    Higher is faster; only the ratio of two readings means anything."""
    x = 0
    started = time.perf_counter()
    for i in range(loops):
        x = (x * 31 + i) & 0xFFFFF
    elapsed = time.perf_counter() - started
    return loops / max(elapsed, 1e-9) / 1e6


def around_training(step_mode: bool):
    """A probe for one run: `speed = around_training(...)` before training, then
    `speed.end()` after it; `speed.value` is the mean of the two readings (None in step
    mode, where speed does not move the result)."""
    return _Around(None if step_mode else machine_speed())


class _Around:
    def __init__(self, before: float | None):
        self.before = before
        self.value: float | None = before

    def end(self) -> float | None:
        if self.before is None:
            return None
        after = machine_speed()
        self.value = (self.before + after) / 2.0
        return self.value
