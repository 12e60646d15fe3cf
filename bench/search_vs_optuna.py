"""Our `search` proposer against Optuna's TPE, the same number of trials each.

    pip install optuna                                # or pip install -e .[bench]
    python bench/search_vs_optuna.py --quick          # ~15 min on 2 CPU cores (real: 10 trials each)
    python bench/search_vs_optuna.py                  # synthetic x5 seeds; real train.py 40 trials
                                                      # each: about 30 s a trial on 2 CPU cores
    python bench/search_vs_optuna.py --part synthetic --seeds 10

Two objectives:

- synthetic: a fake train.py whose val_bpb is a known function of ten constants (an
  optimum of 1.0; the learning-rate optimum moves with the batch size; one constant has
  no effect) plus Gaussian noise of sd 0.002 (about run-to-run noise), seeded by the
  benchmark seed and the evaluation's index, so both methods see the same noise
  sequence. It also reports the noise-free value at each method's incumbent.
- real: the repository's train.py on this machine's scale in step mode
  (AUTOLOOP_MAX_STEPS), deterministic.

Ours runs through the real Controller (git commits, the db, the trial subprocess), from
the script as written: trial 1 is the baseline. TPE (default settings, seeded) gets the
same search space: the hint ranges of the synthetic script; for train.py, a box around
each default derived from the search's own rules (log: /16..x16, powers of two: /8..x8,
small integers: +-4, fractions: 0..1, booleans) over the same constants. TPE's first trial
is the script's defaults (enqueued), so both start from the same point. A crashed trial
counts as a trial and reaches nothing.

Printed: the best val_bpb reached after 10, 20 and 40 trials (mean over seeds for the
synthetic objective), for each method.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoloop.config import resolve  # noqa: E402
from autoloop.loop.controller import Controller  # noqa: E402
from autoloop.proposers.search_space import Param, build_space  # noqa: E402
from autoloop.pyconst import Expression, set_constants  # noqa: E402
from autoloop.store import Store  # noqa: E402
from bench_repo import make_repo  # noqa: E402

CHECKPOINTS = (10, 20, 40)

SYNTHETIC = '''"""Synthetic objective for bench/search_vs_optuna.py: val_bpb is a known function.

