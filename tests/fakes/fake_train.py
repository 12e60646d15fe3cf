"""A fake training script implementing the train-script contract, for controller tests.

val_bpb is a known function of the constants below (minimum 1.0 at LR = 0.01,
WIDTH = 64), so a test knows which proposals improve. MODE makes it misbehave the way
real scripts do: crash, hang, NaN, no metric, summary-only output, a child process that
ignores SIGTERM (stubborn_child), or a checkpoint save on a full disk (enospc). STEPWISE
makes it train for real in shape: STEPS steps (AUTOLOOP_MAX_STEPS when set) over SLEEP
seconds, a progress line per step and a loss curve whose distance from the unmodified
script's grows with its final val_bpb's (the early-stop tests).
"""

import json
import math
import os
import subprocess
import sys
import time

LR = 0.02  # learning rate; range 0.0001..1 log
WIDTH = 64  # model width; power of two
SLEEP = 0.0  # seconds to pretend to train
MODE = "ok"  # ok | crash | hang | nan | nometric | reported | stubborn_child | fail | enospc | fill
NOISE = 0.0  # sd of a per-seed draw added to val_bpb (seed noise, as in real training)
SALT = 0  # which random stream the seed draws from: a change re-draws the noise (an init-only change)
OFFSET_FILE = ""  # a file holding a number added to val_bpb (a machine that drifts)
SPEED_FILE = ""  # a file holding the machine's speed (1: as usual); a faster machine trains more steps in the budget
RECORD_WORKER = False  # put CUDA_VISIBLE_DEVICES and the working folder into the result (executor tests)
PIDFILE = ""  # write {"pid", "ppid"} here at the start (a test that kills the worker running it)
STEPWISE = False  # write a loss curve step by step (see the docstring)
STEPS = 20  # steps of a STEPWISE run without AUTOLOOP_MAX_STEPS
STEP_NOISE = 0.002  # sd of each curve point's own draw (by seed, SALT and step)


def val_bpb() -> float:
    value = 1.0 + (math.log10(LR) + 2.0) ** 2 + 0.1 * (math.log2(WIDTH) - 6.0) ** 2
    if NOISE:
        import random

        value += NOISE * random.Random(int(os.environ.get("AUTOLOOP_SEED", "0")) * 1000003 + SALT).gauss(0.0, 1.0)
    if OFFSET_FILE and os.path.exists(OFFSET_FILE):
        with open(OFFSET_FILE) as handle:
            value += float(handle.read().strip() or 0)
    if SPEED_FILE and os.path.exists(SPEED_FILE):
        with open(SPEED_FILE) as handle:  # twice the speed: twice the steps, 0.1 bpb lower
            value -= 0.1 * math.log2(float(handle.read().strip() or 1))
    return value


def loss_at(step: int, steps: int, final: float) -> float:
    """The training loss at `step`: the same descent for every variant, plus a part that
    grows with progress towards the final val_bpb's distance from the optimum (1.0)."""
    import random

    p = step / steps
    draw = random.Random((int(os.environ.get("AUTOLOOP_SEED", "0")) * 1000003 + SALT) * 7919 + step).gauss(0.0, 1.0)
    return 3.0 - 1.5 * p + (final - 1.0) * p + STEP_NOISE * draw


def train_curve(progress: str | None, final: float) -> list:
    """STEPWISE: the steps, one progress line each, SLEEP seconds in all; returns the curve."""
    steps = int(os.environ.get("AUTOLOOP_MAX_STEPS") or STEPS)
    curve = []
    for step in range(1, steps + 1):
        time.sleep(SLEEP / steps)
        point = {"step": step, "seconds": SLEEP * step / steps, "loss": loss_at(step, steps, final), "lr": 1.0}
        curve.append(point)
        if progress:
            with open(progress, "a") as handle:
                handle.write(json.dumps({**point, "progress": step / steps, "training_seconds": point["seconds"]})
                             + "\n")
    return curve


def main() -> None:
    start = time.time()
    if PIDFILE:
        with open(PIDFILE + ".tmp", "w") as handle:
            json.dump({"pid": os.getpid(), "ppid": os.getppid()}, handle)
        os.replace(PIDFILE + ".tmp", PIDFILE)
    progress = os.environ.get("AUTOLOOP_PROGRESS")
    if progress:
        with open(progress, "a") as handle:
            handle.write(json.dumps({"step": 1, "loss": 3.0, "training_seconds": 0.0}) + "\n")
    if MODE == "stubborn_child":
        subprocess.Popen([sys.executable, "-c",
                          "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
        time.sleep(600)
    if MODE == "hang":
        time.sleep(600)
    if MODE == "kill_worker":  # (also) the process running this script dies: a worker on a dead node
        os.kill(os.getppid(), 9)
        time.sleep(600)
    if MODE == "crash":
        raise RuntimeError("CUDA error: an illegal memory access was encountered (pretend)")
    if MODE == "enospc":  # a checkpoint save on a full disk; DISK_FULL tells a test's fake git
        if os.environ.get("AUTOLOOP_RESULT"):
            open(os.path.join(os.path.dirname(os.environ["AUTOLOOP_RESULT"]), "DISK_FULL"), "w").close()
        print("Traceback (most recent call last):\n  File \"train.py\", line 1, in save_checkpoint", flush=True)
        print("OSError: [Errno 28] No space left on device", flush=True)
        sys.exit(1)
    if MODE == "fill":  # writes checkpoints into its out/ until the disk is full: a disk the trial filled
        block = b"x" * 2**20
        try:
            for i in range(10**6):
                with open(os.path.join(os.path.dirname(os.environ["AUTOLOOP_RESULT"]), f"ckpt{i}"), "wb") as handle:
                    handle.write(block)
        except OSError as exc:
            print(f"OSError: {exc}", flush=True)
        sys.exit(1)
    if MODE == "fail":
        print("FAIL: loss is nan", flush=True)
        sys.exit(1)
    metric = float("nan") if MODE == "nan" else val_bpb()
    curve = train_curve(progress, metric) if STEPWISE else None
    if not STEPWISE:
        time.sleep(SLEEP)
    result = {
        "val_bpb": metric, "training_seconds": SLEEP, "total_seconds": time.time() - start,
        "compile_seconds": 0.0, "eval_seconds": 0.0, "num_steps": 10, "total_tokens": 1000,
        "num_params": 1000, "mfu_percent": None, "peak_memory_mb": 1.0, "device": "cpu", "seed": 0,
        "curve": curve or [{"step": 1, "seconds": 0.0, "loss": 3.0, "lr": LR, "grad_norm": 1.0}],
    }
    if RECORD_WORKER:
        result["worker"] = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"), "cwd": os.getcwd(),
                            "pid": os.getpid()}
    if MODE == "nometric":
        print("done, but no metric", flush=True)
        return
    if MODE != "reported" and os.environ.get("AUTOLOOP_RESULT"):
        with open(os.environ["AUTOLOOP_RESULT"], "w") as handle:
            json.dump(result, handle)
    print("---")
    print(f"val_bpb:          {metric:.6f}")
    print(f"training_seconds: {SLEEP:.1f}")
    print("peak_vram_mb:     1.0")
    print("num_params_M:     0.001")


if __name__ == "__main__":
    main()
