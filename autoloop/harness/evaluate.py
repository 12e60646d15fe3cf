"""The evaluation process: the harness's val_bpb (and checks) of a trial's checkpoint.

    python -m autoloop.harness.evaluate --train-py SOURCE/train.py --checkpoint checkpoint.pt \
        --out verdict.json [--data-dir DIR] [--device cpu|cuda] [--splits val[,heldout]] \
        [--causality] [--seed N] [--reported X]

Under the controller every trial's metric comes from here (training runs with
AUTOLOOP_EVAL=external and never evaluates); a keep candidate also gets the causality
check and the held-out split. The controller runs it through the runner (own process
group, deadline, log file), sandboxed where it can (sees val, and held-out when asked;
writes only its output folder). In order, stopping at the first failure:

1. seal: every harness module is imported and sealed (`HarnessSeal`: each attribute of
   each `autoloop.harness` module and of the classes they define, a function's code,
   defaults and closure, the content of module-level dicts and lists), together with the
   torch, numpy and Python functions the evaluation computes the loss with (all of
   `torch.nn.functional` and `torch._C._nn`, the methods of `torch.Tensor`, `nn.Module`,
   the builtins, ...). The dataset is loaded and the functions used below are bound now,
   before any code of the trial has run;
2. import (stage "import"): `load_trained_model` imports the trial's train.py (a copy
   taken from its commit) as a module, builds the model and loads the checkpoint
   strictly. If that replaced anything sealed, the verdict fails naming it ("importing
   train.py replaced the harness's evaluate_bpb: autoloop.harness.evaluate_bpb, ...");
3. causality (with --causality): `check_causality` on a few windows of the val split;
4. val: `evaluate_bpb` on the validation split; with --reported it must match the
   trial's own number within VAL_TOLERANCE for the device;
5. heldout (when asked): `evaluate_bpb` on the held-out split, which training never reads.
   val and held-out equal to IDENTITY_DIGITS significant digits fail: two different
   splits never score the same, a replaced evaluation does.
After every stage that ran trial code (the model's forward) the seal is checked again.

What this protects against: a trial whose code, at import or while its model runs,
rebinds, wraps or re-codes the functions that compute its score (the harness, the loss,
the tensor methods it uses). What it cannot: code written to find the evaluator's own
objects in memory (`gc.get_objects()`), or a model whose outputs are honest only on the
inputs the checks draw. Bytecode: the controller runs this with PYTHONPYCACHEPREFIX on a
folder no trial can write (autoloop.evaluation.pycache_env), so a .pyc planted beside
the harness sources is never read.

The verdict JSON (written atomically) is `{"ok", "reason", "stage", "val_bpb",
"heldout_bpb", "reported_val_bpb", "val_tolerance", "causality", "splits", "device",
"seconds" {startup, seal, import, causality, val, heldout, total}, "harness_fingerprint",
"pycache_prefix", "replaced"}`; exit 0 whenever a verdict was written, pass or fail; 2 when
the data itself is broken (the controller reports that, not the trial). Only torch, numpy
and the standard library are used, like the rest of the harness.
"""

from __future__ import annotations

import argparse
import builtins
import importlib
import math
import os
import pkgutil
import sys
import time
import traceback
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import autoloop.harness as _harness_package
from autoloop.harness.causality import check_causality
from autoloop.harness.checkpoint import load_trained_model
from autoloop.harness.constants import seq_len
from autoloop.harness.data import load_dataset
from autoloop.harness.errors import HarnessError
from autoloop.harness.fingerprint import compute_harness_fingerprint
from autoloop.harness.metric import evaluate_bpb
from autoloop.harness.results import write_json_atomic

# |re-evaluated - reported| allowed with --reported, in bits per byte. In float32 on a CPU
# the trial's and this evaluation agree to ~1e-7; under bf16 autocast a proposal may
# evaluate through other kernels (a compiled model, another batch size), ~1e-4. Both are
# far below a real lie, and the evaluated value is what the controller stores.
VAL_TOLERANCE = {"cpu": 1e-4, "cuda": 2e-3}
# Sequences in the causality batch (>= 2 for the batch-independence check).
CAUSALITY_BATCH = 2
# val and held-out bpb equal to this many significant digits are not two measurements.
IDENTITY_DIGITS = 9
SPLIT_CHOICES = ("val", "heldout")