Optimum 1.0 at LR = 0.02 * sqrt(BATCH_SIZE / 128) (so 0.02 at 128), EMBEDDING_LR = 0.6,
BATCH_SIZE = 128, WEIGHT_DECAY = 0.1, WARMUP_RATIO = 0.1, WARMDOWN_RATIO = 0.5,
DEPTH = 8, USE_QK_NORM = True, DROPOUT = 0.0; ADAM_EPS has no effect.
"""
import json
import math
import os
import random

LR = 0.003  # learning rate; range 0.0001..1 log
EMBEDDING_LR = 0.3  # embedding learning rate; range 0.01..10 log
BATCH_SIZE = 32  # sequences per step; range 4..512 pow2
WEIGHT_DECAY = 0.01  # range 0.0001..1 log
WARMUP_RATIO = 0.0  # range 0..0.5 linear
WARMDOWN_RATIO = 0.2  # range 0..1 linear
ADAM_EPS = 1e-08  # range 1e-10..1e-06 log
DROPOUT = 0.1  # range 0..0.5 linear
USE_QK_NORM = False  # normalise queries and keys
DEPTH = 4  # range 1..16 int


def true_bpb():
    lr_opt = 0.02 * math.sqrt(BATCH_SIZE / 128)
    return (1.0 + 0.5 * math.log10(LR / lr_opt) ** 2 + 0.1 * math.log10(EMBEDDING_LR / 0.6) ** 2
            + 0.04 * math.log2(BATCH_SIZE / 128) ** 2 + 0.05 * math.log10(WEIGHT_DECAY / 0.1) ** 2
            + 0.3 * (WARMUP_RATIO - 0.1) ** 2 + 0.2 * (WARMDOWN_RATIO - 0.5) ** 2 + 0.2 * DROPOUT
            + (0.0 if USE_QK_NORM else 0.02) + 0.01 * (DEPTH - 8) ** 2)


if __name__ == "__main__":
    counter = os.environ["BENCH_COUNTER"]
    index = int(open(counter).read()) if os.path.exists(counter) else 0
    with open(counter, "w") as handle:
        handle.write(str(index + 1))
    noise = random.Random(int(os.environ.get("BENCH_SEED", "0")) * 100003 + index).gauss(0.0, 0.002)
    truth = true_bpb()
    result = {"val_bpb": truth + noise, "true_bpb": truth, "training_seconds": 0.0, "total_seconds": 0.0,
              "compile_seconds": 0.0, "eval_seconds": 0.0, "num_steps": 1, "total_tokens": 1, "num_params": 1,
              "mfu_percent": None, "peak_memory_mb": 0.0, "device": "cpu", "seed": 0, "curve": []}
    if os.environ.get("AUTOLOOP_RESULT"):
        with open(os.environ["AUTOLOOP_RESULT"], "w") as handle:
            json.dump(result, handle)
    print("---")
    print(f"val_bpb: {truth + noise:.6f}")
'''


# ------------------------------------------------------------------------------- helpers



def best_curve(values: list[float | None], n: int) -> list[float | None]:
    """Best-so-far after each of the first n trials (None until something succeeded)."""
    out, best = [], None
    for value in values[:n]:
        if value is not None and math.isfinite(value) and (best is None or value < best):
            best = value
        out.append(best)
    return out


def at(curve: list, n: int):
    return curve[n - 1] if len(curve) >= n else None


# ------------------------------------------------------------------------------- ours


def run_ours(source: str, trials: int, env: dict, max_steps: int | None, time_budget: float) -> list[dict]:
    """Our search through the real controller; returns [{metric, true}] per trial."""
    with tempfile.TemporaryDirectory(prefix="bench-ours-") as tmp:
        repo = make_repo(Path(tmp) / "repo", source)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            flags = {"tag": "bench", "max_trials": trials, "proposers": "search", "time_budget": time_budget,
                     "grace_seconds": 600, "verify": False}
            if max_steps:
                flags["max_steps"] = max_steps
            summary = Controller(resolve(repo, flags), repo, verifier=None).run()
            if summary.stop_reason.startswith("interrupted"):
                raise KeyboardInterrupt  # the controller stopped politely on Ctrl-C: so does the benchmark
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        store = Store(repo / "experiments.db")
        try:
            rows = store.trials(store.get_run("bench")["id"])
        finally:
            store.close()
    out = []
    for row in rows:
        ok = row["status"] in ("keep", "discard") and row["metric"] is not None
        out.append({"metric": row["metric"] if ok else None,
                    "true": (row.get("result") or {}).get("true_bpb") if ok else None,
                    "what": row["description"], "status": row["status"]})
    return out


# ------------------------------------------------------------------------------- TPE


def tpe_space(params: list[Param], hinted: bool) -> dict[str, tuple]:
    """name -> (kind, low, high) for Optuna, from the search's own view of each constant."""
    space = {}
    for p in params:
        if p.kind == "bool":
            space[p.name] = ("bool", None, None)
            continue
        if hinted and p.lo is not None and p.hi is not None:
            lo, hi = p.lo, p.hi
        elif p.scale == "fraction":
            lo, hi = 0.0, 1.0
        elif p.scale == "log" and p.pow2:
            lo, hi = max(1, p.value // 8), p.value * 8
        elif p.scale == "log":
            lo, hi = sorted((p.value / 16, p.value * 16))
        elif p.kind == "int":
            lo, hi = max(p.lo if p.lo is not None else -math.inf, p.value - 4), p.value + 4
        else:
            lo, hi = (p.lo if p.lo is not None else p.value - 1.0), p.value + 1.0
        if p.pow2:
            space[p.name] = ("pow2", int(math.log2(lo)), int(math.log2(hi)))
        elif p.kind == "int":
            space[p.name] = ("int", int(lo), int(hi))
        else:
            space[p.name] = ("log" if p.scale == "log" and lo > 0 else "float", float(lo), float(hi))
    return space


def suggest(trial, name: str, spec: tuple):
    kind, lo, hi = spec
    if kind == "bool":
        return trial.suggest_categorical(name, [False, True])
    if kind == "pow2":
        return 2 ** trial.suggest_int(name, lo, hi)
    if kind == "int":
        return trial.suggest_int(name, lo, hi)
    return trial.suggest_float(name, lo, hi, log=kind == "log")


def defaults_for(space: dict, params: list[Param]) -> dict:
    values = {}
    for p in params:
        kind, lo, hi = space[p.name]
        values[p.name] = int(math.log2(p.value)) if kind == "pow2" else p.value
    return values


def evaluate(source: str, sets: dict, env: dict, max_steps: int | None, time_budget: float, workdir: Path) -> dict:
    """One training run of `source` with `sets`, the way the controller runs it."""
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    (workdir / "train.py").write_text(set_constants(source, sets))
    result_path = workdir / "result.json"
    child = {**os.environ, **env, "AUTOLOOP_RESULT": str(result_path), "AUTOLOOP_SEED": "1337",
             "AUTOLOOP_TIME_BUDGET": str(time_budget), "PYTHONUNBUFFERED": "1"}
    if max_steps:
        child["AUTOLOOP_MAX_STEPS"] = str(max_steps)
    proc = subprocess.run([sys.executable, "train.py"], cwd=workdir, env=child, capture_output=True, text=True)
    if proc.returncode != 0 or not result_path.exists():
        return {"metric": None, "true": None}
    result = json.loads(result_path.read_text())
    metric = result.get("val_bpb")
    ok = isinstance(metric, (int, float)) and math.isfinite(metric)
    return {"metric": metric if ok else None, "true": result.get("true_bpb") if ok else None}


def run_tpe(source: str, trials: int, env: dict, max_steps: int | None, time_budget: float, seed: int,
            hinted: bool, step_mode: bool) -> list[dict]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    params = build_space(source, step_mode=step_mode)
    space = tpe_space(params, hinted)
    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=seed))
    study.enqueue_trial(defaults_for(space, params))
    out = []
    with tempfile.TemporaryDirectory(prefix="bench-tpe-") as tmp:
        for _ in range(trials):
            trial = study.ask()
            sets = {}
            for p in params:
                value = suggest(trial, p.name, space[p.name])
                sets[p.name] = Expression(f"2**{int(math.log2(value))}") if (p.pow2 and "**" in p.source) else value
            result = evaluate(source, sets, env, max_steps, time_budget, Path(tmp) / "work")
            if result["metric"] is None:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            else:
                study.tell(trial, result["metric"])
            out.append(result)
    return out


