"""The whole check: its parts in order, each printed as it ends and written to check.json as it goes,
the budget planned from what the others measured, and the result stored on the run."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

from autoloop.check.budget import budget_plan
from autoloop.check.device import SHORT_RUN_SECONDS, device_health
from autoloop.check.lr_range import lr_range_test
from autoloop.check.overfit import overfit_one_batch
from autoloop.check.training import first_line, fresh_model, missing_interface, unsupported
from autoloop.errors import AutoloopError

PARTS = ("overfit", "lr", "budget", "device")
BROKEN_SCRIPT_SKIPS = "not run: train.py cannot overfit one batch (fix that first)"


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
        if result["overfit"]["status"] == "fail":
            # A script that cannot memorise one batch has a bug: a range test or a budget
            # plan of it would measure the bug, and the user waits for them for nothing.
            for name in parts:
                if name != "overfit":
                    report(name, {"status": "skipped", "message": BROKEN_SCRIPT_SKIPS})
            parts = ()
    lr = None
    if "lr" in parts:
        if missing:
            report("lr", unsupported(missing))
        else:
            try:
                lr = lr_range_test(module, ds, device, steps=lr_steps, out_dir=out_dir, on_progress=lr_progress)
            except Exception as exc:  # train.py's own error (the overfit part says what kind): one line, not a traceback
                lr = {"status": "fail", "message": f"the LR range test could not train: {first_line(exc)}",
                      "error": first_line(exc)}
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
        report("budget", plan_budget(module, ds, device, lr, health, time_budget=time_budget, max_steps=max_steps, hours=hours))
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["ok"] = not any(isinstance(result.get(p), dict) and result[p]["status"] == "fail" for p in PARTS)
    result["complete"] = True
    write()
    return result


def plan_budget(module, ds, device, lr: dict | None, health: dict | None, *, time_budget, max_steps, hours) -> dict:
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
