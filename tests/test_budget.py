"""Tests of check_budget: synthetic feed records with known answers, then the real train.py.

`simulate` writes the record a FeedServer keeps of a train.py-like loop (one prefetched
batch, then `bps` batches per step, a clock tick after each step) for a scripted
timeline, so each rule is tested where the right answer is known by construction. The
train.py tests run the real script through a real FeedServer, honest and patched the way
an eager proposal would game the budget (the patches of issue 12).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from autoloop.trust.budget import check_budget, refusal_problem
from test_feed import run_with_feed
from test_train import TRAIN_PY, explain

BATCH_TOKENS = 8 * 256


def simulate(*, budget: float | None = 20.0, max_steps: int | None = None, step_seconds: float = 0.1, bps: int = 2,
             warmup: int = 3, warmup_seconds: float = 1.0, startup: float = 2.0, clock_share: float = 1.0,
             slow: dict | None = None, warm_extra: int = 0, tick_every: int = 1, gap: float = 0.001,
             after: tuple[int, float] = (0, 0.0), last_extra: int = 0, work: dict | None = None,
             checkpoint_after: float | None = 0.2, tail_cpu: float = 0.3) -> tuple[dict, dict]:
    """(feed summary, result JSON) of a scripted training loop.

    slow: {step index: seconds} for steps a busy machine slowed (their CPU time stays a
    normal step's); work: {step index: seconds} for steps that did that much more work (CPU
    and wall time alike); clock_share: the share of each step's seconds the trial tells the
    clock; warm_extra: extra batches per warm-up step; tick_every: tick the clock once per
    this many real steps; after: (batches, seconds) drawn after the last tick; last_extra:
    extra batches in the last step; checkpoint_after: seconds from the last tick to the
    checkpoint's last write (None: no checkpoint seen); tail_cpu: CPU seconds after the
    last tick.
    """
    slow = slow or {}
    work = work or {}
    cpu, tick_cpu = 0.5, []
    t, batch_times, ticks = startup, [], []
    batch_times.append(t)
    steps = real = 0
    clock_seconds = 0.0
    while True:
        warm = steps < warmup
        dt = warmup_seconds if warm else slow.get(real, step_seconds) + work.get(real, 0.0)
        cpu += warmup_seconds if warm else step_seconds + work.get(real, 0.0)
        n = bps + (warm_extra if warm else 0)
        for m in range(n):
            batch_times.append(t + dt * (m + 1) / n)
        t += dt
        real += 1
        if real % tick_every == 0:
            if steps >= warmup:
                clock_seconds += dt * clock_share
            steps += 1
            ticks.append((t, len(batch_times)))
            tick_cpu.append(round(cpu, 2))
        done = steps >= max_steps if max_steps is not None else clock_seconds >= budget
        if done:
            break
        t += gap
        if tick_every > 100 and real > 200:
            break
    if last_extra:
        batch_times += [ticks[-1][0] - 0.001] * last_extra
        ticks[-1] = (ticks[-1][0], len(batch_times))
    for k in range(after[0]):
        batch_times.append(t + after[1] * (k + 1) / after[0])
    end = batch_times[-1] + 1.0
    summary = {
        "format": 1, "started_at": 1000.0, "spawned": 0.0, "exited": end + 0.5, "connections": 1,
        "first_connect": startup - 0.01, "streams": [{"split": "train", "batch_size": 8, "seq_len": 256, "seed": 1}],
        "batches": len(batch_times), "tokens": len(batch_times) * BATCH_TOKENS,
        "first_request": startup - 0.005, "first_batch": batch_times[0], "last_batch": max(batch_times),
        "ticks": len(ticks), "tick_times": [x for x, _ in ticks], "tick_batches": [b for _, b in ticks],
        "last_ticks": [[*x, c] for x, c in zip(ticks[-3:], tick_cpu[-3:])], "refused": [], "refused_count": 0,
        "errors": [], "error_count": 0, "tick_cpu": tick_cpu, "cpu_sample": tick_cpu[-1] + tail_cpu if tick_cpu else None,
        "checkpoint": ({"first_seen": ticks[-1][0] + checkpoint_after, "last_change": ticks[-1][0] + checkpoint_after,
                        "bytes": 1 << 20} if checkpoint_after is not None and ticks else None),
    }
    result = {"num_steps": steps, "total_tokens": steps * bps * BATCH_TOKENS, "training_seconds": clock_seconds,
              "batch_tokens": bps * BATCH_TOKENS}
    return summary, result


def check(summary_result, budget=20.0, max_steps=None, **kw):
    summary, result = summary_result
    return check_budget(summary, result, time_budget=budget, max_steps=max_steps, warmup_steps=3, **kw)


# ---------------------------------------------------------------------------- time mode


def test_honest_time_mode_passes_with_exact_figures():
    problem, fig = check(simulate())
    assert problem is None, fig
    assert fig["batches_per_step"] == 2 and fig["warmup_batches"] == 7 == fig["warmup_batches_allowed"]
    assert 20.0 <= fig["timed_window_seconds"] <= 20.0 + 0.1 + fig["timed_batches"] * 0.001
    assert fig["last_step_seconds"] == pytest.approx(0.1 + 0.001) and fig["startup_seconds"] == pytest.approx(1.995)
    assert fig["clock_share"] == pytest.approx(1.0, abs=0.02) and fig["tokens_served"] == fig["batches"] * BATCH_TOKENS


def test_a_slow_last_step_on_a_busy_machine_passes():
    # The failure: one step took seconds, and the old rule (one average step of
    # slack) marked the baseline invalid. The feed measures the last step itself.
    steps_before_last = 3 + 200  # warm-up + timed steps of 0.1 s that fill 20 s
    summary, result = simulate(slow={steps_before_last - 1: 3.3})
    assert result["training_seconds"] > 23  # what the old rule saw: "trained 23.3 s, allowed 21.9 s"
    problem, fig = check((summary, result))
    assert problem is None, fig
    assert fig["last_step_seconds"] == pytest.approx(3.3 + 0.001) and fig["timed_window_seconds"] > 23


def test_a_uniformly_slow_and_jittery_machine_passes():
    slow = {k: 2.0 for k in range(5, 60, 7)}  # a step in seven takes 20x longer
    problem, fig = check(simulate(step_seconds=0.3, slow=slow, gap=0.005))
    assert problem is None, fig


def test_half_clock_trains_twice_its_budget_and_fails():
    problem, fig = check(simulate(clock_share=0.5))
    assert problem.startswith("drew training batches for 40.") and "over its 20 s budget" in problem
    assert "trained past its budget" in problem and fig["clock_share"] == pytest.approx(0.5, abs=0.02)


def test_a_clock_told_ninety_percent_fails_by_more_than_the_tolerance():
    assert check(simulate(clock_share=0.9))[0] is not None
    assert check(simulate(clock_share=0.995))[0] is None  # within the 2% tolerance


def test_training_after_the_last_tick_fails():
    problem, _ = check(simulate(after=(40, 8.0)))
    assert "drew training batches for 28" in problem


def test_training_in_the_untimed_warm_up_fails():
    problem, fig = check(simulate(warm_extra=30))
    assert "drew 97 training batches during its 3 untimed warm-up steps" in problem
    assert "(7: 2 per step as timed, +1 prefetch)" in problem and fig["warmup_batches_allowed"] == 7


def test_extra_batches_in_the_last_step_fail():
    problem, _ = check(simulate(last_extra=20))
    assert "drew 22 training batches in its last step" in problem


def test_hoarding_batches_in_one_step_fails():
    summary, result = simulate()
    k = 50  # the 51st tick: a step that drew 300 batches more than it needs
    summary["tick_batches"] = summary["tick_batches"][:k] + [b + 300 for b in summary["tick_batches"][k:]]
    summary["last_ticks"] = [[t, b + 300, *rest] for t, b, *rest in summary["last_ticks"]]
    summary["batches"] += 300
    problem, fig = check((summary, result))
    assert problem.startswith("drew 302 training batches in one step, more than a step takes (2 a step; allowed 5)")
    assert fig["max_step_batches"] == 302 and fig["last_step_batches"] == 2


def test_running_long_after_the_last_batch_and_tick_fails():
    summary, result = simulate()
    assert check((summary, result))[1]["tail_allowed_seconds"] == 60
    summary["exited"] = summary["last_batch"] + 75
    problem, _ = check((summary, result))
    assert problem.startswith("ran 75 s after its last training batch and step, more than the 60 s allowed")


def test_batches_without_any_tick_fail():
    problem, _ = check(simulate(tick_every=10**6))
    assert problem.startswith("drew ") and "never reported a step to the harness clock" in problem


def test_only_warm_up_ticks_in_time_mode_fail():
    summary, result = simulate()
    summary["ticks"], summary["tick_times"], summary["tick_batches"] = 2, summary["tick_times"][:2], summary["tick_batches"][:2]
    summary["last_ticks"] = [[t, b] for t, b in zip(summary["tick_times"], summary["tick_batches"])]
    problem, _ = check((summary, result))
    assert "reported only 2 steps to the harness clock, none of them timed" in problem


def test_refused_val_request_is_a_problem_also_for_a_crashed_trial():
    summary, result = simulate()
    summary["refused"], summary["refused_count"] = [{"time": 1.0, "split": "val", "pid": 1}], 1
    problem, _ = check((summary, result))
    assert problem.startswith("asked the harness's data feed for the val split (1 refused request(s))")
    assert refusal_problem(summary) == problem and refusal_problem(simulate()[0]) is None


def test_nothing_drawn_is_no_budget_problem():
    summary, _ = simulate()
    empty = {**summary, "batches": 0, "tokens": 0, "ticks": 0, "tick_times": [], "tick_batches": [], "last_ticks": [],
             "first_batch": None, "last_batch": None}
    assert check((empty, {}))[0] is None
    assert check((empty, {}), budget=None, max_steps=5)[0] is None


def test_startup_comes_from_the_spawn_time_given():
    summary, result = simulate(startup=7.5)
    summary["spawned"] = None
    _, fig = check((summary, result), spawned_at=1000.0 + 0.5)
    assert fig["startup_seconds"] == pytest.approx(7.5 - 0.005 - 0.5)


# ---------------------------------------------------------------------------- step mode


def test_honest_step_mode_passes():
    problem, fig = check(simulate(max_steps=50), budget=None, max_steps=50)
    assert problem is None, fig
    assert fig["tokens_served"] == fig["reported_tokens"] + BATCH_TOKENS  # the prefetched batch


def test_training_50_steps_and_reporting_5_fails_with_both_figures():
    problem, _ = check(simulate(max_steps=5, tick_every=10), budget=None, max_steps=5)
    assert "enough for ~50 steps" in problem and "reports 5 steps and 20,480 tokens" in problem
    assert "it trained on more data than it reports" in problem


def test_more_ticks_than_the_step_budget_fail():
    problem, _ = check(simulate(max_steps=7), budget=None, max_steps=5)
    assert problem == "told the harness clock 7 steps, over its budget of 5 steps"


def test_reported_steps_must_match_the_clock():
    summary, result = simulate(max_steps=5)
    result = {**result, "num_steps": 9, "total_tokens": 9 * 2 * BATCH_TOKENS}
    problem, _ = check((summary, result), budget=None, max_steps=10)
    assert problem == "reports 9 steps but told the harness clock 5: its report contradicts the clock"


def test_step_mode_without_reported_figures_fails():
    summary, _ = simulate(max_steps=5)
    problem, _ = check((summary, {"val_bpb": 2.0}), budget=None, max_steps=5)
    assert "reports no num_steps/total_tokens" in problem


# ---------------------------------------------------------------------------- the real train.py


def patched(tmp_path, name: str, replacements: dict[str, str]):
    """A copy of train.py with source fragments replaced (each must occur exactly once)."""
    text = TRAIN_PY.read_text()
    for old, new in replacements.items():
        assert text.count(old) == 1, f"train.py should contain {old!r} exactly once"
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(text)
    return path


# The attack runs shrink the CPU model (same code, smaller constants) so that a step is
# short against the budget even on a loaded machine: a half-clock trial is only
# distinguishable from an honest one whose every step is slow when it takes several steps.
TINY = {
    "    DEPTH = 2\n": "    DEPTH = 1\n",
    "    TOTAL_BATCH_TOKENS = 8 * 256": "    TOTAL_BATCH_TOKENS = 4 * 256",
    "    DEVICE_BATCH_SIZE = 8": "    DEVICE_BATCH_SIZE = 2",
}
ONE_THREAD = {"OMP_NUM_THREADS": 1}  # tiny tensors: a second thread only spin-waits on a busy machine


@pytest.mark.slow
def test_attack_ten_times_more_steps_than_the_clock_is_told(session_cache, embedded_dataset, tmp_path):
    script = patched(tmp_path, "train_10x.py", {
        **TINY,
        "    curve = H.LossCurve(CURVE_POINTS)\n": "    curve = H.LossCurve(CURVE_POINTS)\n    sneaked = 0\n",
        "        clock.step_finished(dt)\n": "        sneaked += 1\n        if sneaked % 10 == 0:\n"
                                            "            clock.step_finished(dt)\n",
    })
    proc, summary, result = run_with_feed(script, session_cache, embedded_dataset.path, tmp_path / "run",
                                          AUTOLOOP_MAX_STEPS=5, AUTOLOOP_SEED=1, **ONE_THREAD)
    assert proc.returncode == 0, explain(proc)
    assert result["num_steps"] == 5
    problem, _ = check_budget(summary, result, time_budget=None, max_steps=5)
    assert problem is not None and "enough for ~50 steps" in problem and "reports 5 steps" in problem


@pytest.mark.slow
def test_attack_half_clock_in_time_mode(session_cache, embedded_dataset, tmp_path):
    script = patched(tmp_path, "train_half.py", {**TINY, "        clock.step_finished(dt)\n":
                                                 "        clock.step_finished(dt / 2)\n"})
    proc, summary, result = run_with_feed(script, session_cache, embedded_dataset.path, tmp_path / "run",
                                          AUTOLOOP_TIME_BUDGET=4, AUTOLOOP_SEED=1, **ONE_THREAD)
    assert proc.returncode == 0, explain(proc)
    problem, figures = check_budget(summary, result, time_budget=4, max_steps=None)
    assert result["training_seconds"] <= 4.0 + figures["last_step_seconds"]  # its own clock says it kept to budget
    assert problem is not None and "over its 4 s budget" in problem and "trained past its budget" in problem, figures
    assert figures["timed_window_seconds"] > 7


@pytest.mark.slow
def test_honest_time_mode_passes_beside_two_cpu_burners(session_cache, embedded_dataset, tmp_path):
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        proc, summary, result = run_with_feed(TRAIN_PY, session_cache, embedded_dataset.path, tmp_path / "run",
                                              AUTOLOOP_TIME_BUDGET=4, AUTOLOOP_SEED=1, **ONE_THREAD)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert proc.returncode == 0, explain(proc)
    problem, figures = check_budget(summary, result, time_budget=4, max_steps=None)
    assert problem is None, figures
    assert figures["timed_window_seconds"] <= figures["allowed_seconds"] and figures["startup_seconds"] > 0



# ---- issue 23, item 4: training the feed does not see -----------------------------------


def test_a_long_last_step_that_did_more_work_fails():
    # Dozens of extra updates inside the last step: more wall time AND more CPU time.
    steps_before_last = 3 + 200
    problem, fig = check(simulate(work={steps_before_last - 1: 3.0}))
    assert problem is not None and "its last step took" in problem and "CPU" in problem, fig
    assert fig["last_step_cpu_seconds"] > 3.0


def test_a_last_step_slowed_by_the_machine_is_not_more_work():
    # The same wall time without the CPU: a busy machine, not extra training.
    problem, fig = check(simulate(slow={202: 3.1}))
    assert problem is None, fig
    assert fig["last_step_cpu_seconds"] < 0.2


def test_training_after_the_last_tick_before_the_checkpoint_fails():
    problem, fig = check(simulate(checkpoint_after=8.0, tail_cpu=8.0))
    assert problem is not None and "checkpoint was last written 8.0 s after" in problem, fig
    assert fig["tail_cpu_seconds"] == pytest.approx(8.0)


def test_a_checkpoint_saved_late_on_a_busy_machine_is_not_training():
    problem, fig = check(simulate(checkpoint_after=8.0, tail_cpu=0.4))
    assert problem is None, fig


def test_the_tail_rules_hold_in_step_mode_too():
    problem, _ = check(simulate(budget=None, max_steps=40, checkpoint_after=6.0, tail_cpu=6.0), budget=None,
                       max_steps=40)
    assert problem is not None and "after the harness clock stopped" in problem
    problem, _ = check(simulate(budget=None, max_steps=40, work={39: 4.0}), budget=None, max_steps=40)
    assert problem is not None and "its last step took" in problem


def test_without_cpu_figures_a_long_last_step_is_judged_by_time_alone():
    summary, result = simulate(slow={202: 3.1})
    summary["tick_cpu"] = [None] * len(summary["tick_cpu"])
    summary["last_ticks"] = [[t, b, None] for t, b, _ in summary["last_ticks"]]
    problem, _ = check((summary, result))
    assert problem is not None and "its last step took" in problem


def test_only_the_tail_rules_verdicts_are_load_sensitive():
    """A busy host can stretch one step's CPU as well as its time: only the two tail rules
    rest on that, so only their verdicts get a second run (autoloop.measure.measurer)."""
    from autoloop.trust.budget import load_sensitive

    last_step = check(simulate(work={202: 3.0}))
    late_checkpoint = check(simulate(checkpoint_after=8.0, tail_cpu=8.0))
    half_clock = check(simulate(clock_share=0.5))
    honest = check(simulate())
    assert "its last step took" in last_step[0] and load_sensitive(last_step[1])
    assert "checkpoint" in late_checkpoint[0] and load_sensitive(late_checkpoint[1])
    assert half_clock[0] is not None and not load_sensitive(half_clock[1])
    assert honest[0] is None and not load_sensitive(honest[1]) and not load_sensitive(None)
