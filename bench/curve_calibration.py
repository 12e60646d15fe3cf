"""Real train.py curves on this CPU: the data the simulator's partial-run model is fitted on.

    python bench/curve_calibration.py                       # writes tests/data/curve_calibration.json (~30 min)
    python bench/curve_calibration.py --steps 60 --seeds 1 2 3 4 --out /tmp/cal.json
    python bench/curve_calibration.py --resume              # continue an interrupted collection

Step mode (AUTOLOOP_MAX_STEPS), so every run is deterministic and the file reproducible
on the same machine and torch. The unmodified train.py and a few one-constant changes
of the kind the search proposer makes (learning rates x2 and x0.5, the warm-down's
length), each at the same seeds: a change and the unmodified script at the same seed see
the same batches in the same order, so the difference of their loss curves at the same
step is the paired partial difference the early stop looks at, and the difference of
their val_bpb the paired final one (docs/decisions.md, "Early stop").

Each run: a copy of train.py with the constants set, in a fresh folder, with the
embedded corpus; the result JSON's val_bpb and curve ({"step", "seconds", "loss", "lr"})
are stored as they come. autoloop/decide/simulate.py (`CurveModel`) reads the file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "data" / "curve_calibration.json"

# One-constant changes: the search proposer's x2 / x0.5 ladder on the constants that move
# val_bpb most on this CPU, and the schedule's warm-down (where curves change shape).
VARIANTS: dict[str, dict[str, str]] = {
    "base": {},
    "matrix_lr_x2": {"MATRIX_LR": "0.08"},
    "matrix_lr_x0.5": {"MATRIX_LR": "0.02"},
    "embedding_lr_x2": {"EMBEDDING_LR": "1.2"},
    "embedding_lr_x0.5": {"EMBEDDING_LR": "0.3"},
    "unembedding_lr_x2": {"UNEMBEDDING_LR": "0.008"},
    "warmdown_0.3": {"WARMDOWN_RATIO": "0.3"},
    "warmdown_0.7": {"WARMDOWN_RATIO": "0.7"},
}


def with_constants(source: str, sets: dict[str, str]) -> str:
    """train.py with each `NAME = value` line (module level) set to the new value."""
    for name, value in sets.items():
        pattern = re.compile(rf"^{name} = [^#\n]*", re.M)
        if not pattern.search(source):
            raise SystemExit(f"train.py has no module-level constant {name}")
        source = pattern.sub(f"{name} = {value}  ", source, count=1)
    return source


def one_run(source: str, steps: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="curve-cal-") as tmp:
        folder = Path(tmp)
        (folder / "train.py").write_text(source)
        result = folder / "result.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOLOOP_") or k == "AUTOLOOP_CACHE_DIR"}
        env.update(AUTOLOOP_MAX_STEPS=str(steps), AUTOLOOP_SEED=str(seed), AUTOLOOP_RESULT=str(result),
                   PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
        started = time.monotonic()
        done = subprocess.run([sys.executable, "train.py"], cwd=folder, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"train.py failed (seed {seed}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        data = json.loads(result.read_text())
        return {"val_bpb": data["val_bpb"], "num_steps": data["num_steps"], "wall_seconds": time.monotonic() - started,
                "curve": [[p["step"], p["loss"], round(p["lr"], 6)] for p in data["curve"]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="Training steps per run (step mode).")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4], help="Seeds every variant runs at.")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), help="Which variants (names above).")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="The JSON file to write.")
    ap.add_argument("--resume", action="store_true", help="Keep the runs already in --out and add the missing ones.")
    args = ap.parse_args()
    import torch

    source = (ROOT / "train.py").read_text()
    data = {"about": "real train.py curves in step mode on a CPU, written by bench/curve_calibration.py",
            "steps": args.steps, "seeds": args.seeds, "variants": {v: VARIANTS[v] for v in args.variants},
            "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "curve_columns": ["step", "loss", "lr"], "runs": []}
    if args.resume and args.out.exists():
        old = json.loads(args.out.read_text())
        if old.get("steps") != args.steps:
            raise SystemExit(f"{args.out} holds {old.get('steps')}-step runs, not {args.steps}: drop --resume")
        data["runs"] = old["runs"]
    have = {(r["variant"], r["seed"]) for r in data["runs"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:  # seed-major: an interrupted collection still has complete seeds
        for name in args.variants:
            if (name, seed) in have:
                continue
            run = one_run(with_constants(source, VARIANTS[name]), args.steps, seed)
            data["runs"].append({"variant": name, "seed": seed, **run})
            args.out.write_text(json.dumps(data, separators=(",", ":")) + "\n")
            print(f"{name:<20} seed {seed}: val_bpb {run['val_bpb']:.5f} ({run['wall_seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
