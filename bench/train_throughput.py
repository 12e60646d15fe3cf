"""Training throughput of train.py at the default scale of this machine's device.

Method: runs train.py itself, as the controller would (a subprocess with the contract's
environment), for a short time budget, and reads its result JSON. The figures are
therefore exactly train.py's own: timed steps only (the harness's untimed warm-up
steps are excluded, and so is train.py's random-token warm-up, where torch.compile
compiles), data loading included, the final evaluation excluded. On a GPU it also prints
MFU in both conventions (train.py's and PaLM's, see docs/gpu.md) against the harness's
bf16 peak table.

    python bench/train_throughput.py                      # 20 s on CUDA, 10 s on a CPU
    python bench/train_throughput.py --budget 60
    python bench/train_throughput.py --train-py some/other/train.py

The first CUDA run also pays for compilation (the warm-up, reported separately); later runs
reuse the compile cache. Prints its figures; it is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description="Measure train.py's training throughput (tokens/s, ms/step, MFU).")
    parser.add_argument("--train-py", type=Path, default=REPO_ROOT / "train.py", help="The training script to measure.")
    parser.add_argument("--budget", type=float, default=None,
                        help="Seconds of timed training (default: 20 on CUDA, 10 on a CPU).")
    parser.add_argument("--seed", type=int, default=1337, help="AUTOLOOP_SEED for the run.")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    budget = args.budget or (20.0 if cuda else 10.0)
    with tempfile.TemporaryDirectory(prefix="autoloop-bench-") as tmp:
        result_path = Path(tmp) / "result.json"
        env = {k: v for k, v in os.environ.items() if k not in ("AUTOLOOP_MAX_STEPS", "AUTOLOOP_CHECKPOINT", "AUTOLOOP_PROGRESS")}
        env.update(AUTOLOOP_TIME_BUDGET=str(budget), AUTOLOOP_SEED=str(args.seed), AUTOLOOP_RESULT=str(result_path))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        print(f"running {args.train_py} for {budget:g} s of timed training on {'cuda' if cuda else 'cpu'} ...", flush=True)
        start = time.monotonic()
        proc = subprocess.run([sys.executable, str(args.train_py)], check=False, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        wall = time.monotonic() - start
        if proc.returncode != 0 or not result_path.exists():
            print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
            print(f"train.py exited {proc.returncode}", file=sys.stderr)
            return 1
        result = json.loads(result_path.read_text())

    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)

    print(f"device:            {result['device']}")
    print(f"params:            {result['num_params']:,} ({result.get('depth')} layers x {result.get('model_dim')})")
    print(f"tokens/step:       {result.get('batch_tokens', 0):,}")
    print(f"steps:             {result['num_steps']} ({result['training_seconds']:.1f} s timed)")
    print(f"tokens/s:          {fmt(result.get('tokens_per_second'), ',.0f')}")
    print(f"ms/step:           {fmt(result.get('ms_per_step'), '.1f')}")
    pct = lambda key: f"{fmt(result.get(key), '.1f')}{'%' if result.get(key) is not None else ''}"  # noqa: E731
    print(f"mfu:               {pct('mfu_percent')} (train.py: 6N + 12LHQ(T+1)/2)")
    print(f"mfu, PaLM:         {pct('mfu_percent_palm')} (6N + 12LHQT, as nanochat / autoresearch)")
    print(f"peak memory:       {result['peak_memory_mb']:,.0f} MB")
    print(f"attention:         {result.get('attention_kernel')} (ran {result.get('attention_kernel_ran')})")
    print(f"compiled:          {result.get('compiled')}, warm-up {fmt(result.get('warmup_seconds'), '.1f')} s, "
          f"{result.get('graphs_compiled_in_training')} graphs compiled in training")
    print(f"untimed steps:     {result['compile_seconds']:.1f} s")
    print(f"eval:              {result['eval_seconds']:.1f} s   val_bpb {result['val_bpb']:.4f}")
    print(f"wall:              {wall:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
