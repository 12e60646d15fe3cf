"""What trusting a trial costs: the sandbox and the split evaluation, per trial.

    python bench/trust_cost.py               # 15 runs of each command, plain and sandboxed
    python bench/trust_cost.py --runs 31     # steadier medians on a busy machine
    python bench/trust_cost.py --only sandbox   # section 1 alone

Section 1, the sandbox: the same command run through `autoloop.measure.runner.run_training`, as the
controller runs a trial, once plain (sandbox "off") and once in bubblewrap, alternately, so
a machine that gets busier mid-bench slows both alike. The figure is the difference of the
medians of the whole call (building the bwrap command, spawn, the command, teardown of the
PID namespace, the sweep for leftover processes), for `python -c pass` (start-up and
teardown alone) and `python -c 'import torch'` (a trial's imports through the read-only
binds). The sandbox is a fixed cost per process, the same at the CPU and the GPU scale
(the GPU device nodes add one bind each); a trial runs three sandboxed processes, training,
the evaluation's model process and its scorer, and the figure per trial counts all three.
The share is of a 300 s trial.

Section 2, the split evaluation: bench/eval_cost.py, measured at the CPU scale and
estimated for a GPU trial from measured parts. The totals add the sandbox to each.

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
SANDBOXED_PROCESSES_PER_TRIAL = 3  # training, the model process, the scorer


def timed_run(argv: list[str], policy, folder: Path) -> float:
    """Seconds of one `run_training` call for `argv` under `policy`, or raises if it failed.
    The layout is a trial's, this repository as its project (its tracked files listed by git
    and bound one by one where a folder also holds untracked files): the allow-list's cost
    is in the figure."""
    from autoloop.measure.runner import run_training
    from autoloop.measure.sandbox import SandboxPaths

    started = time.perf_counter()
    outcome = run_training(
        argv, cwd=ROOT, env={"OMP_NUM_THREADS": "1"}, log_path=folder / "bench.log", deadline_seconds=120,
        sandbox=policy, sandbox_paths=SandboxPaths.for_trial(ROOT, folder / "run", db_path="experiments.db"),
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


def section_evaluation(args: argparse.Namespace) -> tuple[float, float]:
    """The split evaluation: bench/eval_cost.py, run as it is; (CPU measured, GPU estimated) added per trial."""
    import re
    import subprocess
    import sys

    print("\n2. split evaluation (bench/eval_cost.py)")
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("eval_cost.py")), "--repeats", "3"],
                          capture_output=True, text=True)
    print(done.stdout.rstrip())
    if done.returncode != 0:
        print(done.stderr.strip()[-2000:])
        return 0.0, 0.0
    gpu = re.findall(r"added per trial \(split - in-proc\)\s+([0-9.]+) s", done.stdout)
    cpu = re.findall(r"added per trial \(CPU\) ([0-9.-]+) s", done.stdout)
    return (float(cpu[0]) if cpu else 0.0), (float(gpu[0]) if gpu else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="runs of each command in each mode")
    parser.add_argument("--only", choices=("sandbox", "evaluation"), help="run one section")
    args = parser.parse_args()
    sandbox = section_sandbox(args) if args.only != "evaluation" else 0.0
    if args.only == "sandbox":
        return
    cpu, gpu = section_evaluation(args)
    for label, total in (("CPU trial, measured", sandbox + cpu),
                         ("GPU trial, estimated from measured parts", sandbox + gpu)):
        print(f"total, {label}: {total:.2f} s per trial = {100 * total / TRIAL_SECONDS:.2f}% of a "
              f"{TRIAL_SECONDS:.0f} s trial (target: at most 3%)")


if __name__ == "__main__":
    main()
