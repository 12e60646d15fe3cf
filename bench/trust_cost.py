"""What trusting a trial costs: the sandbox (and, next, the separate evaluation) per trial.

    python bench/trust_cost.py               # 15 runs of each command, plain and sandboxed
    python bench/trust_cost.py --runs 31     # steadier medians on a busy machine

Section 1, the sandbox: the same command run through `autoloop.measure.runner.run_training`, as the
controller runs a trial, once plain (sandbox "off") and once in bubblewrap, alternately, so
a machine that gets busier mid-bench slows both alike. The figure is the difference of the
medians of the whole call (building the bwrap command, spawn, the command, teardown of the
PID namespace, the sweep for leftover processes), for `python -c pass` (start-up and
teardown alone) and `python -c 'import torch'` (a trial's imports through the read-only
binds). The sandbox is a fixed cost per process, the same at the CPU and the GPU scale
(the GPU device nodes add one bind each); a trial runs two sandboxed processes, training
and evaluation, and the figure per trial counts both. The share is of a 300 s trial.

Each section is a function that prints its table and returns its per-trial seconds;
SECTIONS lists them, and the total at the end adds them up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TRIAL_SECONDS = 300.0
SANDBOXED_PROCESSES_PER_TRIAL = 2  # training and evaluation


def timed_run(argv: list[str], policy, folder: Path) -> float:
    """Seconds of one `run_training` call for `argv` under `policy`, or raises if it failed."""
    from autoloop.measure.runner import run_training
    from autoloop.measure.sandbox import SandboxPaths

    started = time.perf_counter()
    outcome = run_training(
        argv, cwd=folder, env={"OMP_NUM_THREADS": "1"}, log_path=folder / "bench.log", deadline_seconds=120,
        sandbox=policy, sandbox_paths=SandboxPaths(writable=(folder,)),
    )
    seconds = time.perf_counter() - started
    if outcome.returncode != 0:
        raise SystemExit(f"{argv} failed under {policy.describe()}: {outcome.reason}; see {folder / 'bench.log'}")
    return seconds


def section_sandbox(args: argparse.Namespace) -> float:
    from autoloop.measure.sandbox import detect

    policy = detect("auto")
    print(f"1. sandbox: {policy.describe()}")
    if policy.kind != "bwrap":
        print("   bubblewrap cannot run here: nothing to measure (trials run unsandboxed, at no cost)\n")
        return 0.0
    off = detect("off")
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    }
    print(f"   median of {args.runs} runs each, seconds per process; plain and sandboxed alternate")
    print(f"   {'command':<28}{'plain':>9}{'bwrap':>9}{'cost':>9}")
    costs = []
    with tempfile.TemporaryDirectory(prefix="autoloop-trust-") as tmp:
        folder = Path(tmp)
        for label, argv in commands.items():
            timed_run(argv, off, folder)  # warm the page cache for both
            plain, boxed = [], []
            for _ in range(args.runs):
                plain.append(timed_run(argv, off, folder))
                boxed.append(timed_run(argv, policy, folder))
            cost = statistics.median(boxed) - statistics.median(plain)
            costs.append(cost)
            print(f"   {label:<28}{statistics.median(plain):>9.3f}{statistics.median(boxed):>9.3f}{cost:>+9.3f}")
    per_trial = SANDBOXED_PROCESSES_PER_TRIAL * max(costs)
    print(f"   per trial ({SANDBOXED_PROCESSES_PER_TRIAL} sandboxed processes, the larger cost): {per_trial:.3f} s = "
          f"{100 * per_trial / TRIAL_SECONDS:.2f}% of a {TRIAL_SECONDS:.0f} s trial\n")
    return per_trial


def section_evaluation(args: argparse.Namespace) -> float:
    """The separate evaluation process: bench/eval_cost.py, run as it is; its CPU-scale
    "added per trial" figure counts toward the total, and its GPU estimate is printed."""
    import re
    import subprocess
    import sys

    print("\n== separate evaluation (bench/eval_cost.py) ==")
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("eval_cost.py")), "--repeats", "3"],
                          capture_output=True, text=True)
    print(done.stdout.rstrip())
    if done.returncode != 0:
        print(done.stderr.strip()[-2000:])
        return 0.0
    added = re.findall(r"added per trial.*?([0-9.]+) s", done.stdout)
    return float(added[0]) if added else 0.0


SECTIONS = [section_sandbox, section_evaluation]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="runs of each command in each mode")
    args = parser.parse_args()
    total = sum(section(args) for section in SECTIONS)
    print(f"total: {total:.3f} s per trial = {100 * total / TRIAL_SECONDS:.2f}% of a {TRIAL_SECONDS:.0f} s trial "
          "(target: at most 3%)")


if __name__ == "__main__":
    main()
