"""The embedded corpus over several keys: its size, its generation time, and the honest
train.py's val_bpb on it.

    python bench/corpus_keys.py [--keys 3] [--steps 120] [--threads 1]

For each key (fixed keys, 0x00..0x1f then repeated bytes, so reruns compare) it generates
the corpus into a temporary cache folder, then runs train.py in step mode (the README's
first command trains 120 steps), which repeats bit for bit on a CPU however busy the
machine is: the spread of val_bpb over keys is the language's, not the machine's. The
generation time depends on the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoloop.harness.corpus_key import corpus_key_path, write_key  # noqa: E402
from autoloop.harness.data import prepare_embedded  # noqa: E402


def keys(count: int) -> list[bytes]:
    return [bytes(range(32))] + [bytes([17 * k]) * 32 for k in range(1, count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=3, help="How many keys to measure.")
    parser.add_argument("--steps", type=int, default=120, help="Optimizer steps of each step-mode run.")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run.")
    args = parser.parse_args()
    figures = []
    for key in keys(args.keys):
        with tempfile.TemporaryDirectory() as tmp:
            cache = Path(tmp)
            write_key(corpus_key_path(cache), key)
            os.environ["AUTOLOOP_CACHE_DIR"] = str(cache)
            start, cpu = time.perf_counter(), time.process_time()
            ds = prepare_embedded()
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            size = sum(s["bytes"] for s in ds.meta["splits"].values())
            env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOLOOP_")}
            env.update(AUTOLOOP_CACHE_DIR=str(cache), AUTOLOOP_MAX_STEPS=str(args.steps), CUDA_VISIBLE_DEVICES="",
                       OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(ROOT))
            proc = subprocess.run([sys.executable, str(ROOT / "train.py")], cwd=ROOT, env=env, capture_output=True,
                                  text=True)
            match = re.search(r"^val_bpb:\s+([0-9.]+)", proc.stdout, re.M)
            if proc.returncode != 0 or not match:
                sys.exit(f"train.py failed on key {key.hex()[:8]}: {proc.stderr.strip().splitlines()[-1:]}")
            figures.append(float(match.group(1)))
            print(f"key {key.hex()[:8]}...: {size / 1e6:.1f} MB in {wall:.1f} s ({cpu:.1f} s CPU); "
                  f"val_bpb after {args.steps} steps: {figures[-1]:.4f}")
    print(f"val_bpb over {len(figures)} keys: mean {sum(figures) / len(figures):.4f}, "
          f"spread {max(figures) - min(figures):.4f}")


if __name__ == "__main__":
    main()