def suspicious_identity(val_bpb: float | None, heldout_bpb: float | None) -> str | None:
    """A reason when val and held-out bpb agree to IDENTITY_DIGITS significant digits.

    The two splits are different text: their bpb differ in the 2nd or 3rd digit for any
    real model. Equality to 9 digits means one number was produced for both (a replaced
    evaluation returning a constant)."""
    if val_bpb is None or heldout_bpb is None:
        return None
    if not (math.isfinite(val_bpb) and math.isfinite(heldout_bpb)):
        return None
    if f"{val_bpb:.{IDENTITY_DIGITS}g}" != f"{heldout_bpb:.{IDENTITY_DIGITS}g}":
        return None
    return (f"val_bpb and held-out bpb are identical to {IDENTITY_DIGITS} digits ({val_bpb:.{IDENTITY_DIGITS}g}): "
            "two different splits never score the same, so the evaluation was not the harness's")


# ---------------------------------------------------------------------------------------
# The seal
# ---------------------------------------------------------------------------------------

# Whole namespaces whose every entry is sealed: what evaluate_bpb, bpb_on_batches,
# loss_and_bytes, check_causality and the loader call, down to the C bindings.
# The flag: names added later count too (an attribute set on torch.Tensor shadows the
# TensorBase method it inherited).
_SEALED_NAMESPACES = (
    ("torch.nn.functional", lambda: F, True),
    ("torch._C._nn", lambda: torch._C._nn, True),
    ("torch.Tensor", lambda: torch.Tensor, True),
    ("torch._C.TensorBase", lambda: torch._C.TensorBase, True),
    ("torch.nn.Module", lambda: torch.nn.Module, True),
    ("builtins", lambda: builtins, False),
    ("math", lambda: math, False),
)
# Single names in big namespaces (sealing all of `torch` would seal lazily loaded parts).
_SEALED_NAMES = {
    "torch": ("log_softmax", "softmax", "cross_entropy", "nll_loss", "from_numpy", "as_tensor", "no_grad",
              "inference_mode", "autocast", "stack", "cat", "randint", "Generator", "device", "load", "isfinite",
              "is_grad_enabled", "set_grad_enabled", "float32", "int64", "bfloat16", "Tensor", "nn"),
    "torch._C._VariableFunctions": ("log_softmax", "cross_entropy_loss", "nll_loss", "from_numpy", "as_tensor",
                                    "stack", "randint", "isfinite", "sum"),
    "numpy": ("asarray", "stack", "arange", "fromfile", "memmap", "frombuffer", "int64", "uint16", "uint32",
              "random", "ndarray"),
}
# Attributes that change on their own (bookkeeping, not behaviour).
_VOLATILE = {"__warningregistry__", "_", "__builtins__"}


def _namespace(path: str):
    obj = sys.modules.get(path)
    if obj is not None:
        return obj
    head, _, tail = path.rpartition(".")
    return getattr(_namespace(head), tail)


def _function_state(func, depth: int = 0) -> tuple:
    """What makes a Python function behave: its code, defaults and closure (one level deep)."""
    state: list = [func, func.__code__, func.__defaults__, tuple(sorted((func.__kwdefaults__ or {}).items()))]
    for cell in func.__closure__ or ():
        try:
            content = cell.cell_contents
        except ValueError:
            content = None
        state.append(_function_state(content, depth + 1) if isinstance(content, types.FunctionType) and depth < 2
                     else content)
    return tuple(state)


