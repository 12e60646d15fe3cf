"""`autoloop check`: what an experienced person does before trusting a long run.

Four parts, each a dict with `status` ("ok" | "warn" | "fail" | "skipped" |
"unsupported"), a one-line `message` and its figures:

* overfit: train a fresh model on one fixed small batch until the loss is near zero.
  The loss is measured by the check itself, from the model's logits against the batch's
  true next tokens (the same contract the harness evaluates), so a script that trains on
  misaligned targets or a detached loss fails even when its own reported loss falls.
  A model that cannot memorise 512 tokens has a bug, not too little data.
* lr: the learning-rate range test. All parameter groups are scaled together by a
  multiplier swept exponentially over up to a few hundred steps at the training batch,
  through the model as train.py trains it (compiled and warmed up where train.py
  compiles: `prepare_training`); the smoothed loss detects the divergence (the point is
  where the raw loss crossed), and the suggested multiplier sits a factor SUGGEST_BELOW
  below it. Bounded in wall time: the first steps time a step, and the sweep is planned
  to fit LR_SECONDS (never fewer than LR_MIN_STEPS steps; a deadline stops a slower one).
  A PNG plot is written beside the JSON.
* budget: tokens/s, what the budget buys (steps, tokens, tokens per parameter against
  the compute-optimal ~20 with FLOPs ~ 6 N D), MFU and memory headroom on a GPU, and how
  many training runs fit in --hours; warnings where the plan is clearly off. The
  throughput is train.py's own where the device part ran it, else the range test's,
  which is compiled where training is (`throughput_source` says which).
* device: which SDPA kernel the model's attention runs, the usable kernels timed side
  by side at the model's shapes, whether torch.compile works here (probed in a child
  process: a missing compiler or Triton is one line, and train.py then trains eager),
  DEVICE_BATCH_SIZE by measurement (tokens/s and peak memory of a few candidates at the
  same tokens per step, within BATCH_SWEEP_SECONDS; the fastest that fits is suggested),
  and on CUDA a short real run of train.py for tokens/s, MFU and peak memory.

overfit, lr and the kernel timings need train.py's importable functions (`model_config`,
`build_model`, `build_optimizers`, `make_train_step`); a script without them (a
third-party train.py) gets "not supported by this script" for those, found by reading
its source, never by importing it (such a script may train at import).

Everything runs in this process except the compile probe and the short run. The
result is written to `.autoloop/check/check.json` (and the plot beside it) after every
part and every few range-test steps (`complete` false until the end), so a check cut
short still leaves what it measured; when the repository has a run, the whole result is
stored in `runs.check_result`.
"""

from __future__ import annotations

import ast
import gc
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from autoloop import pyast
from autoloop.errors import AutoloopError

REQUIRED = ("model_config", "build_model", "build_optimizers", "make_train_step")
OVERFIT_MESSAGE = (
    "the model cannot overfit a single batch: the code has a bug (a detached gradient, "
    "a wrong loss reduction, targets misaligned), not the data"
)
OVERFIT_BATCH = (4, 128)  # sequences x tokens: 512 targets, memorised in a few dozen steps
OVERFIT_STEPS = 200  # step limit
OVERFIT_TARGET = 0.1  # nats per token: "near zero" (real text sits at ~1.5-2 without memorising)
LR_STEPS = {"cuda": 300, "cpu": 100}  # most range-test steps (a CPU step at the real batch is ~0.15 s idle)
# Wall-time bound of the sweep (after compile): at the CUDA default scale a compiled step is
# ~0.35 s on an H100, so ~170 steps fit; an uncompiled 300-step sweep took 2-3 minutes.
LR_SECONDS = {"cuda": 60.0, "cpu": 45.0}
LR_MIN_STEPS = 30  # fewer points cannot place a divergence in three decades (the deadline still applies)
LR_PROBE_STEPS = 3  # steps at the start of the sweep that time a step before the rest is planned
LR_RANGE = (3e-2, 3e1)  # multipliers of train.py's learning rates swept (three decades around x1)
LR_SMOOTHING = 0.9  # EMA factor of the smoothed loss (bias-corrected)
DIVERGE_FACTOR = 1.5  # diverged: smoothed loss above this times its minimum, or above the start
# Suggested peak multiplier = divergence multiplier / this. Twenty, not the classic ten:
# the sweep lasts ~100 steps and a trial ~10x more (longer runs want lower LRs), and too
# high costs a diverged night while too low costs a little. Measured on the CPU scale
# (300-step runs, 2 seeds): x1.39 (/10) was +0.012 val_bpb vs the default, x0.7 (/20)
# -0.015, both within the seed noise; x2.61 (the lagging-EMA point / 10) was +0.096.
SUGGEST_BELOW = 20.0
COMPUTE_OPTIMAL_TOKENS_PER_PARAM = 20.0  # Hoffmann et al. 2022
SHORT_RUN_SECONDS = {"cuda": 20.0, "cpu": 8.0}
# DEVICE_BATCH_SIZE by measurement: candidates around the current one, each compiled (on
# CUDA) and timed for a few optimizer steps at the same tokens per step, within this bound.
BATCH_SWEEP_SECONDS = {"cuda": 150.0, "cpu": 20.0}
BATCH_SWEEP_STEPS = {"cuda": 3, "cpu": 2}  # timed optimizer steps per candidate, after one untimed
BATCH_MEMORY_HEADROOM = 0.10  # a suggested batch leaves this share of the GPU's memory free
BATCH_MIN_GAIN_PERCENT = 3.0  # a faster batch size is suggested only above this gain (below: timing noise)
PARTS = ("overfit", "lr", "budget", "device")


# ---------------------------------------------------------------------------- the script


