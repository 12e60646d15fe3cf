"""(d) the device: the attention kernel in use and the usable ones timed, whether torch.compile works
here (probed in a child), DEVICE_BATCH_SIZE by measurement, and on CUDA a short real run of train.py."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from autoloop.check.training import (autocast, batch_shape, choose_kernel, device_key, first_line,
    fresh_model, kernel_dtype, model_seq_len, training_setup)


SHORT_RUN_SECONDS = {"cuda": 20.0, "cpu": 8.0}
# DEVICE_BATCH_SIZE by measurement: candidates around the current one, each compiled (on
# CUDA) and timed for a few optimizer steps at the same tokens per step, within this bound.
BATCH_SWEEP_SECONDS = {"cuda": 150.0, "cpu": 20.0}
BATCH_SWEEP_STEPS = {"cuda": 3, "cpu": 2}  # timed optimizer steps per candidate, after one untimed
BATCH_MEMORY_HEADROOM = 0.10  # a suggested batch leaves this share of the GPU's memory free
BATCH_MIN_GAIN_PERCENT = 3.0  # a faster batch size is suggested only above this gain (below: timing noise)


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
    batch, _ = batch_shape(module, model_seq_len(device))
    x, _ = next(H.TokenLoader(ds, "train", min(batch, 2), model_seq_len(device), device, seed=seed))
    kernel = choose_kernel(module, model.config, batch, device)
    if hasattr(model, "set_attention_kernel"):
        model.set_attention_kernel(kernel)  # pinned inside the model's forward, as train.py trains
        context = H.attention_kernel(None)
    else:
        context = H.attention_kernel(kernel)
    recorder = Recorder()
    with torch.no_grad(), autocast(module, device), context, recorder:
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
    batch, _ = batch_shape(module, seq_len)
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

    key = device_key(device)
    max_seconds = BATCH_SWEEP_SECONDS[key] if max_seconds is None else max_seconds
    steps = steps or BATCH_SWEEP_STEPS[key]
    seq_len = model_seq_len(device)
    current, _ = batch_shape(module, seq_len)
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
            rows.append({"device_batch_size": b, "error": "out of memory" if oom else first_line(exc)})
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

            config = module.model_config(vocab_size=ds.vocab_size, seq_len=model_seq_len(device))
            batch, _ = batch_shape(module, model_seq_len(device))
            times = H.time_attention_kernels(config, batch, device, kernel_dtype(module))
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