def _state(value) -> tuple:
    """A comparable picture of `value`: identity, plus content where the content can change in place."""
    if isinstance(value, types.FunctionType):
        return ("function", _function_state(value))
    if isinstance(value, (staticmethod, classmethod)):
        return ("method", _state(value.__func__))
    if isinstance(value, property):
        return ("property", value, _state(value.fget) if value.fget else None, value.fset, value.fdel)
    if isinstance(value, (dict, list, set)):
        try:
            return ("content", type(value), repr(value))
        except Exception:  # noqa: BLE001 - a repr that fails is compared by identity
            return ("object", value)
    return ("object", value)


def _same(a: tuple, b: tuple) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, tuple) and isinstance(y, tuple):
            if not _same(x, y):
                return False
        elif isinstance(x, str) and isinstance(y, str):
            if x != y:
                return False
        elif x is not y:
            return False
    return True


def _harness_modules() -> dict[str, types.ModuleType]:
    """Every module of the harness package, imported now (so none is added later)."""
    for info in pkgutil.iter_modules(_harness_package.__path__, "autoloop.harness."):
        if info.name != "autoloop.harness.__main__":
            importlib.import_module(info.name)
    return {name: module for name, module in sys.modules.items()
            if isinstance(module, types.ModuleType) and (name == "autoloop.harness" or name.startswith("autoloop.harness."))}


class HarnessSeal:
    """What the evaluation computes with, sealed before the trial's code runs.

    `capture()` records, for every harness module (and the classes it defines) and the
    sealed torch, numpy and Python namespaces, each attribute's identity and, for
    functions, code, defaults and closure (so `f.__code__ = ...` is seen too), and the
    content of mutable module-level containers (EVAL_TOKENS["cpu"] = 1 is seen).
    `changes()` lists what differs now as qualified names: replaced, removed, added (in
    harness modules and classes and in the sealed torch namespaces, not in `torch` itself,
    which loads parts lazily), and modules swapped in sys.modules.
    """

    def __init__(self) -> None:
        self.entries: dict[str, tuple] = {}
        self.names: dict[str, frozenset[str]] = {}  # namespace -> its names, where additions count
        self.modules: dict[str, types.ModuleType] = {}

    @classmethod
    def capture(cls) -> HarnessSeal:
        seal = cls()
        for name, module in sorted(_harness_modules().items()):
            seal.modules[name] = module
            seal._seal_namespace(name, module, track_added=True)
            for attr, value in vars(module).items():
                if isinstance(value, type) and value.__module__ == name:
                    seal._seal_namespace(f"{name}.{attr}", value, track_added=True)
        for path, get, track_added in _SEALED_NAMESPACES:
            seal._seal_namespace(path, get(), track_added=track_added)
        for path, attrs in _SEALED_NAMES.items():
            namespace = _namespace(path)
            for attr in attrs:
                if hasattr(namespace, attr):
                    seal.entries[f"{path}.{attr}"] = _state(getattr(namespace, attr))
        for name in ("torch", "torch.nn.functional", "numpy", "math", "builtins"):
            seal.modules[name] = sys.modules[name]
        return seal

    def _seal_namespace(self, path: str, namespace, *, track_added: bool) -> None:
        attrs = {k: v for k, v in vars(namespace).items() if k not in _VOLATILE}
        for attr, value in attrs.items():
            self.entries[f"{path}.{attr}"] = _state(value)
        if track_added:
            self.names[path] = frozenset(attrs)

    def changes(self) -> list[str]:
        found: list[str] = []
        for name, module in self.modules.items():
            if sys.modules.get(name) is not module:
                found.append(f"sys.modules[{name!r}]")
        for qualified, state in self.entries.items():
            path, _, attr = qualified.rpartition(".")
            try:
                namespace = _namespace(path)
                own = getattr(namespace, "__dict__", None) or {}
                current = own[attr] if attr in own else getattr(namespace, attr)
            except (AttributeError, KeyError):
                found.append(qualified)
                continue
            if not _same(state, _state(current)):
                found.append(qualified)
        for path, names in self.names.items():
            try:
                now = {k for k in vars(_namespace(path)) if k not in _VOLATILE}
            except AttributeError:
                continue
            found.extend(f"{path}.{attr}" for attr in sorted(now - names))
        return found