def missing_interface(train_py: Path) -> list[str]:
    """The required function names train.py does not define at top level (read, not imported)."""
    try:
        tree = pyast.parse(Path(train_py).read_text())
    except (OSError, SyntaxError, ValueError) as exc:
        raise AutoloopError(f"cannot read {train_py} ({exc}): fix the script") from None
    defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    defined |= {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)}
    return [name for name in REQUIRED if name not in defined]


def unsupported(missing: list[str]) -> dict:
    return {"status": "unsupported",
            "message": f"not supported by this script: train.py does not define {', '.join(missing)}"}


def _seq_len(device) -> int:
    from autoloop import harness as H

    return H.seq_len(device.type)


def fresh_model(module, ds, device, seed: int):
    """A new model and optimizers from train.py, seeded."""
    import torch

    torch.manual_seed(seed)
    config = module.model_config(vocab_size=ds.vocab_size, seq_len=_seq_len(device))
    model = module.build_model(config, device=device)
    return model, module.build_optimizers(model)


def _key(device) -> str:
    return "cuda" if device.type == "cuda" else "cpu"


def training_setup(module, ds, device, *, seed: int, batch_size: int) -> tuple:
    """(model, optimizers, train_model, info) as train.py trains: through its
    `prepare_training` when it has one (compiled and warmed up where train.py compiles,
    the attention kernel it would pin), else eager from build_model/build_optimizers.
    info: compiled, compile_error, kernel, warmup_seconds."""

    if not hasattr(module, "prepare_training"):
        model, optimizers = fresh_model(module, ds, device, seed)
        return model, optimizers, model, {"compiled": False, "compile_error": None, "kernel": None, "warmup_seconds": 0.0}
    config = module.model_config(vocab_size=ds.vocab_size, seq_len=_seq_len(device))
    kernel = choose_kernel(module, config, batch_size, device)
    t = module.prepare_training(config, device, seed=seed, batch_size=batch_size, kernel=kernel, log=lambda line: None)
    info = {"compiled": bool(t["compiled"]), "compile_error": t.get("compile_error"), "kernel": kernel or "sdpa default",
            "kernel_ran": t.get("kernel_ran"), "warmup_seconds": round(float(t.get("warmup_seconds") or 0.0), 2)}
    return t["model"], t["optimizers"], t["train_model"], info


def _dtype(module):
    import torch

    return getattr(module, "EMBEDDING_DTYPE", None) or getattr(module, "AUTOCAST_DTYPE", None) or torch.float32


def choose_kernel(module, config, batch_size: int, device):
    """The SDPA kernel train.py would pin: its ATTENTION_BACKEND (and ATTENTION_AUTO_MARGIN)
    through the harness's choice, as train.py's main() asks; None for a script that names none."""
    from autoloop import harness as H

    if not hasattr(module, "ATTENTION_BACKEND"):
        return None
    return H.choose_attention_kernel(config, batch_size, device, _dtype(module), module.ATTENTION_BACKEND,
                                     getattr(module, "ATTENTION_AUTO_MARGIN", 0.05))


def set_lr(optimizers, multiplier: float) -> None:
    """Every group's LR = its peak ("initial_lr") x multiplier: all groups scaled together."""
    for opt in optimizers:
        for group in opt.param_groups:
            group.setdefault("initial_lr", group["lr"])
            group["lr"] = group["initial_lr"] * multiplier


def group_lrs(optimizers) -> dict[str, float]:
    """{group name: peak LR}; unnamed groups are "<Optimizer>[i]"."""
    out = {}
    for opt in optimizers:
        for i, group in enumerate(opt.param_groups):
            name = group.get("name") or f"{type(opt).__name__}[{i}]"
            out[name] = group.get("initial_lr", group["lr"])
    return out


def lr_constants(module) -> dict[str, float]:
    """train.py's UPPER_CASE learning-rate constants (names ending in _LR) and their values."""
    return {name: float(value) for name, value in vars(module).items()
            if name.isupper() and name.endswith("_LR") and isinstance(value, (int, float)) and not isinstance(value, bool)}


def _batch_shape(module, seq_len: int) -> tuple[int, int]:
    """(micro-batch sequences, gradient-accumulation steps) of a training step."""
    batch = int(getattr(module, "DEVICE_BATCH_SIZE", 8))
    total = int(getattr(module, "TOTAL_BATCH_TOKENS", batch * seq_len))
    return batch, max(1, total // (batch * seq_len))


def _autocast(module, device):
    import torch

    dtype = getattr(module, "AUTOCAST_DTYPE", None)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


# ---------------------------------------------------------------------------- (a) overfit


def overfit_one_batch(module, ds, device, *, steps: int = OVERFIT_STEPS, target: float = OVERFIT_TARGET,
                      batch: tuple[int, int] = OVERFIT_BATCH, seed: int = 0) -> dict:
    """Train on one fixed batch of real training text until the check's own loss < target."""
    import torch
    import torch.nn.functional as F

    from autoloop import harness as H

    rows, cols = batch[0], min(batch[1], _seq_len(device))
    x, y = next(H.TokenLoader(ds, "train", rows, cols, device, seed=seed))
    start = time.perf_counter()
    losses: list[float] = []

    def true_loss(model) -> float:
        # The model's logits against the true next tokens: what the harness scores.
        with torch.no_grad(), _autocast(module, device):
            logits = model(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1)).item()

    try:
        model, optimizers = fresh_model(module, ds, device, seed)
        first = true_loss(model)
        train_step = module.make_train_step(model, optimizers, itertools.repeat((x, y)))
        schedule = getattr(module, "lr_multiplier", None)
        for step in range(steps):
            set_lr(optimizers, schedule(step / steps) if callable(schedule) else 1.0)
            train_step()
            if (step + 1) % 10 == 0 or step == steps - 1:
                losses.append(true_loss(model))
                if losses[-1] < target or not math.isfinite(losses[-1]):
                    break
    except Exception as exc:  # the bug may be one that raises (a loss without a gradient)
        return {"status": "fail", "message": f"{OVERFIT_MESSAGE} (the training step raised {_first_line(exc)})",
                "error": _first_line(exc), "seconds": round(time.perf_counter() - start, 2)}
    figures = {"batch": [rows, cols], "initial_loss": round(first, 4), "final_loss": round(losses[-1], 4),
               "steps": min(step + 1, steps), "target": target, "losses_every_10": [round(v, 4) for v in losses],
               "seconds": round(time.perf_counter() - start, 2)}
    if math.isfinite(losses[-1]) and losses[-1] < target:
        return {"status": "ok", "message": f"overfits one batch: loss {first:.3f} -> {losses[-1]:.4f} in "
                                           f"{figures['steps']} steps", **figures}
    return {"status": "fail", "message": f"{OVERFIT_MESSAGE} (loss {first:.3f} -> {losses[-1]:.3f} after "
                                         f"{figures['steps']} steps; near zero is < {target})", **figures}


