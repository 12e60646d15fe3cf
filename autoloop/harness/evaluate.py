"""The verifier's fresh process: rebuild a trial's model and check what it reported.

    python -m autoloop.harness.evaluate --train-py SNAPSHOT.py --checkpoint checkpoint.pt \
        --reported 1.2345 --out verdict.json [--data-dir DIR] [--device cpu|cuda] [--seed N]

The controller runs this (through the runner: own process group, deadline, log file) for
a trial that would become the new best. In order, stopping at the first failure:

1. rebuild: `load_trained_model` imports the trial's train.py (a snapshot taken from the
   trial's commit) as a module and loads the checkpoint strictly;
2. causality (`causality.check_causality`) on a few windows drawn at random from the
   validation split;
3. re-evaluation: `evaluate_bpb` on the validation split must match the reported val_bpb
   within VAL_TOLERANCE for the device. The verified value, not the reported one, is what
   the controller stores and compares, so a report that is off by less than the tolerance
   gains nothing;
4. held-out: `evaluate_bpb` on the held-out split, which training never reads.

The verdict JSON (written atomically) is `{"ok", "reason", "stage", "val_bpb",
"reported_val_bpb", "val_tolerance", "heldout_bpb", "causality", "device", "seconds",
"harness_fingerprint"}`; exit 0 whenever a verdict was written, pass or fail. The module
lives in the harness so that its fingerprint covers it: a trial that edits it at run
time is caught by the controller's integrity check. Only torch, numpy and the standard
library are used, like the rest of the harness.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from autoloop.harness.causality import check_causality
from autoloop.harness.checkpoint import load_trained_model
from autoloop.harness.constants import seq_len
from autoloop.harness.data import load_dataset
from autoloop.harness.errors import HarnessError
from autoloop.harness.fingerprint import compute_harness_fingerprint
from autoloop.harness.metric import evaluate_bpb
from autoloop.harness.results import write_json_atomic

# |re-evaluated - reported| allowed, in bits per byte. The trial and the verifier run the
# same harness evaluation on the same device: in float32 on a CPU they agree to ~1e-7;
# under bf16 autocast a proposal may evaluate through other kernels (a compiled model,
# another batch size), which moves the sum by ~1e-4. Both are far below a real lie and
# below what a keep decision turns on, and the verified value is what gets stored.
VAL_TOLERANCE = {"cpu": 1e-4, "cuda": 2e-3}
# Sequences in the causality batch (>= 2 for the batch-independence check).
CAUSALITY_BATCH = 2


def _causality_batch(ds, device: torch.device, seed: int) -> torch.Tensor:
    tokens = ds.split("val")
    length = seq_len(device.type)
    if len(tokens) < length + 1:
        length = len(tokens) - 1
    rng = np.random.Generator(np.random.PCG64(seed))
    starts = rng.integers(0, len(tokens) - length + 1, size=CAUSALITY_BATCH)
    windows = np.stack([tokens[s : s + length] for s in starts]).astype(np.int64)
    return torch.from_numpy(windows).to(device)


def verify(train_py: Path, checkpoint: Path, reported: float, *, data_dir: Path | None, device_name: str,
           seed: int) -> dict:
    """Run the checks; returns the verdict (never raises for a trial's fault)."""
    seconds: dict[str, float] = {}
    verdict: dict = {
        "ok": False, "reason": None, "stage": "rebuild", "val_bpb": None, "reported_val_bpb": reported,
        "val_tolerance": None, "heldout_bpb": None, "causality": None, "device": device_name, "seconds": seconds,
        "harness_fingerprint": compute_harness_fingerprint(),
    }
    if device_name == "cuda" and not torch.cuda.is_available():
        verdict["reason"] = "the trial trained on CUDA but the verifier sees no CUDA device"
        return verdict
    device = torch.device(device_name)
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    tolerance = VAL_TOLERANCE["cuda" if device.type == "cuda" else "cpu"]
    verdict["val_tolerance"] = tolerance

    started = time.perf_counter()
    ds = load_dataset(data_dir)
    try:
        model = load_trained_model(train_py, checkpoint, device)
    except HarnessError as exc:
        verdict["reason"] = f"cannot rebuild the model: {exc}"
        return verdict
    except Exception as exc:  # noqa: BLE001 - proposal code (import, build_model, load_state_dict) may raise anything
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        verdict["reason"] = f"cannot rebuild the model from train.py and its checkpoint: {last}"
        return verdict
    seconds["rebuild"] = time.perf_counter() - started

    verdict["stage"] = "causality"
    try:
        report = check_causality(
            model, _causality_batch(ds, device, seed), ds.vocab_size, seed=seed, autocast_dtype=autocast_dtype
        )
    except Exception as exc:  # noqa: BLE001 - the model's forward is proposal code
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        verdict["reason"] = f"the causality check could not run the model: {last}"
        return verdict
    verdict["causality"] = report.as_dict()
    seconds["causality"] = report.seconds
    if not report.ok:
        verdict["reason"] = report.reason
        return verdict

    verdict["stage"] = "val"
    started = time.perf_counter()
    val = evaluate_bpb(model, ds, "val", device=device)
    seconds["val"] = time.perf_counter() - started
    verdict["val_bpb"] = val
    if not math.isfinite(val):
        verdict["reason"] = f"re-evaluated val_bpb is {val}"
        return verdict
    if not abs(val - reported) <= tolerance:
        verdict["reason"] = (
            f"reported val_bpb {reported:.6f} but the harness measures {val:.6f} for its checkpoint "
            f"(difference {val - reported:+.6f}, tolerance {tolerance:g})"
        )
        return verdict

    verdict["stage"] = "heldout"
    started = time.perf_counter()
    verdict["heldout_bpb"] = evaluate_bpb(model, ds, "heldout", device=device)
    seconds["heldout"] = time.perf_counter() - started
    verdict["ok"], verdict["stage"] = True, "done"
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autoloop.harness.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--train-py", type=Path, required=True, help="the trial's train.py (a snapshot)")
    parser.add_argument("--checkpoint", type=Path, required=True, help="the trial's checkpoint.pt")
    parser.add_argument("--reported", type=float, required=True, help="the val_bpb the trial reported")
    parser.add_argument("--out", type=Path, required=True, help="where to write the verdict JSON")
    parser.add_argument("--data-dir", type=Path, default=None, help="the prepared dataset; the default one if omitted")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the device the trial trained on")
    parser.add_argument("--seed", type=int, default=0, help="seed of the causality check's random batch")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        verdict = verify(args.train_py, args.checkpoint, args.reported, data_dir=args.data_dir,
                         device_name=args.device, seed=args.seed)
    except HarnessError as exc:  # the data, not the trial: say so and let the controller report it
        print(f"ERROR: {exc}", flush=True)
        return 2
    verdict["seconds"]["total"] = time.perf_counter() - started
    write_json_atomic(args.out, verdict)
    print(f"verification {'passed' if verdict['ok'] else 'failed'}: {verdict['reason'] or 'ok'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
