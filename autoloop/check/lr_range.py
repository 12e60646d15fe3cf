"""(b) the learning-rate range test: every group's rate scaled by one multiplier swept over three
decades through the model as train.py trains it; the suggestion sits SUGGEST_BELOW under the divergence."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable
from autoloop.check.training import (batch_shape, device_key, group_lrs, lr_constants, model_seq_len, set_lr,
    training_setup)


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

    key = device_key(device)
    cap = steps or LR_STEPS[key]
    max_seconds = LR_SECONDS[key] if max_seconds is None else max_seconds
    seq_len = model_seq_len(device)
    batch, grad_accum = batch_shape(module, seq_len)
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

