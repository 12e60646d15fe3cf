"""The output half of the train-script contract: result JSON, progress lines, summary block."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

# Keys printed first in the summary block, in this order (autoresearch's habit: the
# metric first, then time, then resources); any other scalar keys follow.
SUMMARY_ORDER = (
    "val_bpb", "training_seconds", "total_seconds", "compile_seconds", "eval_seconds",
    "peak_memory_mb", "mfu_percent", "total_tokens", "num_steps", "num_params",
    "tokens_per_second", "device", "seed", "data_fingerprint", "harness_fingerprint",
)


def _format(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.6f}" if math.isfinite(value) else str(value)
    return str(value)


def summary_block(result: dict) -> str:
    """`---` then `key: value` lines for every scalar in the result."""
    scalars = {k: v for k, v in result.items() if not isinstance(v, (list, dict))}
    keys = [k for k in SUMMARY_ORDER if k in scalars] + sorted(k for k in scalars if k not in SUMMARY_ORDER)
    width = max((len(k) for k in keys), default=0) + 2
    return "\n".join(["---"] + [f"{k + ':':<{width}}{_format(scalars[k])}" for k in keys])


def parse_summary(text: str) -> dict:
    """The `key: value` lines after the last `---` line of a log, numbers parsed."""
    lines = text.splitlines()
    try:
        start = len(lines) - 1 - lines[::-1].index("---")
    except ValueError:
        return {}
    parsed = {}
    for line in lines[start + 1 :]:
        key, sep, raw = line.partition(":")
        if not sep or not key.strip() or " " in key.strip():
            continue
        raw = raw.strip()
        value: object = raw
        for kind in (int, float):
            try:
                value = kind(raw)
                break
            except ValueError:
                pass
        if raw in ("null", "None"):
            value = None
        parsed[key.strip()] = value
    return parsed


def write_json_atomic(path: Path | str, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=float))
    os.replace(tmp, path)


def finish(spec, result: dict) -> None:
    """Write the result JSON (when the controller asked for one) and print the summary."""
    if spec.result_path is not None:
        write_json_atomic(spec.result_path, result)
    print(summary_block(result), flush=True)


class LossCurve:
    """The result's loss curve, thinned as it grows: past `max_points` points it keeps every
    other one and records half as often, so a run of any length gives at most about that many."""

    def __init__(self, max_points: int):
        self.max_points, self.stride, self.points = max_points, 1, []

    def add(self, step: int, seconds: float, loss: float, lr: float, grad_norm: float, last: bool = False) -> bool:
        """Step `step` (0-based) finished; recorded as step + 1 when the stride (or `last`) says
        so. Returns whether it was: train.py then writes the step's progress record too (while the
        stride is finer than its printed lines'), so the worker's early stop sees the points its
        calibration (on these curves) was made from."""
        if step % self.stride and not last:
            return False
        # lr: the schedule's multiplier of every group's peak LR (1 = peak).
        self.points.append({"step": step + 1, "seconds": round(seconds, 4), "loss": round(loss, 5), "lr": lr,
                            "grad_norm": round(grad_norm, 5)})
        if len(self.points) > self.max_points:
            self.points, self.stride = self.points[::2], self.stride * 2
        return True


class ProgressWriter:
    """Appends one JSON line per logged step, for `autoloop status` and the worker's early
    stop; no-op without a path. A record costs microseconds, so every step the loss curve
    keeps gets one while the curve is denser than the printed lines (a 40-step CPU run: all
    40; the early stop's windows are means over them; past ~2,000 steps LOG_EVERY's lines are
    as dense as the curve), while the printed line stays every LOG_EVERY steps."""

    def __init__(self, path: Path | str | None):
        self.path = Path(path) if path else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, record: dict) -> None:
        if self.path is None:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def step(self, step: int, progress: float, loss: float, lr: float, grad_norm: float, seconds: float,
             step_seconds: float, tokens_per_second: float, mfu: float | None, echo: bool = True) -> None:
        """Step `step` (0-based) finished: its record to the file and, with `echo`, its progress
        line to stdout (the line the logs show; the result JSON, not this, is parsed)."""
        record = {"step": step + 1, "progress": round(progress, 4), "loss": round(loss, 5), "lr": lr,
                  "grad_norm": round(grad_norm, 5), "tokens_per_second": round(tokens_per_second, 1),
                  "training_seconds": round(seconds, 3), "mfu_percent": mfu}
        self.log(record)
        if not echo:
            return
        print(f"step {step + 1:05d} ({100 * progress:5.1f}%) | loss {loss:.4f} | lr x{lr:.3f} | "
              f"grad norm {record['grad_norm']:.3f} | {1000 * step_seconds:.0f} ms | {tokens_per_second:,.0f} tok/s"
              + (f" | mfu {mfu:.1f}%" if mfu is not None else ""), flush=True)