# ------------------------------------------------------------------------------- report


def fmt(value) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else "   -  "


def summarise(name: str, runs: list[list[dict]], trials: int, with_true: bool) -> list[str]:
    lines = []
    points = [n for n in CHECKPOINTS if n <= trials]
    observed = [[at(best_curve([t["metric"] for t in run], n), n) for n in points] for run in runs]
    mean = [statistics.mean(v[i] for v in observed) if all(v[i] is not None for v in observed) else None
            for i in range(len(points))]
    lines.append(f"  {name:<14}" + "".join(f"  {fmt(m):>8}" for m in mean) + "   best val_bpb reached")
    if with_true:
        truths = []
        for run in runs:
            row = []
            for n in points:
                head = [t for t in run[:n] if t["metric"] is not None]
                row.append(min(head, key=lambda t: t["metric"])["true"] if head else None)
            truths.append(row)
        mean_true = [statistics.mean(r[i] for r in truths) if all(r[i] is not None for r in truths) else None
                     for i in range(len(points))]
        lines.append(f"  {'':<14}" + "".join(f"  {fmt(m):>8}" for m in mean_true)
                     + "   noise-free value of that incumbent")
    return lines


def header(trials: int) -> str:
    points = [n for n in CHECKPOINTS if n <= trials]
    return f"  {'method':<14}" + "".join(f"  {'@' + str(n):>8}" for n in points)


def synthetic(trials: int, seeds: int) -> None:
    print(f"synthetic objective (optimum 1.0, noise sd 0.002): {trials} trials, mean of {seeds} seeds")
    ours, tpe = [], []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-counter-") as tmp:
        for seed in range(seeds):
            env = {"BENCH_SEED": str(seed), "BENCH_COUNTER": str(Path(tmp) / f"ours-{seed}")}
            ours.append(run_ours(SYNTHETIC, trials, env, None, 60.0))
            env = {"BENCH_SEED": str(seed), "BENCH_COUNTER": str(Path(tmp) / f"tpe-{seed}")}
            tpe.append(run_tpe(SYNTHETIC, trials, env, None, 60.0, seed, hinted=True, step_mode=False))
    print(header(trials))
    for line in summarise("search (ours)", ours, trials, True) + summarise("optuna TPE", tpe, trials, True):
        print(line)
    print(f"  ({time.time() - started:.0f} s)")


def real(trials: int, max_steps: int) -> None:
    source = (ROOT / "train.py").read_text()
    print(f"real train.py, step mode ({max_steps} steps, deterministic): {trials} trials each")
    started = time.time()
    ours = run_ours(source, trials, {}, max_steps, 600.0)
    print(f"  ours done in {time.time() - started:.0f} s", flush=True)
    started_tpe = time.time()
    tpe = run_tpe(source, trials, {}, max_steps, 600.0, 0, hinted=False, step_mode=True)
    print(f"  TPE done in {time.time() - started_tpe:.0f} s")
    print(header(trials))
    for line in summarise("search (ours)", [ours], trials, False) + summarise("optuna TPE", [tpe], trials, False):
        print(line)
    print("  our trials:")
    for i, t in enumerate(ours, 1):
        print(f"    {i:>3} {t['status']:<8} {fmt(t['metric'])}  {t['what']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("synthetic", "real", "both"), default="both",
                        help="Which objective to run.")
    parser.add_argument("--trials", type=int, default=40, help="Trials per method on the synthetic objective.")
    parser.add_argument("--seeds", type=int, default=5, help="Repetitions of the synthetic comparison.")
    parser.add_argument("--real-trials", type=int, default=40, help="Trials per method on the real train.py.")
    parser.add_argument("--max-steps", type=int, default=8, help="Training steps per real trial (step mode).")
    parser.add_argument("--quick", action="store_true",
                        help="Fewer trials and steps: synthetic 40 trials x 3 seeds, real 10 trials x 4 steps.")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.real_trials, args.max_steps = min(args.seeds, 3), min(args.real_trials, 10), 4
    try:
        import optuna  # noqa: F401
    except ImportError:
        sys.exit("this benchmark needs Optuna: pip install optuna (or pip install -e .[bench])")
    if args.part in ("synthetic", "both"):
        synthetic(args.trials, args.seeds)
    if args.part in ("real", "both"):
        real(args.real_trials, args.max_steps)


if __name__ == "__main__":
    main()
