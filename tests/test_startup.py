"""The start-up rule (autoloop.trust.startup): known answers on figures, then the figures
themselves as a real FeedServer reads them from /proc for a real process tree.

The attacks through the real sandboxed loop are in tests/test_attacks_startup.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from autoloop import harness as H
from autoloop.harness.proctree import tree_cpu_seconds
from autoloop.store import Store
from autoloop.trust.budget import check_budget, load_sensitive
from autoloop.trust.startup import (
    STARTUP_WALL_RULE,
    WARMUP_WALL_RULE,
    check_startup,
    startup_allowance,
    startup_figures,
    startup_reference,
)
from test_budget import simulate

REF = {"cpu_seconds": 4.0, "wall_seconds": 6.0}  # an honest CPU start-up on a 2-core VM


def figures(startup_cpu=4.0, startup_wall=6.0, warmup_cpu=0.8, warmup_wall=0.9, steps=3):
    return {"startup_cpu_seconds": startup_cpu, "startup_wall_seconds": startup_wall, "warmup_steps": steps,
            "warmup_cpu_seconds": warmup_cpu, "warmup_wall_seconds": warmup_wall}


# ---------------------------------------------------------------------------- the rule


def test_the_allowance_is_the_baselines_start_up_plus_five_seconds_or_twice_it():
    assert startup_allowance(REF)[:2] == (9.0, 48.0)  # max(4 + 5, 2 x 4); 3 x 6 + 30
    # A GPU's cold compile: twice the baseline's, room for a candidate's longer compile.
    assert startup_allowance({"cpu_seconds": 90.0, "wall_seconds": 70.0})[:2] == (180.0, 240.0)
    # No baseline figures yet: the default reference (60 s of CPU, 120 s of wall).
    assert startup_allowance(None)[:2] == (120.0, 390.0)
    # A reference that is not a number is ignored, field by field.
    assert startup_allowance({"cpu_seconds": float("nan"), "wall_seconds": 6.0})[:2] == (120.0, 48.0)


def test_cpu_before_the_first_batch_over_the_allowance_is_training_before_the_clock():
    problem, rule, out = check_startup(figures(startup_cpu=41.0), REF)
    assert problem.startswith("trained before the clock: 41.0 s of CPU before the first batch, allowed 9.0 s")
    assert rule is None and out["startup_cpu_allowed_seconds"] == 9.0  # CPU: not a verdict load can cause
    assert check_startup(figures(startup_cpu=9.1), REF)[0] is not None
    assert check_startup(figures(startup_cpu=8.9), REF)[0] is None


def test_wall_time_before_the_first_batch_is_bounded_and_measured_again_before_it_fails():
    problem, rule, _ = check_startup(figures(startup_wall=48.5), REF)
    assert "48.5 s from its start to the first batch, allowed 48.0 s" in problem and rule == STARTUP_WALL_RULE
    assert load_sensitive({"rule": rule})
    assert check_startup(figures(startup_wall=47.5), REF)[0] is None


def test_the_warm_up_steps_get_what_steps_take_and_what_start_up_left():
    # CPU: start-up used 4 of its 9 s: 5 s left, + 3 steps x 0.25 s x 2 + 2 s = 8.5 s.
    kw = {"median_step_seconds": 0.3, "median_step_cpu_seconds": 0.25}
    problem, rule, out = check_startup(figures(warmup_cpu=8.6), REF, **kw)
    assert out["warmup_cpu_allowed_seconds"] == 8.5 and rule is None
    assert problem.startswith("trained before the clock: 8.6 s of CPU in its 3 untimed warm-up steps, allowed 8.5 s")
    assert check_startup(figures(warmup_cpu=8.4), REF, **kw)[0] is None
    # Wall: 48 - 6 = 42 s left + 3 steps x 0.3 s x 8 + 10 s = 59.2 s.
    problem, rule, out = check_startup(figures(warmup_wall=59.3), REF, **kw)
    assert out["warmup_wall_allowed_seconds"] == 59.2 and rule == WARMUP_WALL_RULE
    assert "its 3 untimed warm-up steps took 59.3 s, allowed 59.2 s" in problem
    # A script that compiles in its first real step rather than before the first batch:
    # its start-up is short, and what start-up left covers the compile.
    assert check_startup(figures(startup_cpu=1.0, warmup_cpu=11.4), REF, **kw)[0] is None


def test_figures_come_from_the_feeds_record():
    summary = {"spawned": 0.5, "first_batch": 10.5, "tick_times": [11.0, 11.5, 12.25, 12.5],
               "first_batch_tree_cpu": 4.6, "warmup_tree_cpu": [5.1, 5.6, 6.35]}
    assert startup_figures(summary, 3) == {"startup_wall_seconds": 10.0, "startup_cpu_seconds": 4.6, "warmup_steps": 3,
                                           "warmup_wall_seconds": 1.75, "warmup_cpu_seconds": 1.75}
    # Fewer ticks than warm-up steps (a 2-step run): the warm-up ends at the last.
    assert startup_figures({**summary, "tick_times": [11.0, 11.5], "warmup_tree_cpu": [5.1, 5.6]}, 3)["warmup_steps"] == 2
    # A feed without /proc: no CPU figures, and nothing judged on them.
    bare = startup_figures({"spawned": 0.5, "first_batch": 10.5, "tick_times": [11.0]}, 3)
    assert bare["startup_cpu_seconds"] is None and bare["warmup_steps"] == 0
    assert check_startup(bare, REF)[0] is None


def _with_tree_cpu(summary: dict, startup_cpu: float, warmup_cpu: float) -> dict:
    """A simulated record with the tree's CPU the feed reads: simulate's warm-up steps cost
    their wall time in CPU (its per-tick CPU), and the tree has start-up's on top."""
    ticks = summary["tick_cpu"][:3]
    return {**summary, "first_batch_tree_cpu": startup_cpu,
            "warmup_tree_cpu": [startup_cpu + warmup_cpu * (c - 0.5) / (ticks[-1] - 0.5) for c in ticks]}


