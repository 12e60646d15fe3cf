"""The budget of a trial, judged from what the harness's data feed saw, not from what the trial says.

Under the controller a trial's training batches come from a FeedServer (autoloop/harness/
feed.py) in the controller process, which counts batches and tokens and timestamps every
batch request and every clock tick (TrainingClock.step_finished) with the controller's
own clock. check_budget reads that record (FeedServer.summary()) and the trial's result
JSON and answers (problem, figures): problem is None or one line naming the rule broken
and its figures; figures are stored with the measurement either way.

Rules, in order:
    * a request for another split than train (val, heldout) was refused by the feed: the
      trial tried to train on evaluation data.
    * batches drawn but no clock tick at all: the trial never reported a step, so nothing
      it did can be placed against the budget.
    * time mode. Warm-up ends when the feed gets the UNTIMED_WARMUP_STEPS-th tick.
        - The window from then to the last batch request or tick (whichever is later)
          must fit in budget + the last
          step as the feed measured it (between its last two ticks) + a tolerance:
          max(TIME_TOLERANCE x budget, MIN_TOLERANCE_SECONDS) for timestamp jitter, plus
          STEP_BOOKKEEPING_SECONDS per timed step for the loop's work between steps that
          the trial's own clock does not count (train.py spends ~0.5 ms). The harness
          clock stops after the step that crosses the budget, so an honest trial draws
          its last batch within budget + its last step however slow any step was; a
          trial that trains past its budget by any means (a clock fed half of each
          step's time, training outside the timed step, steps not reported) draws
          batches for longer. A slow machine slows the feed's view and the trial's clock
          alike and never fails a trial.
        - The untimed warm-up steps may draw what that many steps need: warm-up steps x
          the batches per step measured in the timed phase (median over ticks) + 1 for
          the loader's prefetch. More means training in the untimed warm-up.
        - No step, the last included (with what was drawn after the last tick), may draw
          more than STEP_BATCH_FACTOR x the median step's batches + 1: that would be data
          hoarded to train on later.
        - From the end of that window to the process's exit (when the caller gives it):
          at most max(TAIL_FRACTION x budget, TAIL_MIN_SECONDS) for saving the results.
    * step mode. The clock may be told at most max_steps steps; the tokens served may
      exceed the tokens the trial reports by at most one step's worth (the prefetched
      batch); the steps reported must be the steps the clock was told. So a trial that
      trains 50 steps and reports 5 is caught, with both figures.
    * both modes, the tail (training the feed does not see: extra optimizer steps on batches
      already drawn). With at least MIN_TIMED_STEPS timed steps:
        - the last step may take at most LAST_STEP_FACTOR x the median timed step +
          max(MIN_TOLERANCE_SECONDS, LAST_STEP_SLACK x budget) (in step mode the slack is
          MIN_TOLERANCE_SECONDS): an honest step on a loaded machine is rarely twice the
          median; a step that hides dozens of extra updates is many times it;
        - the checkpoint, as the controller's side watched it appear and change in the run's
          output folder (`summary["checkpoint"]`, its clock), must reach its final state
          within max(TAIL_STEPS x the median step, TAIL_MIN_CHECKPOINT_SECONDS) + its size at
          SAVE_BYTES_PER_SECOND + CHECKPOINT_POLL_SECONDS after the last batch or tick.
          train.py saves it right after its last step (milliseconds on a CPU, under a
          second for a GPU model); training on hoarded batches first is seconds or more.
      Each of the two counts only when the training process also used more CPU than that
      much time of honest steps takes (`tick_cpu`: the feed reads the process's CPU time
      at every tick from /proc; `cpu_sample`: the same, read several times a second until
      the process exits): a busy machine stretches a step's wall time, not its CPU time;
      extra updates stretch both. Not always: threads that spin while they wait burn CPU
      doing nothing. Beside two CPU burners on a 2-core VM, torch's OpenMP threads with GNU's
      default spin count had phases of a dozen steps at 8x the median, each charged as much
      CPU as wall time (autoloop/base/openmp.py, which sets a spin count that ends
      them). Whatever else spins, a run these two rules fail is measured again at the same
      seed before the trial fails (`load_sensitive`): an attack fails both runs, a stall
      rarely strikes twice.
    * both modes, before the clock (autoloop.trust.startup): the process tree's CPU time and
      the wall time from spawn to the first batch, and of the untimed warm-up steps, are
      bounded against the baseline's own start-up and the run's median step.

Out of reach of these rules: in step mode, extra work inside every step (a step that does
ten updates on its batch is a step ten times as slow, which step mode does not price; time
mode does); within the bounds above, a few steps' worth of extra updates.
"""