# ---------------------------------------------------------------------------- (b) LR range test


def lr_range_test(module, ds, device, *, steps: int | None = None, low: float = LR_RANGE[0], high: float = LR_RANGE[1],
                  beta: float = LR_SMOOTHING, seed: int = 0, out_dir: Path | None = None, max_seconds: float | None = None,
                  on_progress: Callable[[dict], None] | None = None,
                  clock: Callable[[], float] = time.perf_counter) -> dict:
    """Sweep every group's LR together from low x to high x its peak; find where it diverges.

    `steps` fixes the number of steps; by default it is planned from the first steps'
    time to fit `max_seconds` (LR_SECONDS), between LR_MIN_STEPS and LR_STEPS. Past
    `max_seconds` the sweep stops where it is (`truncated`). `on_progress(partial)` gets
    the points so far every 10 steps. `clock` (seconds) times the steps and the limit.
    """
    from autoloop import harness as H

    key = _key(device)
    cap = steps or LR_STEPS[key]
    max_seconds = LR_SECONDS[key] if max_seconds is None else max_seconds
    seq_len = _seq_len(device)
    batch, grad_accum = _batch_shape(module, seq_len)
    start = clock()
    model, optimizers, train_model, setup = training_setup(module, ds, device, seed=seed, batch_size=batch)
    current = group_lrs(optimizers)
    loader = H.TokenLoader(ds, "train", batch, seq_len, device, seed=seed)
    train_step = module.make_train_step(model, optimizers, loader, grad_accum=grad_accum, train_model=train_model)
    points, avg, best, diverged_at, step_seconds = [], 0.0, math.inf, None, []
    planned, truncated = cap, False
    sweep_start = clock()
    i = 0
    while i < planned:
        multiplier = low * (high / low) ** (i / max(1, planned - 1))
        set_lr(optimizers, multiplier)
        t0 = clock()
        loss, grad_norm = train_step()
        if device.type == "cuda":
            import torch

            torch.cuda.synchronize()
        if i >= 1:  # the first step pays for allocation (and, uncompiled, kernel selection)
            step_seconds.append(clock() - t0)
        if not math.isfinite(loss):
            diverged_at = multiplier  # a NaN is its own point: no smoothing lag
            points.append({"multiplier": multiplier, "loss": None, "smoothed": None, "grad_norm": None})
            break
        avg = beta * avg + (1 - beta) * loss
        smoothed = avg / (1 - beta ** (i + 1))
        best = min(best, smoothed)
        points.append({"multiplier": multiplier, "loss": round(loss, 5), "smoothed": round(smoothed, 5),
                       "grad_norm": round(grad_norm, 5)})
        if i > 5 and (smoothed > DIVERGE_FACTOR * best or smoothed > points[0]["loss"]):
            # The EMA trails the raw loss (by up to beta / (1 - beta) steps on a slow
            # rise): the divergence is where, in that window, the raw loss itself first
            # crossed the line.
            line = DIVERGE_FACTOR * best if smoothed > DIVERGE_FACTOR * best else points[0]["loss"]
            window = range(max(0, i - round(beta / (1 - beta))), i + 1)
            first = next((j for j in window if points[j]["loss"] > line), i)
            diverged_at = points[first]["multiplier"]
            break
        i += 1
        elapsed = clock() - sweep_start
        if steps is None and i == LR_PROBE_STEPS and step_seconds:
            per_step = sorted(step_seconds)[len(step_seconds) // 2]
            planned = max(LR_MIN_STEPS, min(cap, i + int(max(0.0, max_seconds - elapsed) / per_step)))
        if i < planned and elapsed > max_seconds:
            truncated = True
            break
        if on_progress is not None and i % 10 == 0:
            on_progress({"status": "running", "message": f"{i} of {planned} steps", "steps": i, "points": list(points)})
    tokens_per_step = batch * seq_len * grad_accum
    seconds_per_step = sorted(step_seconds)[len(step_seconds) // 2] if step_seconds else None
    if diverged_at is None:
        # Only a bound: the divergence lies somewhere above `top`, so the peak may be raised
        # to at least top / SUGGEST_BELOW. Below x1 that bound says nothing against the
        # current LRs (a sweep a busy machine cut short at x4.5 once "suggested" x0.22,
        # and the night spent a trial on it): no suggestion then.
        top = points[-1]["multiplier"] if truncated else high
        bound = top / SUGGEST_BELOW
        suggested = bound if bound >= 1.0 else None
        message = f"no divergence up to x{top:.3g} the current LRs: " + (
            f"suggested peak x{suggested:.3g} or more" if suggested else "nothing against the current LRs")
    else:
        suggested = diverged_at / SUGGEST_BELOW
        message = f"diverges at x{diverged_at:.3g} the current LRs: suggested peak x{suggested:.3g}"
    if truncated:
        message += f" (stopped at the {max_seconds:g} s limit after {len(points)} of {planned} steps)"
    if setup["compile_error"]:
        message += f" (torch.compile failed, so eager: {setup['compile_error'][:120]})"
    result = {
        "status": "ok", "message": message, "diverged_multiplier": diverged_at, "suggested_multiplier": suggested,
        "current_lrs": current, "suggested_lrs": {k: v * suggested for k, v in current.items()} if suggested else {},
        "suggested_constants": {k: v * suggested for k, v in lr_constants(module).items()} if suggested else {},
        "steps": len(points), "planned_steps": planned, "max_seconds": max_seconds, "truncated": truncated,
        "range": [low, high], "smoothing": beta, "points": points,
        "tokens_per_step": tokens_per_step, "seconds_per_step": seconds_per_step,
        "tokens_per_second": tokens_per_step / seconds_per_step if seconds_per_step else None,
        "compiled": setup["compiled"], "compile_error": setup["compile_error"], "attention_kernel": setup["kernel"],
        "attention_kernel_ran": setup.get("kernel_ran"),
        "warmup_seconds": setup["warmup_seconds"], "sweep_seconds": round(clock() - sweep_start, 2),
        "seconds": round(clock() - start, 2),
    }
    if suggested is not None and (suggested < 0.3 or suggested > 3):
        result["status"] = "warn"
        result["message"] += ": far from the current LRs, worth a look"
    if out_dir is not None:
        result["plot"] = plot_lr_range(result, Path(out_dir) / "lr_range.png")
    return result


def plot_lr_range(result: dict, path: Path) -> str | None:
    """The range test's loss against the multiplier, as a PNG; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    pts = [p for p in result["points"] if p["loss"] is not None]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot([p["multiplier"] for p in pts], [p["loss"] for p in pts], color="0.75", lw=1, label="loss")
    ax.plot([p["multiplier"] for p in pts], [p["smoothed"] for p in pts], color="C0", lw=2, label="smoothed loss")
    ax.axvline(1.0, color="0.3", ls=":", label="current LRs (x1)")
    if result["diverged_multiplier"]:
        ax.axvline(result["diverged_multiplier"], color="C3", ls="--", label=f"divergence x{result['diverged_multiplier']:.3g}")
    if result["suggested_multiplier"]:
        ax.axvline(result["suggested_multiplier"], color="C2", ls="-", label=f"suggested x{result['suggested_multiplier']:.3g}")
    ax.set_xscale("log")
    ax.set_xlabel("learning-rate multiplier (all parameter groups together)")
    ax.set_ylabel("training loss (nats/token)")
    losses = [p["smoothed"] for p in pts]
    if losses:
        ax.set_ylim(min(losses) * 0.9, max(p["loss"] for p in pts[:3]) * 1.05)
    lrs = ", ".join(f"{k} {v:.3g}" for k, v in result["current_lrs"].items())
    ax.set_title(f"LR range test ({result['steps']} steps)\nx1 = {lrs}", fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return str(path)


# ---------------------------------------------------------------------------- (c) budget plan


def budget_plan(*, tokens_per_second: float | None, tokens_per_step: int | None, matmul_params: int | None,
                time_budget: float | None, max_steps: int | None = None, hours: float | None = None,
                overhead_seconds: float = 0.0, warmup_steps: int = 0, mfu_percent: float | None = None,
                peak_memory_mb: float | None = None, memory_total_mb: float | None = None) -> dict:
    """What the budget buys, against compute-optimal training; pure arithmetic on measured figures."""
    if not tokens_per_second or not tokens_per_step:
        return {"status": "skipped", "message": "no throughput measured: no budget plan"}
    if max_steps:
        steps = max_steps
        seconds = max_steps * tokens_per_step / tokens_per_second
    else:
        seconds = time_budget
        steps = int(tokens_per_second * time_budget / tokens_per_step)
    tokens = steps * tokens_per_step
    plan = {"tokens_per_second": round(tokens_per_second, 1), "tokens_per_step": tokens_per_step,
            "training_seconds": round(seconds, 1), "steps": steps, "tokens": tokens,
            "mfu_percent": mfu_percent, "peak_memory_mb": peak_memory_mb, "memory_total_mb": memory_total_mb}
    warnings = []
    if matmul_params:
        per_param = tokens / matmul_params
        flops = 6 * matmul_params * tokens
        # Compute-optimal at this compute: C = 6 N D with D = 20 N.
        n_opt = math.sqrt(flops / (6 * COMPUTE_OPTIMAL_TOKENS_PER_PARAM))
        plan.update(params=matmul_params, tokens_per_param=round(per_param, 2), flops=flops,
                    compute_optimal_params=int(n_opt), compute_optimal_tokens=int(n_opt * COMPUTE_OPTIMAL_TOKENS_PER_PARAM))
        if per_param < 1:
            warnings.append(f"{per_param:.2g} tokens per parameter (compute-optimal ~20): the model is far too big "
                            "for the budget; shrink it or raise the budget")
    if steps < max(warmup_steps, 20):
        warnings.append(f"the budget buys {steps} steps, too few to get past warm-up ({warmup_steps} steps): raise it")
    if peak_memory_mb and memory_total_mb:
        plan["memory_headroom_percent"] = round(100 * (1 - peak_memory_mb / memory_total_mb), 1)
        if peak_memory_mb > 0.95 * memory_total_mb:
            warnings.append(f"peak memory {peak_memory_mb:,.0f} MB of {memory_total_mb:,.0f} MB: an edit that adds "
                            "memory will run out; lower DEVICE_BATCH_SIZE")
    per_run = seconds + overhead_seconds
    plan["seconds_per_run"] = round(per_run, 1)
    if hours:
        plan["hours"] = hours
        plan["runs_in_hours"] = int(hours * 3600 // per_run) if per_run > 0 else None
    parts = [f"{tokens_per_second:,.0f} tokens/s", f"{steps:,} steps and {tokens / 1e6:.3g}M tokens per run"]
    if matmul_params:
        parts.append(f"{plan['tokens_per_param']:g} tokens/parameter (compute-optimal ~20)")
    if mfu_percent is not None:
        parts.append(f"MFU {mfu_percent:.1f}%")
    if hours:
        parts.append(f"~{plan['runs_in_hours']} training runs in {hours:g} h ({per_run:.0f} s each)")
    plan["warnings"] = warnings
    plan["status"] = "warn" if warnings else "ok"
    plan["message"] = "; ".join(parts) + ("" if not warnings else " | WARNING: " + "; ".join(warnings))
    return plan


# ---------------------------------------------------------------------------- (d) device


def sdpa_kernel_in_use(module, ds, device, seed: int = 0) -> str:
    """Which SDPA kernel the model's attention runs: the aten ops one forward dispatches."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from autoloop import harness as H

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(str(func))
            return func(*args, **(kwargs or {}))

    model, _ = fresh_model(module, ds, device, seed)
    batch, _ = _batch_shape(module, _seq_len(device))
    x, _ = next(H.TokenLoader(ds, "train", min(batch, 2), _seq_len(device), device, seed=seed))
    kernel = choose_kernel(module, model.config, batch, device)
    if hasattr(model, "set_attention_kernel"):
        model.set_attention_kernel(kernel)  # pinned inside the model's forward, as train.py trains
        context = H.attention_kernel(None)
    else:
        context = H.attention_kernel(kernel)
    recorder = Recorder()
    with torch.no_grad(), _autocast(module, device), context, recorder:
        model(x)
    # Eager: no op named for attention at all means the model never called SDPA.
    return H.kernel_from_op_names(recorder.names, none_found="none found (no scaled_dot_product_attention call)")


COMPILE_PROBE = """
import sys, torch
device = sys.argv[1]
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)).to(device)
compiled = torch.compile(model)
x = torch.randn(8, 64, device=device)
compiled(x).sum().backward()
print("compile ok")
"""


def compile_probe(device_type: str = "cpu", *, env: dict | None = None, timeout: float = 300) -> dict:
    """Whether torch.compile works here: compile a small model forward and backward in a child process."""
    start = time.perf_counter()
    environment = {**os.environ, **(env or {})}
    try:
        proc = subprocess.run([sys.executable, "-c", COMPILE_PROBE, device_type], capture_output=True, text=True,
                              timeout=timeout, env=environment)
    except subprocess.TimeoutExpired:
        return {"status": "fail", "works": False, "seconds": timeout,
                "message": f"torch.compile did not finish a small model in {timeout:.0f} s here: train.py should train eager"}
    seconds = round(time.perf_counter() - start, 1)
    if proc.returncode == 0 and "compile ok" in proc.stdout:
        return {"status": "ok", "works": True, "seconds": seconds, "message": f"torch.compile works ({seconds:.0f} s for a small model)"}
    error = _compile_error_line(proc.stderr + proc.stdout)
    return {"status": "fail", "works": False, "seconds": seconds, "error": error,
            "message": f"torch.compile does not work here ({error}): train.py falls back to eager; "
                       "install a C compiler / Triton or set COMPILE = False"}


def _compile_error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for key in ("InvalidCxxCompiler", "TritonMissing", "CppCompileError", "BackendCompilerFailed", "InductorError", "Error"):
        hits = [line for line in lines if key in line]
        if hits:
            return hits[-1][:300]
    return (lines[-1] if lines else "no output")[:300]


def short_run(repo: Path, python: str, seconds: float, *, env: dict | None = None, timeout: float = 600) -> dict:
    """train.py as the loop runs it, for `seconds` of timed training: its result JSON's figures."""
    from autoloop import harness as H

    with tempfile.TemporaryDirectory(prefix="autoloop-check-") as tmp:
        result_path = Path(tmp) / "result.json"
        environment = {**os.environ, **(env or {}), "AUTOLOOP_TIME_BUDGET": str(seconds), "AUTOLOOP_RESULT": str(result_path)}
        environment.pop("AUTOLOOP_MAX_STEPS", None)
        start = time.perf_counter()
        try:
            proc = subprocess.run([python, "train.py"], cwd=repo, capture_output=True, text=True, timeout=timeout, env=environment)
        except subprocess.TimeoutExpired:
            return {"status": "fail", "message": f"a {seconds:g} s run of train.py did not finish in {timeout:.0f} s"}
        wall = time.perf_counter() - start
        if result_path.exists():
            result = json.loads(result_path.read_text())
        else:
            result = H.parse_summary(proc.stdout) or {}
        if proc.returncode != 0 or not result:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
            return {"status": "fail", "message": f"a {seconds:g} s run of train.py failed (exit {proc.returncode}): {tail[0][:200]}"}
    keys = ("tokens_per_second", "mfu_percent", "mfu_percent_palm", "hfu_percent", "model_tflops", "executed_tflops",
            "peak_memory_mb", "compile_seconds", "warmup_seconds", "training_seconds", "eval_seconds", "total_seconds",
            "num_params", "batch_tokens", "attention_kernel", "attention_kernel_ran", "compiled", "compile_error",
            "graphs_compiled_in_training", "device", "val_bpb", "flops_per_token", "flops_per_token_palm",
            "executed_flops_per_token")
    figures = {k: result.get(k) for k in keys if k in result}
    figures["wall_seconds"] = round(wall, 1)
    if "tokens_per_second" not in figures and result.get("total_tokens_M") and result.get("training_seconds"):
        figures["tokens_per_second"] = result["total_tokens_M"] * 1e6 / result["training_seconds"]
    if "peak_memory_mb" not in figures and result.get("peak_vram_mb"):
        figures["peak_memory_mb"] = result["peak_vram_mb"]
    tps = figures.get("tokens_per_second")
    mfu = figures.get("mfu_percent")
    message = f"{seconds:g} s run: " + (f"{tps:,.0f} tokens/s" if tps else "tokens/s unknown")
    if mfu is not None:
        message += f", MFU {mfu:.1f}%"
        if figures.get("mfu_percent_palm") is not None:
            message += f" ({figures['mfu_percent_palm']:.1f}% as nanochat counts)"
    if figures.get("peak_memory_mb"):
        message += f", peak memory {figures['peak_memory_mb']:,.0f} MB"
    status = "ok"
    asked, ran = figures.get("attention_kernel"), figures.get("attention_kernel_ran")
    if ran:
        message += f", attention ran {ran}"
        if asked in ("flash", "cudnn", "efficient", "math") and asked != ran:
            message += f" (WARNING: {asked} was asked for)"
            status = "warn"
    if figures.get("compiled") is False and figures.get("device", "cpu") != "cpu":
        message += " (torch.compile failed: it ran eager)"
    if figures.get("graphs_compiled_in_training"):
        # After the warm-up nothing should compile: a recompile costs its compile time inside the budget.
        message += f" (WARNING: {figures['graphs_compiled_in_training']} graphs compiled during training: recompiles)"
        status = "warn"
    return {"status": status, "message": message, **figures}


def batch_size_candidates(module, seq_len: int) -> list[int]:
    """DEVICE_BATCH_SIZE, twice and half it, that divide TOTAL_BATCH_TOKENS into whole micro-steps."""
    batch, _ = _batch_shape(module, seq_len)
    total = int(getattr(module, "TOTAL_BATCH_TOKENS", batch * seq_len))
    out = []
    for b in (batch, 2 * batch, batch // 2):
        if b >= 1 and total % (b * seq_len) == 0 and b not in out:
            out.append(b)
    return out


def device_batch_sweep(module, ds, device, *, candidates: list[int] | None = None, max_seconds: float | None = None,
                       steps: int | None = None, seed: int = 0, on_progress: Callable[[dict], None] | None = None,
                       clock: Callable[[], float] = time.perf_counter) -> dict:
    """Tokens/s and peak memory of a few DEVICE_BATCH_SIZE values at the same tokens per step.

    Each candidate is set up as train.py trains (compiled on CUDA: one compile per batch
    shape), one untimed optimizer step, then `steps` timed ones. A candidate that runs
    out of memory ends the larger ones. Past `max_seconds` the remaining candidates are
    skipped. The suggestion: the fastest that leaves BATCH_MEMORY_HEADROOM of the GPU free.
    `on_progress({"candidates": rows so far})` after each candidate. `clock` (seconds)
    times the steps and the limit.
    """
    import torch

    from autoloop import harness as H

    key = _key(device)
    max_seconds = BATCH_SWEEP_SECONDS[key] if max_seconds is None else max_seconds
    steps = steps or BATCH_SWEEP_STEPS[key]
    seq_len = _seq_len(device)
    current, _ = _batch_shape(module, seq_len)
    total = int(getattr(module, "TOTAL_BATCH_TOKENS", current * seq_len))
    candidates = candidates or batch_size_candidates(module, seq_len)
    memory_total = torch.cuda.get_device_properties(device).total_memory / 2**20 if device.type == "cuda" else None
    start = clock()
    rows, too_big = [], None
    for b in sorted(candidates, key=lambda b: b != current):  # the current one first, the rest as given
        if too_big is not None and b >= too_big:
            rows.append({"device_batch_size": b, "skipped": f"larger than {too_big}, which ran out of memory"})
            continue
        if clock() - start > max_seconds:
            rows.append({"device_batch_size": b, "skipped": f"the {max_seconds:g} s limit was reached"})
            continue
        t0 = clock()
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            model, optimizers, train_model, setup = training_setup(module, ds, device, seed=seed, batch_size=b)
            loader = H.TokenLoader(ds, "train", b, seq_len, device, seed=seed)
            step = module.make_train_step(model, optimizers, loader, grad_accum=total // (b * seq_len), train_model=train_model)
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t1 = clock()
            for _ in range(steps):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = (clock() - t1) / steps
            row = {"device_batch_size": b, "tokens_per_second": round(total / seconds, 1), "seconds_per_step": round(seconds, 4),
                   "compiled": setup["compiled"], "setup_seconds": round(t1 - t0, 1)}
            if device.type == "cuda":
                row["peak_memory_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
            rows.append(row)
        except Exception as exc:  # out of memory above all; any other failure is reported, not fatal
            oom = "out of memory" in str(exc).lower() or type(exc).__name__ == "OutOfMemoryError"
            if oom:
                too_big = b if too_big is None else min(too_big, b)
            rows.append({"device_batch_size": b, "error": "out of memory" if oom else _first_line(exc)})
        finally:
            model = optimizers = train_model = step = loader = None
            gc.collect()  # the compiled module's cycles hold the last candidate's memory
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if on_progress is not None:
            on_progress({"status": "running", "current": current, "candidates": list(rows)})
    fits = [r for r in rows if "tokens_per_second" in r
            and (memory_total is None or r.get("peak_memory_mb", 0) <= (1 - BATCH_MEMORY_HEADROOM) * memory_total)]
    out = {"current": current, "candidates": rows, "seconds": round(clock() - start, 1)}
    if not fits:
        out.update(status="warn", message="no DEVICE_BATCH_SIZE candidate could be timed")
        return out
    best = max(fits, key=lambda r: r["tokens_per_second"])
    base = next((r for r in rows if r["device_batch_size"] == current and "tokens_per_second" in r), None)
    gain = 100 * (best["tokens_per_second"] / base["tokens_per_second"] - 1) if base else None
    keep = best["device_batch_size"] == current or (gain is not None and gain < BATCH_MIN_GAIN_PERCENT)
    suggested = current if keep else best["device_batch_size"]
    out.update(status="ok", suggested=suggested, gain_percent=None if gain is None else round(gain, 1),
               suggested_constants={"DEVICE_BATCH_SIZE": suggested})
    timed = ", ".join(f"{r['device_batch_size']}: {r['tokens_per_second']:,.0f} tok/s"
                      + (f" {r['peak_memory_mb']:,.0f} MB" if "peak_memory_mb" in r else "")
                      for r in rows if "tokens_per_second" in r)
    if keep:
        out["message"] = f"DEVICE_BATCH_SIZE {current} is the one to keep ({timed})"
    elif gain is None:  # the current one could not be timed (out of memory, above all)
        out["message"] = f"DEVICE_BATCH_SIZE {suggested} is the fastest that ran ({timed})"
    else:
        out["message"] = f"DEVICE_BATCH_SIZE {best['device_batch_size']} is {gain:.0f}% faster than {current} ({timed})"
    return out


def device_health(module, ds, device, *, repo: Path, python: str, run_seconds: float | None = None,
                  batch_sweep: bool = True) -> dict:
    """The attention kernel in use and the kernels timed side by side; compile; a short real run on CUDA."""
    import torch

    out: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    lines = []
    if module is not None:
        out["sdpa_kernel_in_use"] = sdpa_kernel_in_use(module, ds, device)
        lines.append(f"attention runs the {out['sdpa_kernel_in_use']} kernel")
        if hasattr(module, "ATTENTION_BACKEND"):  # a script that pins kernels as train.py does
            from autoloop import harness as H

            config = module.model_config(vocab_size=ds.vocab_size, seq_len=_seq_len(device))
            batch, _ = _batch_shape(module, _seq_len(device))
            times = H.time_attention_kernels(config, batch, device, _dtype(module))
            out["kernel_ms"] = {k: (round(1000 * v, 3) if isinstance(v, float) else v) for k, v in times.items()}
            usable = {k: v for k, v in times.items() if isinstance(v, float)}
            if usable:
                fastest = min(usable, key=usable.get)
                out["fastest_kernel"] = fastest
                lines.append("fwd+bwd " + ", ".join(f"{k} {1000 * v:.2f} ms" for k, v in sorted(usable.items(), key=lambda kv: kv[1]))
                             + f": fastest {fastest}")
                if device.type == "cuda" and out["sdpa_kernel_in_use"] == "math":
                    lines.append("WARNING: the math kernel runs on CUDA: set ATTENTION_BACKEND to a fused kernel")
        if batch_sweep and hasattr(module, "make_train_step"):
            out["batch_size"] = device_batch_sweep(module, ds, device)
            lines.append(out["batch_size"]["message"])
    uses_compile = bool(getattr(module, "COMPILE", device.type == "cuda")) if module is not None else device.type == "cuda"
    if uses_compile:
        out["compile"] = compile_probe(device.type)
        lines.append(out["compile"]["message"])
    else:
        out["compile"] = {"status": "skipped", "message": "train.py does not compile on this device"}
    if device.type == "cuda" or run_seconds:
        seconds = run_seconds or SHORT_RUN_SECONDS["cuda"]
        out["short_run"] = short_run(repo, python, seconds)
        lines.append(out["short_run"]["message"])
        if device.type == "cuda":
            out["memory_total_mb"] = torch.cuda.get_device_properties(device).total_memory / 2**20
    statuses = [out["compile"]["status"], out.get("short_run", {}).get("status", "ok")]
    out["status"] = "fail" if "fail" in statuses else "warn" if "warn" in statuses else "ok"
    out["message"] = "; ".join(lines) or "nothing to check on this device"
    return out


# ---------------------------------------------------------------------------- the whole check


def _busy_cpu(device) -> str | None:
    """A note when this CPU is oversubscribed (1-minute load above its cores), else None."""
    if device.type == "cuda" or not hasattr(os, "getloadavg"):
        return None
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load <= cores:
        return None
    return f"the machine is busy (load {load:.1f} on {cores} cores): the check runs on one thread; its tokens/s is pessimistic"


def _memory_total_mb() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    except (ValueError, OSError, AttributeError):
        return None


def run_check(repo: Path, *, time_budget: float = 300.0, max_steps: int | None = None, hours: float | None = None,
              device: str | None = None, parts: tuple[str, ...] = PARTS, out_dir: Path | None = None,
              data_dir: Path | None = None, python: str | None = None, lr_steps: int | None = None,
              say: Callable[[str], None] = print) -> dict:
    """Run the check's parts on repo/train.py; print each as it finishes; return the result dict.

    `result["ok"]` is False when a part failed (an overfit failure is a bug: do not start
    the night on it).
    """
    import torch

    from autoloop import harness as H

    repo = Path(repo).resolve()
    train_py = repo / "train.py"
    if not train_py.exists():
        raise AutoloopError(f"no train.py in {repo}: run `autoloop check` in the repository that holds it (or pass --repo)")
    out_dir = Path(out_dir) if out_dir else repo / ".autoloop" / "check"
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    python = python or sys.executable
    start = time.perf_counter()
    result: dict = {"train_py": str(train_py), "device_type": device.type, "time_budget": time_budget, "max_steps": max_steps,
                    "hours": hours}
    busy = _busy_cpu(device)
    if busy:
        # On an oversubscribed CPU, OpenMP threads spin-wait for each other and a step
        # takes many times longer; one thread keeps the check short (its throughput
        # figures are then pessimistic, and say so).
        torch.set_num_threads(1)
        result["busy_cpu"] = busy
        say(f"    note: {busy}")
    missing = missing_interface(train_py)
    module = None
    ds = H.load_dataset(data_dir or H.default_data_dir())
    if not missing:
        module = H.import_train_module(train_py)
        if getattr(module, "COMPILE", False):
            # The trials' compile cache: what the check compiles at the training shapes,
            # the baseline finds compiled.
            try:
                H.configure_compile_cache(H.RunSpec.from_env())
            except H.HarnessError as exc:
                say(f"    note: {exc}")
    result["complete"] = False
    check_json = out_dir / "check.json"

    def write() -> None:
        # After every part (and during the range test): a check cut short leaves what it measured.
        tmp = check_json.with_name(check_json.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        os.replace(tmp, check_json)

    def report(name: str, part: dict) -> None:
        result[name] = part
        result["seconds"] = round(time.perf_counter() - start, 1)
        write()
        say(f"{name:>8}: [{part['status']}] {part['message']}")

    def lr_progress(partial: dict) -> None:
        result["lr"] = partial
        write()

    write()

    if "overfit" in parts:
        report("overfit", unsupported(missing) if missing else overfit_one_batch(module, ds, device))
    lr = None
    if "lr" in parts:
        if missing:
            report("lr", unsupported(missing))
        else:
            try:
                lr = lr_range_test(module, ds, device, steps=lr_steps, out_dir=out_dir, on_progress=lr_progress)
            except Exception as exc:  # train.py's own error (the overfit part says what kind): one line, not a traceback
                lr = {"status": "fail", "message": f"the LR range test could not train: {_first_line(exc)}",
                      "error": _first_line(exc)}
            report("lr", lr)
            if lr.get("plot"):
                say(f"{'':>8}  plot: {lr['plot']}")
    health = None
    if "device" in parts:
        # A third-party script on a CPU: its short run is the only source of throughput.
        run_seconds = SHORT_RUN_SECONDS["cpu"] if (missing and device.type != "cuda" and "budget" in parts) else None
        t0 = time.perf_counter()
        health = device_health(module, ds, device, repo=repo, python=python, run_seconds=run_seconds)
        health["seconds"] = round(time.perf_counter() - t0, 2)
        report("device", health)
    if "budget" in parts:
        report("budget", _plan(module, ds, device, lr, health, time_budget=time_budget, max_steps=max_steps, hours=hours))
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["ok"] = not any(isinstance(result.get(p), dict) and result[p]["status"] == "fail" for p in PARTS)
    result["complete"] = True
    write()
    return result


def _plan(module, ds, device, lr: dict | None, health: dict | None, *, time_budget, max_steps, hours) -> dict:
    run = (health or {}).get("short_run") or {}
    lr = lr or {}
    if run.get("tokens_per_second"):
        tokens_per_second, tokens_per_step = run["tokens_per_second"], run.get("batch_tokens") or lr.get("tokens_per_step")
        source = "a short run of train.py" + (" (compiled)" if run.get("compiled") else "")
    else:
        tokens_per_second, tokens_per_step = lr.get("tokens_per_second"), lr.get("tokens_per_step")
        source = "the LR range test" + (" (compiled, as training)" if lr.get("compiled") else " (eager)")
    params = None
    warmup = 0
    if module is not None:
        model, _ = fresh_model(module, ds, device, 0)
        lookups = {id(p) for m in model.modules() if m.__class__.__name__ == "Embedding" for p in m.parameters()}
        params = sum(p.numel() for p in model.parameters() if id(p) not in lookups)
        warmup = int(getattr(module, "MUON_MOMENTUM_WARMUP_STEPS", 0) or 0)
        del model
    elif run.get("num_params"):
        params = int(run["num_params"])
    from autoloop import harness as H

    # Per run beyond the budget: start-up, compilation and evaluation, as the short run
    # measured them; without one, a CPU's few seconds (start-up, a small evaluation).
    overhead = 10.0
    if run.get("wall_seconds") and run.get("training_seconds") is not None:
        overhead = max(0.0, run["wall_seconds"] - run["training_seconds"])
    memory_total = (health or {}).get("memory_total_mb") or (_memory_total_mb() if device.type != "cuda" else None)
    peak = run.get("peak_memory_mb")
    if peak is None and device.type != "cuda":
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    plan = budget_plan(tokens_per_second=tokens_per_second, tokens_per_step=tokens_per_step, matmul_params=params,
                       time_budget=time_budget, max_steps=max_steps, hours=hours,
                       overhead_seconds=overhead, warmup_steps=max(warmup, H.UNTIMED_WARMUP_STEPS),
                       mfu_percent=run.get("mfu_percent"), peak_memory_mb=peak, memory_total_mb=memory_total)
    if tokens_per_second:
        plan["throughput_source"] = source
        plan["message"] = f"from {source}: {plan['message']}"
        compiles = bool(getattr(module, "COMPILE", False)) if module is not None else False
        if compiles and not run.get("compiled") and not lr.get("compiled"):
            plan.setdefault("warnings", []).append("the throughput was measured eager while train.py trains compiled: "
                                                   "the plan's steps and tokens are too low")
            plan["status"] = "warn"
            plan["message"] += " | WARNING: " + plan["warnings"][-1]
    return plan


def store_result(repo: Path, db: str | None, tag: str | None, result: dict) -> str | None:
    """Store the result on the run (`runs.check_result`) when the repository has one; its tag, else None."""
    from autoloop.store import Store

    path = Path(db or "experiments.db")
    path = path if path.is_absolute() else Path(repo) / path
    if not path.exists():
        return None
    store = Store(path)
    run = store.get_run(tag) if tag else (store.runs() or [None])[-1]
    if run is None:
        return None
    store.update_run(run["id"], check_result=result)
    return run["tag"]