@pytest.mark.parametrize("mode", ["time", "steps"])
def test_check_budget_judges_start_up_in_both_modes_but_not_the_baselines_own(mode):
    kw = {"max_steps": 40 if mode == "steps" else None}
    summary, result = simulate(warmup_seconds=0.1, max_steps=kw["max_steps"])
    honest = _with_tree_cpu(summary, 4.0, 0.3)
    problem, fig = check_budget(honest, result, time_budget=20.0, warmup_steps=3, startup_reference=REF, **kw)
    assert problem is None, problem
    assert fig["startup_cpu_seconds"] == 4.0 and fig["startup_cpu_allowed_seconds"] == 9.0
    assert fig["startup_wall_seconds"] == pytest.approx(2.0) and fig["warmup_cpu_seconds"] == pytest.approx(0.3)

    trained = _with_tree_cpu(summary, 41.0, 0.3)
    problem, fig = check_budget(trained, result, time_budget=20.0, warmup_steps=3, startup_reference=REF, **kw)
    assert problem.startswith("trained before the clock: 41.0 s of CPU before the first batch, allowed 9.0 s")
    assert not load_sensitive(fig)

    in_warmup = _with_tree_cpu(summary, 4.0, 30.0)
    problem, _ = check_budget(in_warmup, result, time_budget=20.0, warmup_steps=3, startup_reference=REF, **kw)
    assert "30.0 s of CPU in its 3 untimed warm-up steps" in problem
    # The baseline's own runs are the reference: recorded, never judged.
    problem, fig = check_budget(trained, result, time_budget=20.0, warmup_steps=3, startup_reference=REF,
                                judge_startup=False, **kw)
    assert problem is None and fig["startup_cpu_seconds"] == 41.0


