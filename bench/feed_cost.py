"""What the harness's data feed costs a trial: per batch, per tick, per step, per 300 s trial.

    python bench/feed_cost.py                      # defaults: 300 batches per size, 30-step CPU runs
    python bench/feed_cost.py --steps 60 --repeats 3
    python bench/feed_cost.py --skip-train         # only the socket figures

1. Per batch over the socket, at the GPU scale (B x 2048 tokens, B = 16 and train.py's
   64) and the CPU scale (8 x 256): a FeedServer on the embedded corpus and a client in
   this process, against the same batches read from the memory map; both end as int64
   arrays (what TokenLoader hands to torch), so the difference is the feed's cost.
2. Per clock tick (a send with no reply).
3. Per step at the CPU scale: the real train.py in step mode with and without the feed
   (its own ms_per_step, median of --repeats alternating runs); on a shared machine this
   difference is within the noise, which is itself the finding.
4. A 300 s GPU trial: train.py's GPU batch (64 x 2048, 4 micro-steps a step) at
   --gpu-step-seconds per step: batches x per-batch cost + steps x tick cost, in seconds
   and as a share of 300 s. The loader fetches the next batch while the GPU works on the
   current one, so on a GPU this is an upper bound on the time it adds.
The data cache is the usual one ($AUTOLOOP_CACHE_DIR, else ~/.cache/autoloop).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoloop import harness as H  # noqa: E402
from autoloop.harness.data import read_windows  # noqa: E402

TRIAL_SECONDS = 300.0


def per_batch(ds, address: Path, batch_size: int, seq_len: int, n: int) -> tuple[float, float]:
    """(seconds per batch from the memory map, seconds per batch from the feed)."""
    import numpy as np

    tokens = ds._memmap("train")
    sampler = H.WindowSampler(len(tokens), batch_size, seq_len, seed=1)
    read_windows(tokens, sampler.starts(), seq_len).astype(np.int64)  # warm the page cache
    t0 = time.perf_counter()
    for _ in range(n):
        read_windows(tokens, sampler.starts(), seq_len).astype(np.int64)
    direct = (time.perf_counter() - t0) / n

    from autoloop.harness.feed import FeedClient

    client = FeedClient(str(address))
    stream = client.open_stream("train", batch_size, seq_len, seed=2)
    stream.next_windows()
    t0 = time.perf_counter()
    for _ in range(n):
        stream.next_windows().astype(np.int64)
    fed = (time.perf_counter() - t0) / n
    client.close()
    return direct, fed


def per_tick(address: Path, n: int) -> float:
    from autoloop.harness.feed import FeedClient

    client = FeedClient(str(address))
    t0 = time.perf_counter()
    for k in range(n):
        client.tick(k + 1)
    seconds = (time.perf_counter() - t0) / n
    client.close()
    return seconds


def train_ms_per_step(ds, steps: int, feed: bool, workdir: Path) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOLOOP_") or k == "AUTOLOOP_CACHE_DIR"}
    env.update({"AUTOLOOP_MAX_STEPS": str(steps), "AUTOLOOP_SEED": "1", "AUTOLOOP_RESULT": str(workdir / "r.json"),
                "AUTOLOOP_DATA_DIR": str(ds.path), "CUDA_VISIBLE_DEVICES": "",
                "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)})
    server = H.FeedServer(ds.path, workdir / "feed.sock", seed=1).start() if feed else None
    try:
        if server is not None:
            env["AUTOLOOP_FEED"] = str(server.address)
        proc = subprocess.run([sys.executable, str(ROOT / "train.py")], env=env, capture_output=True, text=True)
    finally:
        if server is not None:
            server.close()
    if proc.returncode != 0:
        sys.exit(f"train.py failed (feed={feed}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads((workdir / "r.json").read_text())["ms_per_step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=300, help="batches timed per size")
    parser.add_argument("--ticks", type=int, default=20000, help="clock ticks timed")
    parser.add_argument("--steps", type=int, default=30, help="steps of each CPU train.py run")
    parser.add_argument("--repeats", type=int, default=2, help="train.py runs with and without the feed (alternating)")
    parser.add_argument("--gpu-step-seconds", type=float, default=0.3, help="a GPU step of train.py (2^19 tokens)")
    parser.add_argument("--skip-train", action="store_true", help="only the socket figures")
    args = parser.parse_args()

    ds = H.load_dataset()
    with tempfile.TemporaryDirectory(prefix="feed-cost-") as tmp:
        workdir = Path(tmp)
        with H.FeedServer(ds.path, workdir / "bench.sock") as server:
            print(f"per batch over the socket ({args.batches} batches each; int64 arrays at the end):")
            costs = {}
            for b, t in ((8, 256), (16, 2048), (64, 2048)):
                direct, fed = per_batch(ds, server.address, b, t, args.batches)
                costs[(b, t)] = fed - direct
                print(f"  {b:3d} x {t:4d} tokens: memmap {1e3 * direct:7.3f} ms | feed {1e3 * fed:7.3f} ms | "
                      f"feed costs {1e3 * (fed - direct):+7.3f} ms a batch")
            tick = per_tick(server.address, args.ticks)
            print(f"per clock tick: {1e6 * tick:.1f} us (a send, no reply)")

        steps = TRIAL_SECONDS / args.gpu_step_seconds
        batches = steps * 4 + 1
        extra = batches * max(costs[(64, 2048)], 0.0) + steps * tick
        print(f"a {TRIAL_SECONDS:.0f} s GPU trial ({steps:.0f} steps of {args.gpu_step_seconds} s, {batches:.0f} batches "
              f"of 64 x 2048): {extra:.3f} s of feed work in the training process, {100 * extra / TRIAL_SECONDS:.2f}% "
              "of the trial (an upper bound: the loader fetches while the GPU computes)")

        if args.skip_train:
            return
        print(f"train.py at the CPU scale, {args.steps} steps, {args.repeats} runs each way (alternating):")
        with_feed, without = [], []
        for _ in range(args.repeats):
            without.append(train_ms_per_step(ds, args.steps, False, workdir))
            with_feed.append(train_ms_per_step(ds, args.steps, True, workdir))
        a, b = statistics.median(without), statistics.median(with_feed)
        step_cost = costs[(8, 256)] * 2 + tick  # two micro-batches and one tick a step
        print(f"  ms per step: without the feed {a:.1f} (runs {', '.join(f'{x:.1f}' for x in without)}) | "
              f"with {b:.1f} (runs {', '.join(f'{x:.1f}' for x in with_feed)}) | difference {b - a:+.1f} ms")
        print(f"  from the socket figures: {1e3 * step_cost:.3f} ms a step = {100 * step_cost / (a / 1e3):.2f}% of a "
              f"step; in a 300 s CPU trial {TRIAL_SECONDS / (a / 1e3) * step_cost:.2f} s "
              f"({100 * step_cost / (a / 1e3):.2f}% of the trial)")


if __name__ == "__main__":
    main()