from __future__ import annotations

import math
import statistics

TIME_TOLERANCE = 0.02  # of the budget: timestamp jitter and the trial's work between steps
MIN_TOLERANCE_SECONDS = 0.5  # the same, for short budgets (tests, quick runs)
# Per timed step: the loop's bookkeeping outside the timed step (LR setting, logging, the
# tick itself), which the trial's clock rightly does not count; train.py spends ~0.5 ms
# (CPU, measured) and well under 1 ms on CUDA, so a proposal with tiny steps is not failed.
STEP_BOOKKEEPING_SECONDS = 0.002
STEP_BATCH_FACTOR = 2  # a step may draw this many times the median step's batches (+1)
# After the last batch or tick, until the process exits: saving the checkpoint and the
# result (and evaluating, when train.py evaluates in-process). Generous: it only bounds a
# trial that hoards batches, stops ticking and trains on after.
TAIL_FRACTION = 0.5
TAIL_MIN_SECONDS = 60.0
MIN_TIMED_STEPS = 3  # fewer timed steps give no median to judge the last one by
LAST_STEP_FACTOR = 4.0
LAST_STEP_SLACK = 0.01  # of the budget (time mode)
TAIL_STEPS = 3
TAIL_MIN_CHECKPOINT_SECONDS = 1.0
SAVE_BYTES_PER_SECOND = 100e6  # a slow disk; page cache is ten times faster
CHECKPOINT_POLL_SECONDS = 0.5  # how often the output folder is looked at (0.2 s), with room
CPU_SLACK_SECONDS = 0.1  # /proc counts CPU in clock ticks (10 ms), read at each tick
TAIL_MIN_CPU_SECONDS = 2.0  # after the last step: the result, the checkpoint, the interpreter's exit