def test_the_reference_is_the_largest_start_up_of_the_runs_ok_baseline_runs(tmp_path):
    store = Store(tmp_path / "experiments.db")
    try:
        run_id = store.create_run("a")["id"]
        base = store.new_trial(run_id, "baseline")["id"]
        cand = store.new_trial(run_id, "proposal")["id"]
        assert startup_reference(store, run_id) is None
        for trial, role, status, cpu, wall in ((base, "baseline", "ok", 4.0, 6.0), (base, "baseline", "ok", 3.0, 9.0),
                                               (base, "baseline", "crash", 50.0, 60.0),
                                               (cand, "candidate", "ok", 80.0, 90.0)):
            store.add_measurement(trial, 3.0, seed=1, role=role, status=status,
                                  budget={"startup_cpu_seconds": cpu, "startup_wall_seconds": wall})
        assert startup_reference(store, run_id) == {"cpu_seconds": 4.0, "wall_seconds": 9.0}
    finally:
        store.close()


# ---------------------------------------------------------------------------- the figures


_CHILD_BURNS = (
    "import subprocess, sys, time\n"
    # A child that burns 1 s of CPU and stays alive: its parent's cutime never holds it.
    "child = subprocess.Popen([sys.executable, '-S', '-c', 'import time\\n"
    "end = time.process_time() + 1.0\\nwhile time.process_time() < end: pass\\nprint(1, flush=True)\\n"
    "time.sleep(60)'], stdout=subprocess.PIPE)\n"
    "child.stdout.readline()\n"
    "from autoloop.harness.feed import feed_client\n"
    "feed = feed_client()\n"
    "stream = feed.open_stream('train', 2, 16)\n"
    "stream.next_windows()\n"
    "end = time.process_time() + 0.5\n"          # the warm-up steps work 0.5 s of CPU between them
    "while time.process_time() < end: pass\n"
    "for k in range(4):\n"
    "    feed.tick(k + 1)\n"
    "time.sleep(0.3)\n"
    "child.kill(); child.wait()\n"
)


def test_the_feed_reads_the_whole_trees_cpu_at_the_first_batch_and_the_warm_up_ticks(tmp_path, embedded_dataset):
    script = tmp_path / "tree.py"
    script.write_text(_CHILD_BURNS)
    with H.FeedServer(embedded_dataset.path, tmp_path / "feed.sock", seed=0) as feed:
        env = {**os.environ, "AUTOLOOP_FEED": str(feed.address)}
        proc = subprocess.Popen([sys.executable, str(script)], env=env)
        feed.mark_spawn(pid=proc.pid)
        assert proc.wait(timeout=120) == 0
        summary = feed.summary()
    tree, peer = summary["first_batch_tree_cpu"], summary["tick_cpu"]
    assert summary["root_pid"] == proc.pid and len(summary["warmup_tree_cpu"]) == 3  # the warm-up ticks only
    # The live child's 1 s is in the tree, not in the process that talks to the feed
    # (whose own CPU at the first tick is its imports plus the 0.5 s of warm-up work).
    assert 0.9 <= tree - (peer[0] - 0.5) <= 1.5, (tree, peer)
    figures = startup_figures(summary, 3)
    assert 0.45 <= figures["warmup_cpu_seconds"] <= 0.8, figures


def test_tree_cpu_counts_live_descendants_and_nothing_else():
    child = subprocess.Popen([sys.executable, "-S", "-c",
                              "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\n"
                              "print(1, flush=True)\ntime.sleep(30)"], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()
        mine = time.process_time()
        # Our tree holds the child (0.6 s) and ourselves; the child's tree only the child.
        assert 0.55 <= tree_cpu_seconds(child.pid) <= 0.8
        assert tree_cpu_seconds(os.getpid()) >= mine + 0.55
    finally:
        child.kill()
        child.wait()
    assert tree_cpu_seconds(child.pid) is None  # gone: no figure
    assert tree_cpu_seconds(None) is None
