"""The budget covers start-up: what a trial does before its first timed step is bounded too.

The budget's other rules (autoloop.trust.budget) start at the harness clock: time mode
times the steps after the untimed warm-up, step mode counts steps. Before that a trial
could train for free on text it builds itself (issue 31: 40 s of training on readable text
before the first batch, kept and confirmed, -0.99 bpb). Two phases, each judged on what
the trusted side saw (the feed's clock, and /proc read by the feed: the CPU time of the
whole process tree the runner spawned, autoloop.harness.proctree), never on what the
trial reports:

* start-up: spawn -> the first batch the feed serves. Honest start-up is the interpreter,
  torch, the model, and on a GPU train.py's compile on random tokens (30-90 s). It is
  bounded against the REFERENCE, the run's baseline's own start-up (the largest of its ok
  runs: the first one compiled cold), which the controller passes in the job:
    - CPU: at most max(reference + STARTUP_CPU_MARGIN, STARTUP_CPU_FACTOR x reference).
      CPU time hardly grows on a busy machine (a busy machine stretches wall time), so the
      margin is small: training is what makes CPU time grow. On a GPU the factor leaves
      room for a candidate whose changed model compiles for longer than the baseline's.
    - wall: at most STARTUP_WALL_FACTOR x the reference's wall + STARTUP_WALL_MARGIN: a
      busy machine stretches it, so it is loose, and it is a load-sensitive verdict (the
      run is measured again before it fails, autoloop.trust.budget.load_sensitive). It
      bounds what CPU time cannot see: a GPU that trains while the CPU waits.
  The baseline's first run is the reference and is not judged (it is the user's code);
  without a reference (a run whose baseline predates these figures), DEFAULT_REFERENCE.
* warm-up: the first batch -> the last of the untimed warm-up ticks (UNTIMED_WARMUP_STEPS,
  or every tick when there are fewer). Its steps are steps like the timed ones, so they
  may take their number x the median timed step x WARMUP_CPU_STEP_FACTOR of CPU (x
  WARMUP_WALL_STEP_FACTOR of wall: the 8x that honest steps took beside two CPU burners)
  + a margin, plus what start-up left of its own allowance: start-up and warm-up share one
  allowance, so a script that compiles on its first real step instead of before its first
  batch is not failed for it. The wall verdict is load-sensitive, the CPU one is not.

Over a bound the trial is `invalid`, its reason naming the phase: "trained before the
clock: 41 s of CPU before the first batch, allowed 9 s (...)".

Out of reach: within the allowances, training of up to the margin (a few CPU seconds on a
CPU; on a GPU, the time the baseline's cold compile took, for a candidate whose model hits
the warm compile cache); without bubblewrap, a process that leaves the tree (it is adopted
outside it) is not counted.
"""

from __future__ import annotations

import json
import math

STARTUP_CPU_MARGIN = 5.0  # CPU seconds beyond the baseline's start-up: imports of a candidate's own, a bigger model's init
STARTUP_CPU_FACTOR = 2.0  # or this many times the baseline's, whichever is more (a longer compile on a GPU)
STARTUP_WALL_FACTOR = 3.0  # wall: a load that doubles and more (two CPU burners on 2 cores)
STARTUP_WALL_MARGIN = 30.0
# An untimed warm-up step is a step like the timed ones (train.py compiles before the first
# batch): its CPU may be twice the median timed step's. Its wall time may be 8x: a busy
# machine stretches wall time (honest steps took 8x the median beside two CPU burners).
WARMUP_CPU_STEP_FACTOR = 2.0
WARMUP_WALL_STEP_FACTOR = 8.0
WARMUP_CPU_MARGIN = 2.0  # CPU seconds: the first real steps' allocations, /proc's 10 ms ticks
WARMUP_WALL_MARGIN = 10.0
# Before a baseline with these figures exists: ample for an honest cold compile on a GPU,
# not for minutes of training.
DEFAULT_REFERENCE = {"cpu_seconds": 60.0, "wall_seconds": 120.0}

# The wall-time verdicts, which a busy machine can trip (figures["rule"]; the CPU ones it cannot).
STARTUP_WALL_RULE = "startup wall"
WARMUP_WALL_RULE = "warm-up wall"


