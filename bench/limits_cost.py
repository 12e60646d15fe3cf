"""What watching a trial's limits costs (autoloop/measure/limits.py), and the feed's memory per request.

    python bench/limits_cost.py                 # 300 checks, a trial of 1 and of 40 processes
    python bench/limits_cost.py --checks 1000 --files 5000

1. One check of processes and memory (a scan of /proc, the trial's /proc/<pid>/status),
   for a trial of one process and of --processes processes (compile workers, dataloaders).
   The runner checks 5 times a second: per 300 s trial that is 1,500 checks.
2. One walk of out/ and compile/ holding --files files (an inductor cache), at most once a
   second: 300 walks per 300 s trial.
3. The data feed's peak RSS for a request of 2^19 windows of 12 tokens (in a subprocess
   client), with its budget: what the controller grows by (compare with the old feed by
   running this file from an older checkout, where the figure was ~590 MB).
The figures are printed; the share of a 300 s trial is the controller's CPU time, not the trial's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoloop.measure.limits import DISK_WALK_SECONDS, ResourceWatch, TrialLimits  # noqa: E402

TRIAL_SECONDS = 300
CHECKS_PER_SECOND = 5  # the runner's poll interval is 0.2 s
WALKS_PER_SECOND = 1


def _per_call(fn, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def check_cost(n_processes: int, checks: int) -> float:
    script = "sleep 60 & " * (n_processes - 1) + "wait" if n_processes > 1 else "exec sleep 60"
    tree = subprocess.Popen(["sh", "-c", script],
                            start_new_session=True)
    try:
        time.sleep(0.5)
        with tempfile.TemporaryDirectory() as empty:
            watch = ResourceWatch(TrialLimits(), {"out/": Path(empty)})
            watch.attach(tree.pid)
            cost = _per_call(watch._processes_and_memory, checks)
            seen = watch.peak["processes"]
    finally:
        os.killpg(tree.pid, 9)
        tree.wait()
    print(f"check of processes and memory, {seen} processes: {cost * 1e3:.2f} ms; per 300 s trial "
          f"{cost * CHECKS_PER_SECOND * TRIAL_SECONDS:.2f} s of the controller's CPU")
    return cost


def walk_cost(files: int, checks: int) -> float:
    with tempfile.TemporaryDirectory() as root:
        compile_dir = Path(root) / "compile"
        for i in range(files):
            folder = compile_dir / f"k{i // 10}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"f{i}").write_bytes(b"x" * 100)
        watch = ResourceWatch(TrialLimits(files=10 * files), {"out/": Path(root) / "out", "compile/": compile_dir})
        walk = _per_call(watch._disk, max(1, checks // 10))
        # What the watch does once a second while nothing is written: a statvfs, and a walk every 10 s.
        look = _per_call(lambda: watch._may_be_over(time.monotonic()), checks)
    cost = look + walk / DISK_WALK_SECONDS
    print(f"walk of out/ and compile/ with {files} files: {walk * 1e3:.2f} ms, done when the disk's free space says "
          f"they may be over or every {DISK_WALK_SECONDS:g} s; the look each second: {look * 1e6:.0f} us; per 300 s "
          f"trial {cost * WALKS_PER_SECOND * TRIAL_SECONDS:.2f} s of the controller's CPU")
    return cost


_CLIENT = """
import sys
from autoloop.harness.feed import FeedClient
client = FeedClient(sys.argv[1])
stream = client.open_stream("train", int(sys.argv[2]), int(sys.argv[3]))
stream.next_windows(); stream.next_windows()
client.close()
"""


def feed_growth() -> None:
    from autoloop.harness.data import load_dataset
    from autoloop.harness.feed import FeedServer

    def status(field: str) -> int:
        return next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith(field + ":"))

    ds = load_dataset()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with tempfile.TemporaryDirectory() as run, FeedServer(ds.path, Path(run) / "feed.sock") as server:
        before = status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
        subprocess.run([sys.executable, "-c", _CLIENT, str(server.address), str(2**19), "12"], env=env, check=True)
        grew = (status("VmHWM") - before) / 1024
        budget = getattr(server, "memory_budget", None)
    print(f"the feed's process grew by {grew:.0f} MB serving 2 batches of 2^19 x 13 tokens"
          + (f" (budget {budget >> 20} MiB)" if budget else " (no budget)"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checks", type=int, default=300)
    parser.add_argument("--processes", type=int, default=40)
    parser.add_argument("--files", type=int, default=2000)
    args = parser.parse_args()
    print(f"{sum(1 for p in os.listdir('/proc') if p.isdigit())} processes on this machine")
    total = check_cost(args.processes, args.checks) * CHECKS_PER_SECOND * TRIAL_SECONDS
    check_cost(1, args.checks)
    total += walk_cost(args.files, args.checks) * WALKS_PER_SECOND * TRIAL_SECONDS
    print(f"the watch per 300 s trial: about {total:.1f} s of the controller's CPU "
          f"({100 * total / TRIAL_SECONDS:.2f}% of one core), in the controller's thread, not the trial's")
    feed_growth()


if __name__ == "__main__":
    main()
