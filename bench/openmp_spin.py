"""The OpenMP spin count beside CPU burners (autoloop/base/openmp.py's figures).

Times train.py's real CPU training step (`autoloop check`'s set-up of it) for --steps
steps in a fresh process per setting, quiet and beside --burners `while True: pass`
processes, and prints per setting: the median, 90th-percentile and longest step, the
median and longest step's CPU time, the total, and how many steps took over 4x the
median. Usage: python bench/openmp_spin.py [--steps 150] [--burners 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {  # name: what the process's environment gets (the rest is cleared of OpenMP settings)
    "GNU default (300,000)": {},
    "GOMP_SPINCOUNT=10000 (autoloop's)": {"GOMP_SPINCOUNT": "10000"},
    "GOMP_SPINCOUNT=1000": {"GOMP_SPINCOUNT": "1000"},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
}

STEPS = r'''
import json, statistics, sys, time
import importlib.util, torch
from autoloop import check as C, harness as H
from autoloop.check.training import batch_shape, model_seq_len
spec = importlib.util.spec_from_file_location("train", sys.argv[1])
module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
device = torch.device("cpu")
seq_len = model_seq_len(device)
batch, accum = batch_shape(module, seq_len)
ds = H.load_dataset(None)
model, optimizers, train_model, _ = C.training_setup(module, ds, device, seed=0, batch_size=batch)
loader = H.TokenLoader(ds, "train", batch, seq_len, device, seed=0)
step = module.make_train_step(model, optimizers, loader, grad_accum=accum, train_model=train_model)
walls, cpus = [], []
for _ in range(int(sys.argv[2]) + 2):
    c0, t0 = time.process_time(), time.perf_counter()
    step()
    walls.append(time.perf_counter() - t0); cpus.append(time.process_time() - c0)
walls, cpus = walls[2:], cpus[2:]  # the first steps allocate
median = statistics.median(walls)
print(json.dumps({"median": median, "p90": sorted(walls)[int(0.9 * (len(walls) - 1))], "max": max(walls),
                  "cpu_median": statistics.median(cpus), "cpu_max": max(cpus), "total": sum(walls),
                  "over_4x": sum(w > 4 * median for w in walls)}))
'''


def time_steps(extra: dict[str, str], steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(extra, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", STEPS, str(ROOT / "train.py"), str(steps)], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--burners", type=int, default=2)
    args = parser.parse_args()
    for burners in (0, args.burners):
        load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
        try:
            for name, extra in SETTINGS.items():
                f = time_steps(extra, args.steps if burners else min(args.steps, 60))
                print(f"{burners} burners  {name:<34} step median {f['median']:.3f} s  p90 {f['p90']:.3f}  "
                      f"max {f['max']:.3f}  cpu median {f['cpu_median']:.3f} max {f['cpu_max']:.3f}  "
                      f"total {f['total']:.1f} s  over 4x median: {f['over_4x']}", flush=True)
        finally:
            for burner in load:
                burner.kill()
                burner.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