def _num(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _r(x: float | None) -> float | None:
    return None if x is None else round(float(x), 3)


def startup_figures(summary: dict, warmup_steps: int) -> dict:
    """The start-up and warm-up figures of one run, from FeedServer.summary(): wall seconds
    and the process tree's CPU seconds of each phase (None where the feed saw none)."""
    spawned, first_batch = _num(summary.get("spawned")), _num(summary.get("first_batch"))
    times = [_num(t) for t in summary.get("tick_times") or []]
    tree = [_num(c) for c in summary.get("warmup_tree_cpu") or []]
    first_cpu = _num(summary.get("first_batch_tree_cpu"))
    steps = min(warmup_steps, len(times), len(tree)) if warmup_steps > 0 else 0
    end_time = times[steps - 1] if steps else None
    end_cpu = tree[steps - 1] if steps else None
    return {
        "startup_wall_seconds": _r(first_batch - spawned) if first_batch is not None and spawned is not None else None,
        "startup_cpu_seconds": _r(first_cpu),
        "warmup_steps": steps,
        "warmup_wall_seconds": _r(end_time - first_batch) if end_time is not None and first_batch is not None else None,
        "warmup_cpu_seconds": _r(end_cpu - first_cpu) if end_cpu is not None and first_cpu is not None else None,
    }


def startup_allowance(reference: dict | None) -> tuple[float, float, dict]:
    """(CPU seconds, wall seconds) start-up may take, and the reference they came from."""
    ref = dict(DEFAULT_REFERENCE)
    if reference:
        for key in ref:
            value = _num(reference.get(key))
            if value is not None and value >= 0:
                ref[key] = value
    cpu = max(ref["cpu_seconds"] + STARTUP_CPU_MARGIN, STARTUP_CPU_FACTOR * ref["cpu_seconds"])
    wall = STARTUP_WALL_FACTOR * ref["wall_seconds"] + STARTUP_WALL_MARGIN
    return cpu, wall, ref


def check_startup(figures: dict, reference: dict | None, *, median_step_seconds: float | None = None,
                  median_step_cpu_seconds: float | None = None) -> tuple[str | None, str | None, dict]:
    """(problem or None, the rule that found it or None, the allowances) for a run's
    `startup_figures`, against the baseline's `reference` ({"cpu_seconds", "wall_seconds"})
    and the run's median timed step (wall and CPU seconds; None: no timed step to go by)."""
    cpu_allowed, wall_allowed, ref = startup_allowance(reference)
    out = {"startup_reference": {k: _r(v) for k, v in ref.items()} if reference else None,
           "startup_cpu_allowed_seconds": _r(cpu_allowed), "startup_wall_allowed_seconds": _r(wall_allowed)}
    cpu, wall = _num(figures.get("startup_cpu_seconds")), _num(figures.get("startup_wall_seconds"))
    whose = f"the baseline's start-up {ref['cpu_seconds']:.1f} s" if reference else \
        f"a default start-up of {ref['cpu_seconds']:g} s"
    if cpu is not None and cpu > cpu_allowed:
        return (f"trained before the clock: {cpu:.1f} s of CPU before the first batch, allowed {cpu_allowed:.1f} s "
                f"({whose}, + {STARTUP_CPU_MARGIN:g} s or x{STARTUP_CPU_FACTOR:g})", None, out)
    if wall is not None and wall > wall_allowed:
        return (f"trained before the clock: {wall:.1f} s from its start to the first batch, allowed {wall_allowed:.1f} s "
                f"({STARTUP_WALL_FACTOR:g} x the baseline's {ref['wall_seconds']:.1f} s + {STARTUP_WALL_MARGIN:g} s)",
                STARTUP_WALL_RULE, out)
    steps = int(figures.get("warmup_steps") or 0)
    left_cpu = max(0.0, cpu_allowed - (cpu or 0.0))
    left_wall = max(0.0, wall_allowed - (wall or 0.0))
    warm_cpu_allowed = left_cpu + WARMUP_CPU_STEP_FACTOR * steps * (median_step_cpu_seconds or 0.0) + WARMUP_CPU_MARGIN
    warm_wall_allowed = left_wall + WARMUP_WALL_STEP_FACTOR * steps * (median_step_seconds or 0.0) + WARMUP_WALL_MARGIN
    out.update({"warmup_cpu_allowed_seconds": _r(warm_cpu_allowed), "warmup_wall_allowed_seconds": _r(warm_wall_allowed)})
    warm_cpu, warm_wall = _num(figures.get("warmup_cpu_seconds")), _num(figures.get("warmup_wall_seconds"))
    if not steps:
        return None, None, out
    per_step = f"{steps} steps of {{:.3f}} s x {{:g}}"
    if warm_cpu is not None and warm_cpu > warm_cpu_allowed:
        return (f"trained before the clock: {warm_cpu:.1f} s of CPU in its {steps} untimed warm-up steps, allowed "
                f"{warm_cpu_allowed:.1f} s ({per_step.format(median_step_cpu_seconds or 0.0, WARMUP_CPU_STEP_FACTOR)} "
                f"+ {WARMUP_CPU_MARGIN:g} s, "
                f"+ {left_cpu:.1f} s start-up left)", None, out)
    if warm_wall is not None and warm_wall > warm_wall_allowed:
        return (f"trained before the clock: its {steps} untimed warm-up steps took {warm_wall:.1f} s, allowed "
                f"{warm_wall_allowed:.1f} s ({per_step.format(median_step_seconds or 0.0, WARMUP_WALL_STEP_FACTOR)} "
                f"+ {WARMUP_WALL_MARGIN:g} s, "
                f"+ {left_wall:.1f} s start-up left)", WARMUP_WALL_RULE, out)
    return None, None, out


def startup_reference(store, run_id: int) -> dict | None:
    """The run's baseline start-up ({"cpu_seconds", "wall_seconds"}: the largest of its ok
    baseline runs, the cold compile), or None before one with these figures exists. The
    baseline is the user's own code: its figures are what an honest start-up costs."""
    rows = store.query("SELECT m.budget FROM measurements m JOIN trials t ON t.id = m.trial_id "
                       "WHERE t.run_id = ? AND m.role = 'baseline' AND m.status = 'ok' AND m.budget IS NOT NULL",
                       (run_id,))
    cpu, wall = [], []
    for row in rows:
        try:
            figures = json.loads(row["budget"])
        except (TypeError, ValueError):
            continue
        if isinstance(figures, dict):
            c, w = _num(figures.get("startup_cpu_seconds")), _num(figures.get("startup_wall_seconds"))
            if c is not None and w is not None:
                cpu.append(c)
                wall.append(w)
    return {"cpu_seconds": max(cpu), "wall_seconds": max(wall)} if cpu else None