def describe_replaced(found: list[str], when: str) -> str:
    """"importing train.py replaced the harness's evaluate_bpb: autoloop.harness.evaluate_bpb, ..."."""
    first = found[0]
    listed = ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "")
    if first.startswith("sys.modules"):
        return f"{when} replaced {first}: {listed}"
    owner = "the harness's" if first.startswith("autoloop.harness") else (
        "torch's" if first.startswith("torch") else f"{first.split('.')[0]}'s")
    return f"{when} replaced {owner} {first.rpartition('.')[2]}: {listed}"


# ---------------------------------------------------------------------------------------
# The evaluation
# ---------------------------------------------------------------------------------------


def _causality_batch(ds, device: torch.device, seed: int) -> torch.Tensor:
    tokens = ds.split("val")
    length = seq_len(device.type)
    if len(tokens) < length + 1:
        length = len(tokens) - 1
    rng = np.random.Generator(np.random.PCG64(seed))
    starts = rng.integers(0, len(tokens) - length + 1, size=CAUSALITY_BATCH)
    windows = np.stack([tokens[s : s + length] for s in starts]).astype(np.int64)
    return torch.from_numpy(windows).to(device)


def _process_age() -> float | None:
    """Seconds since this process was created (interpreter start-up and imports), Linux only."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _last_line(exc: BaseException) -> str:
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


def evaluate(train_py: Path, checkpoint: Path, *, data_dir: Path | None, device_name: str,
             splits: tuple[str, ...] = ("val",), causality: bool = False, seed: int = 0,
             reported: float | None = None) -> dict:
    """Run the stages; returns the verdict (never raises for a trial's fault)."""
    seconds: dict[str, float | None] = {"startup": _process_age()}
    verdict: dict = {
        "ok": False, "reason": None, "stage": "seal", "val_bpb": None, "heldout_bpb": None,
        "reported_val_bpb": reported, "val_tolerance": None, "causality": None, "splits": list(splits),
        "device": device_name, "seconds": seconds, "harness_fingerprint": compute_harness_fingerprint(),
        "pycache_prefix": sys.pycache_prefix, "replaced": [],
    }
    if device_name == "cuda" and not torch.cuda.is_available():
        verdict["reason"] = "the trial trained on CUDA but the evaluation process sees no CUDA device"
        return verdict
    started = time.perf_counter()
    seal = HarnessSeal.capture()
    # Bound now, before the trial's code runs: these are the functions that score it (and
    # the check itself, so rebinding HarnessSeal.changes afterwards does not silence it).
    score, causal_check, rebuild, check = evaluate_bpb, check_causality, load_trained_model, HarnessSeal.changes
    ds = load_dataset(data_dir)
    for split in splits:
        ds.split(split)  # mapped now: a missing split is the data's fault, not the trial's
    device = torch.device(device_name)
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    seconds["seal"] = time.perf_counter() - started

    def tampered(when: str) -> bool:
        found = check(seal)
        if found:
            verdict["replaced"] = found
            verdict["reason"] = describe_replaced(found, when)
        return bool(found)

    verdict["stage"] = "import"
    started = time.perf_counter()
    try:
        model = rebuild(train_py, checkpoint, device)
    except HarnessError as exc:
        if not tampered("importing train.py"):
            verdict["reason"] = f"cannot rebuild the model: {exc}"
        return verdict
    except Exception as exc:  # noqa: BLE001 - proposal code (import, build_model, load_state_dict) may raise anything
        if not tampered("importing train.py"):
            verdict["reason"] = f"cannot rebuild the model from train.py and its checkpoint: {_last_line(exc)}"
        return verdict
    seconds["import"] = time.perf_counter() - started
    if tampered("importing train.py"):
        return verdict

    if causality:
        verdict["stage"] = "causality"
        try:
            report = causal_check(model, _causality_batch(ds, device, seed), ds.vocab_size, seed=seed,
                                  autocast_dtype=autocast_dtype)
        except Exception as exc:  # noqa: BLE001 - the model's forward is proposal code
            if not tampered("running the model"):
                verdict["reason"] = f"the causality check could not run the model: {_last_line(exc)}"
            return verdict
        if tampered("running the model"):
            return verdict
        verdict["causality"] = report.as_dict()
        seconds["causality"] = report.seconds
        if not report.ok:
            verdict["reason"] = report.reason
            return verdict

    for split in splits:
        verdict["stage"] = split
        started = time.perf_counter()
        try:
            value = score(model, ds, split, device=device)
        except Exception as exc:  # noqa: BLE001 - the model's forward is proposal code
            if not tampered("running the model"):
                verdict["reason"] = f"evaluating the {split} split failed: {_last_line(exc)}"
            return verdict
        seconds[split] = time.perf_counter() - started
        if tampered("running the model"):
            return verdict
        key = "val_bpb" if split == "val" else "heldout_bpb"
        verdict[key] = value
        if not math.isfinite(value):
            verdict["reason"] = f"{split} bpb is {value}"
            return verdict
        if split == "val" and reported is not None:
            tolerance = VAL_TOLERANCE["cuda" if device.type == "cuda" else "cpu"]
            verdict["val_tolerance"] = tolerance
            if not abs(value - reported) <= tolerance:
                verdict["reason"] = (
                    f"reported val_bpb {reported:.6f} but the harness measures {value:.6f} for its checkpoint "
                    f"(difference {value - reported:+.6f}, tolerance {tolerance:g})"
                )
                return verdict
    identical = suspicious_identity(verdict["val_bpb"], verdict["heldout_bpb"])
    if identical:
        verdict["reason"] = identical
        return verdict
    verdict["ok"], verdict["stage"] = True, "done"
    return verdict


def parse_splits(text: str) -> tuple[str, ...]:
    splits = tuple(part.strip() for part in text.split(",") if part.strip())
    bad = [s for s in splits if s not in SPLIT_CHOICES]
    if not splits or bad or len(set(splits)) != len(splits):
        raise argparse.ArgumentTypeError(f"--splits takes val and/or heldout, comma-separated, not {text!r}")
    return splits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autoloop.harness.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--train-py", type=Path, required=True, help="the trial's train.py (a copy from its commit)")
    parser.add_argument("--checkpoint", type=Path, required=True, help="the trial's checkpoint.pt")
    parser.add_argument("--out", type=Path, required=True, help="where to write the verdict JSON")
    parser.add_argument("--data-dir", type=Path, default=None, help="the prepared dataset; the default one if omitted")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the device the trial trained on")
    parser.add_argument("--splits", type=parse_splits, default=("val",), help="splits to evaluate: val or val,heldout")
    parser.add_argument("--causality", action="store_true", help="run the causality check before evaluating")
    parser.add_argument("--seed", type=int, default=0, help="seed of the causality check's random batch")
    parser.add_argument("--reported", type=float, default=None,
                        help="the val_bpb the trial reported: the evaluation must match it within the tolerance")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        verdict = evaluate(args.train_py, args.checkpoint, data_dir=args.data_dir, device_name=args.device,
                           splits=args.splits, causality=args.causality, seed=args.seed, reported=args.reported)
    except HarnessError as exc:  # the data, not the trial: say so and let the controller report it
        print(f"ERROR: {exc}", flush=True)
        return 2
    verdict["seconds"]["total"] = time.perf_counter() - started
    write_json_atomic(args.out, verdict)
    figures = ", ".join(f"{k} {verdict[k]:.6f}" for k in ("val_bpb", "heldout_bpb") if verdict[k] is not None)
    print(f"evaluation {'passed' if verdict['ok'] else 'failed'} at stage {verdict['stage']}: "
          f"{verdict['reason'] or 'ok'}" + (f" ({figures})" if figures else ""), flush=True)
    return 0


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy's: the seal covers
    # autoloop.harness.evaluate, and the trial's code can reach sys.modules["__main__"].
    from autoloop.harness.evaluate import main as _sealed_main

    _code = _sealed_main()
    # The verdict is written (atomically) and stdout flushed: skip the interpreter's and
    # torch's teardown (~0.5 s of every trial's evaluation).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_code)