def _number(result: dict, key: str) -> float | None:
    value = result.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _r(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(float(x), digits)


def _ticks(summary: dict) -> tuple[list[float], list[int], list[list]]:
    times = [float(t) for t in summary.get("tick_times") or []]
    batches = [int(b) for b in summary.get("tick_batches") or []]
    last = [[float(tick[0]), int(tick[1])] for tick in summary.get("last_ticks") or []]
    if not last and times:
        last = [[t, b] for t, b in zip(times[-3:], batches[-3:])]
    return times, batches, last


def _batches_per_step(times: list[float], batches: list[int], warmup: int) -> float | None:
    """Median batches drawn between consecutive ticks of the timed phase."""
    diffs = [batches[k] - batches[k - 1] for k in range(max(warmup, 1), len(batches))]
    return float(statistics.median(diffs)) if diffs else None


def refusal_problem(summary: dict) -> str | None:
    """The trial asked the feed for a split training may not read (also for a trial that then crashed)."""
    count = int(summary.get("refused_count") or 0)
    if not count:
        return None
    splits = sorted({str(r.get("split")) for r in summary.get("refused") or []}) or ["val"]
    return (f"asked the harness's data feed for the {' and '.join(splits)} split ({count} refused request(s)): "
            "training may not read val or heldout")


def check_budget(summary: dict, result: dict | None, *, time_budget: float | None, max_steps: int | None,
                 warmup_steps: int | None = None, spawned_at: float | None = None,
                 exited_at: float | None = None, tolerance: float = TIME_TOLERANCE,
                 min_tolerance_seconds: float = MIN_TOLERANCE_SECONDS, startup_reference: dict | None = None,
                 judge_startup: bool = True) -> tuple[str | None, dict]:
    """(problem or None, figures) for one training run; see the module doc for the rules.

    `summary` is FeedServer.summary(); `result` the trial's result JSON (None if it wrote
    none); `spawned_at`/`exited_at` are time.monotonic() readings of the controller when
    the training process started and ended (or FeedServer.mark_spawn/mark_exit).
    `warmup_steps` defaults to the harness's UNTIMED_WARMUP_STEPS. `startup_reference`: the
    baseline's start-up (autoloop.trust.startup.startup_reference); `judge_startup=False`
    (the baseline's first run, which is the reference) records the start-up figures only.
    """
    if warmup_steps is None:
        # Imported here: autoloop.harness brings torch, which the CLI does not need to start.
        from autoloop.harness.constants import UNTIMED_WARMUP_STEPS

        warmup_steps = UNTIMED_WARMUP_STEPS
    result = result or {}
    step_mode = max_steps is not None
    if not step_mode and time_budget is None:
        raise ValueError("check_budget needs a time budget or a step budget")
    batches = int(summary.get("batches") or 0)
    tokens = int(summary.get("tokens") or 0)
    n_ticks = int(summary.get("ticks") or 0)
    times, tick_batches, last_ticks = _ticks(summary)
    started = summary.get("started_at")
    spawned = summary.get("spawned")
    if spawned_at is not None and started is not None:
        spawned = spawned_at - started
    exited = summary.get("exited")
    if exited_at is not None and started is not None:
        exited = exited_at - started
    first_request, last_batch = summary.get("first_request"), summary.get("last_batch")
    reported_steps, reported_tokens = _number(result, "num_steps"), _number(result, "total_tokens")

    figures: dict = {
        "mode": "steps" if step_mode else "time",
        "budget": max_steps if step_mode else time_budget,
        "batches": batches,
        "tokens_served": tokens,
        "ticks": n_ticks,
        "streams": len(summary.get("streams") or []),
        "refused": int(summary.get("refused_count") or 0),
        "reported_steps": reported_steps,
        "reported_tokens": reported_tokens,
        "reported_training_seconds": _r(_number(result, "training_seconds")),
        "startup_seconds": _r(first_request - spawned) if first_request is not None and spawned is not None else None,
        "wall_seconds": _r(exited - spawned) if exited is not None and spawned is not None else None,
        "tail_seconds": _r(exited - last_batch) if exited is not None and last_batch is not None else None,
    }
    if times and n_ticks >= 2:
        steps_seconds = [b - a for a, b in zip(times, times[1:])][max(warmup_steps - 1, 0):]
        figures["median_step_seconds"] = _r(statistics.median(steps_seconds)) if steps_seconds else None
    if len(last_ticks) >= 2:
        last_step = last_ticks[-1][0] - last_ticks[-2][0]
    elif last_ticks and summary.get("first_batch") is not None:
        last_step = last_ticks[-1][0] - float(summary["first_batch"])
    else:
        last_step = 0.0
    figures["last_step_seconds"] = _r(last_step)
    bps = _batches_per_step(times, tick_batches, warmup_steps)
    figures["batches_per_step"] = _r(bps)

    refused = refusal_problem(summary)
    if refused:
        return refused, figures
    if batches and not n_ticks:
        return (f"drew {batches} training batches ({tokens:,} tokens) but never reported a step to the harness clock: "
                "its training cannot be checked against the budget", figures)

    if step_mode:
        problem = _step_rules(figures, summary, max_steps, batches, tokens, n_ticks, reported_steps, reported_tokens)
    else:
        problem = _time_rules(figures, float(time_budget), warmup_steps, batches, n_ticks, times, tick_batches,
                              last_ticks, summary.get("first_batch"), last_batch, exited, last_step, bps, tolerance,
                              min_tolerance_seconds)
    if problem is None and batches:
        problem = _startup_rules(figures, summary, warmup_steps, startup_reference, judge_startup)
    if problem is None and batches:
        problem = _tail_rules(figures, summary, time_budget if not step_mode else None, warmup_steps, n_ticks,
                              last_step, last_batch, last_ticks)
        if problem is not None:
            figures["rule"] = TAIL_RULE
    return problem, figures


# The tail rules' verdicts rest on CPU time, which threads that spin while they wait
# inflate without doing any work (module docstring). A run they fail is measured once
# more at the same seed (autoloop.measure.measurer): a trial that trains where the budget
# does not look does it every time; a stall does not.
TAIL_RULE = "tail"


def load_sensitive(figures: dict | None) -> bool:
    """True when a budget verdict came from a rule a busy host can trip (`TAIL_RULE`, and
    the start-up's wall-time rules)."""
    from autoloop.trust.startup import STARTUP_WALL_RULE, WARMUP_WALL_RULE

    return bool(figures) and figures.get("rule") in (TAIL_RULE, STARTUP_WALL_RULE, WARMUP_WALL_RULE)


def _step_rules(figures, summary, max_steps, batches, tokens, n_ticks, reported_steps, reported_tokens) -> str | None:
    if not batches:
        return None
    if n_ticks > max_steps:
        return f"told the harness clock {n_ticks} steps, over its budget of {max_steps} steps"
    if reported_steps is None or reported_tokens is None:
        return (f"drew {batches} batches ({tokens:,} tokens) from the data feed but reports no num_steps/total_tokens "
                "to check them against")
    batch_tokens = max((int(s.get("batch_size", 0)) * int(s.get("seq_len", 0)) for s in summary.get("streams") or []),
                       default=0)
    step_tokens = reported_tokens / reported_steps if reported_steps > 0 else 0.0
    allowed = reported_tokens + max(step_tokens, batch_tokens)
    figures["tokens_allowed"] = int(allowed)
    if tokens > allowed:
        worth = f", enough for ~{tokens / step_tokens:.0f} steps" if step_tokens > 0 else ""
        return (f"drew {batches} batches ({tokens:,} tokens{worth}) from the data feed but reports "
                f"{reported_steps:.0f} steps and {reported_tokens:,.0f} tokens (allowed {allowed:,.0f} with one step of "
                "prefetch): it trained on more data than it reports")
    if int(reported_steps) != n_ticks:
        return (f"reports {reported_steps:.0f} steps but told the harness clock {n_ticks}: its report contradicts the "
                "clock")
    return None


def _time_rules(figures, budget, warmup, batches, n_ticks, times, tick_batches, last_ticks, first_batch, last_batch,
                exited, last_step, bps, tolerance, min_tolerance_seconds) -> str | None:
    if not batches:
        return None
    if n_ticks <= warmup or len(times) < max(warmup, 1):
        return (f"reported only {n_ticks} steps to the harness clock, none of them timed (the first {warmup} are its "
                f"untimed warm-up), yet drew {batches} training batches")
    if warmup > 0:
        warm_end, warm_batches = times[warmup - 1], tick_batches[warmup - 1]
    else:
        warm_end, warm_batches = float(first_batch), 0
    # Training ends with the last batch drawn or the last step reported, whichever is later.
    window_end = max(float(last_batch) if last_batch is not None else warm_end,
                     last_ticks[-1][0] if last_ticks else warm_end)
    window = max(0.0, window_end - warm_end)
    timed_steps = n_ticks - warmup
    slack = max(tolerance * budget, min_tolerance_seconds) + STEP_BOOKKEEPING_SECONDS * timed_steps
    allowed = budget + last_step + slack
    figures.update({
        "warmup_end_seconds": _r(warm_end),
        "warmup_batches": warm_batches,
        "timed_batches": batches - warm_batches,
        "timed_window_seconds": _r(window),
        "tick_window_seconds": _r(last_ticks[-1][0] - warm_end) if last_ticks else None,
        "tolerance_seconds": _r(slack),
        "allowed_seconds": _r(allowed),
    })
    reported = figures.get("reported_training_seconds")
    if reported is not None and figures["tick_window_seconds"]:
        # How much of the feed's timed phase the trial's own clock counted (~1 honest).
        figures["clock_share"] = _r(reported / figures["tick_window_seconds"])
    if bps is not None:
        warm_allowed = math.ceil(warmup * bps) + 1
        figures["warmup_batches_allowed"] = warm_allowed
        if warm_batches > warm_allowed:
            return (f"drew {warm_batches} training batches during its {warmup} untimed warm-up steps, more than they need "
                    f"({warm_allowed}: {bps:g} per step as timed, +1 prefetch): it trained in the untimed warm-up")
    if window > allowed:
        return (f"drew training batches for {window:.1f} s after warm-up, over its {budget:g} s budget (last step "
                f"{last_step:.1f} s, allowed {allowed:.1f} s): the trial trained past its budget")
    if bps is not None:
        step_allowed = STEP_BATCH_FACTOR * math.ceil(bps) + 1
        # Batches per timed step; the last one also holds whatever was drawn after the last tick.
        per_step = [tick_batches[k] - tick_batches[k - 1] for k in range(max(warmup, 1), len(tick_batches))]
        if len(last_ticks) >= 2:
            per_step.append(batches - last_ticks[-2][1])
        figures["max_step_batches"] = max(per_step, default=None)
        figures["last_step_batches"] = per_step[-1] if per_step else None
        if per_step and max(per_step) > step_allowed:
            where = "its last step" if per_step[-1] > step_allowed else "one step"
            return (f"drew {max(per_step)} training batches in {where}, more than a step takes ({bps:g} a step; allowed "
                    f"{step_allowed}): it took data to train on outside the steps the budget counts")
    if exited is not None:
        tail = exited - window_end
        tail_allowed = max(TAIL_FRACTION * budget, TAIL_MIN_SECONDS)
        figures["tail_seconds"], figures["tail_allowed_seconds"] = _r(tail), _r(tail_allowed)
        if tail > tail_allowed:
            return (f"ran {tail:.0f} s after its last training batch and step, more than the {tail_allowed:.0f} s "
                    "allowed for saving its results: it trained on without the harness clock")
    return None


def _startup_rules(figures, summary, warmup, reference, judge) -> str | None:
    from autoloop.trust.startup import check_startup, startup_figures

    figures.update(startup_figures(summary, warmup))
    median_cpu = _cpu_figures(summary, warmup)[0]
    problem, rule, allowed = check_startup(figures, reference, median_step_seconds=figures.get("median_step_seconds"),
                                           median_step_cpu_seconds=median_cpu)
    figures.update(allowed)
    if not judge:
        return None
    if problem is not None and rule is not None:
        figures["rule"] = rule
    return problem


def _cpu_figures(summary: dict, warmup: int) -> tuple[float | None, float | None, float | None]:
    """(median CPU seconds of a timed step, CPU seconds of the last step, CPU at the last
    tick), from the feed's readings of the training process at each tick; None where the
    platform gave none."""
    cpu = summary.get("tick_cpu") or []
    diffs = [b - a for a, b in zip(cpu[max(warmup - 1, 0):], cpu[max(warmup, 1):]) if a is not None and b is not None]
    median = float(statistics.median(diffs)) if diffs else None
    last = [t[2] if len(t) > 2 else None for t in summary.get("last_ticks") or []]
    last_step = last[-1] - last[-2] if len(last) >= 2 and None not in last[-2:] else None
    return median, last_step, last[-1] if last else None


def _tail_rules(figures, summary, time_budget, warmup, n_ticks, last_step, last_batch, last_ticks) -> str | None:
    """Training the feed does not see: a last step far longer than the others, or a
    checkpoint that reached its final state long after the last batch and tick. A step (or
    a tail) is judged long only when it took more CPU as well as more time: a busy machine
    makes a step slow, not busier (the feed reads the training process's CPU time itself)."""
    median = figures.get("median_step_seconds")
    if n_ticks - warmup < MIN_TIMED_STEPS:
        # Too few timed steps for their own median (a short budget on a busy machine): the
        # warm-up steps count too (on a GPU they compile, which only makes the median longer).
        times = summary.get("tick_times") or []
        steps = [b - a for a, b in zip(times, times[1:-1])]
        median = float(statistics.median(steps)) if len(steps) >= 2 else None
        warmup = 1
    if not median:
        return None
    median_cpu, last_cpu, cpu_at_last_tick = _cpu_figures(summary, warmup)
    figures["median_step_cpu_seconds"] = _r(median_cpu)
    figures["last_step_cpu_seconds"] = _r(last_cpu)
    slack = max(MIN_TOLERANCE_SECONDS, LAST_STEP_SLACK * time_budget) if time_budget else MIN_TOLERANCE_SECONDS
    last_allowed = LAST_STEP_FACTOR * median + slack
    figures["last_step_allowed_seconds"] = _r(last_allowed)
    if last_step > last_allowed:
        busier = last_cpu is None or median_cpu is None or last_cpu > LAST_STEP_FACTOR * median_cpu + CPU_SLACK_SECONDS
        if busier:
            cpu = f", {last_cpu:.2f} s of CPU against a median {median_cpu:.3f} s" if last_cpu is not None \
                and median_cpu is not None else ""
            return (f"its last step took {last_step:.2f} s, {last_step / median:.0f} x its median step ({median:.3f} s; "
                    f"allowed {last_allowed:.2f} s){cpu}: it trained inside a step the budget does not see")
    checkpoint = summary.get("checkpoint") or {}
    changed = checkpoint.get("last_change")
    if changed is None:
        return None
    window_end = max(float(last_batch) if last_batch is not None else 0.0, last_ticks[-1][0] if last_ticks else 0.0)
    size = float(checkpoint.get("bytes") or 0)
    save = size / SAVE_BYTES_PER_SECOND
    allowed = max(TAIL_STEPS * median, TAIL_MIN_CHECKPOINT_SECONDS) + save + CHECKPOINT_POLL_SECONDS
    after = float(changed) - window_end
    figures["checkpoint_after_seconds"] = _r(after)
    figures["checkpoint_allowed_seconds"] = _r(allowed)
    exit_cpu = summary.get("cpu_sample")
    tail_cpu = exit_cpu - cpu_at_last_tick if exit_cpu is not None and cpu_at_last_tick is not None else None
    cpu_allowed = max(TAIL_STEPS * (median_cpu or 0.0), TAIL_MIN_CPU_SECONDS) + save
    figures["tail_cpu_seconds"] = _r(tail_cpu)
    figures["tail_cpu_allowed_seconds"] = _r(cpu_allowed)
    if after > allowed and (tail_cpu is None or tail_cpu > cpu_allowed):
        cpu = f", using {tail_cpu:.1f} s of CPU (allowed {cpu_allowed:.1f} s)" if tail_cpu is not None else ""
        return (f"its checkpoint was last written {after:.1f} s after its last step and batch (allowed {allowed:.1f} s: "
                f"{TAIL_STEPS} steps of {median:.3f} s, or {TAIL_MIN_CHECKPOINT_SECONDS:g} s, and the save){cpu}: it "
                "trained after the harness clock stopped")
    return None
