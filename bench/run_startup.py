"""What one short train.py run costs in CPU seconds, start-up included, and what it imported.

    python bench/run_startup.py                           # this checkout, 5 runs of 6 steps
    python bench/run_startup.py --against /path/to/other/checkout --runs 7

On a CPU a test's or a short night's run is mostly start-up: importing torch, building the
model, the warm-up. This runs train.py as a trial does (step mode, the checkpoint written,
evaluation left to the harness: AUTOLOOP_EVAL=external), one OpenMP thread, and prints per
checkout the median CPU and wall seconds of a run and whether it imported the compiler
(torch._dynamo, torch._inductor), with the import log's figure for it. With --against,
the runs of the two checkouts (each its own train.py and autoloop package) alternate, so a
busy machine weighs on both alike. Prints its figures; it is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
COMPILER = ("torch._dynamo", "torch._inductor")


def one_run(checkout: Path, work: Path, cache: Path, steps: int) -> dict:
    """One run of `checkout`'s train.py: CPU and wall seconds, and the compiler's import time (None: not imported)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOLOOP_")}
    env.update(PYTHONPATH=str(checkout), PYTHONPROFILEIMPORTTIME="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               AUTOLOOP_CACHE_DIR=str(cache), AUTOLOOP_MAX_STEPS=str(steps), AUTOLOOP_EVAL="external",
               AUTOLOOP_CHECKPOINT=str(work / "model.pt"), AUTOLOOP_RESULT=str(work / "result.json"))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(checkout / "train.py")], cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"error: {checkout / 'train.py'} exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    compiler_us = 0
    seen = False
    for line in proc.stderr.splitlines():
        if line.startswith("import time:"):
            _, cumulative, name = line.split("|")
            if name.strip() in COMPILER:
                seen = True
                compiler_us = max(compiler_us, int(cumulative))
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"cpu": cpu, "wall": wall, "compiler": compiler_us / 1e6 if seen else None}


def main() -> int:
    parser = argparse.ArgumentParser(description="CPU seconds of one short train.py run, start-up included.")
    parser.add_argument("--against", type=Path, default=None, help="Another checkout to compare (its train.py and autoloop).")
    parser.add_argument("--runs", type=int, default=5, help="Runs per checkout (default 5).")
    parser.add_argument("--steps", type=int, default=6, help="Training steps per run (default 6, the tests' loops).")
    args = parser.parse_args()
    checkouts = [REPO_ROOT] + ([args.against.resolve()] if args.against else [])
    for checkout in checkouts:
        if not (checkout / "train.py").is_file() or not (checkout / "autoloop" / "harness").is_dir():
            raise SystemExit(f"error: {checkout} is not an autoloop checkout (no train.py or autoloop/harness): name one")
    figures: dict[Path, list[dict]] = {c: [] for c in checkouts}
    with tempfile.TemporaryDirectory(prefix="run-startup-") as tmp:
        cache = Path(tmp) / "cache"
        for checkout in checkouts:  # the corpus and the caches, once each, not counted
            (Path(tmp) / "warm").mkdir(exist_ok=True)
            one_run(checkout, Path(tmp) / "warm", cache, 1)
        for _ in range(args.runs):
            for checkout in checkouts:
                work = Path(tmp) / f"{len(figures[checkout])}-{checkouts.index(checkout)}"
                work.mkdir()
                figures[checkout].append(one_run(checkout, work, cache, args.steps))
    print(f"{args.runs} runs of {args.steps} steps each, one OpenMP thread, on {os.cpu_count()} cores "
          f"(load {os.getloadavg()[0]:.2f} at the end)")
    for checkout, runs in figures.items():
        compiler = [r["compiler"] for r in runs if r["compiler"] is not None]
        said = f"imported the compiler in {len(compiler)} of {len(runs)} runs" + (
            f" ({statistics.median(compiler):.2f} s of import time)" if compiler else "")
        print(f"  {checkout}: CPU {statistics.median(r['cpu'] for r in runs):.2f} s, "
              f"wall {statistics.median(r['wall'] for r in runs):.2f} s (medians); {said}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
