"""`autoloop serve` at scale: the page's data queries at 10,000 trials, and the
controller's per-trial overhead with the page open against closed.

    python bench/serve_scale.py                       # both parts (a few minutes)
    python bench/serve_scale.py --trials 10000 --repeat 30 --loop-trials 150
    python bench/serve_scale.py --skip-loop           # only the queries

Part 1 builds an experiments.db of `--trials` trials with the real Store (the test
writer of tests/serve_support.py, as the controller writes them: measurements at
several seeds, curves, decisions, events, a queue of ideas, two trials running with
their progress files), opens it read-only as the server does, and times every query the
page makes, uncached (`--repeat` times each): median and worst, in ms, and the size of
the JSON it sends.

Part 2 runs the real Controller over a training command that returns at once (as
bench/loop_overhead.py does), `--loop-trials` trials per round, in `--rounds` pairs of
rounds (closed-open, then open-closed, ...): "open" is `autoloop serve` on the project plus a page client in its own
process that holds the event stream and, on every change, fetches what the run page
fetches (its views in one request, those it has unchanged left out; the tree every 5th
change), as fast as the page would. `--browser` uses headless Chromium on the real page
instead (it then also competes for this machine's CPU, as a page opened on the GPU box
itself would). It prints the median per-trial cycle of each round, and open minus
closed paired by round (mean ± standard error). Target: no measurable difference, i.e.
that difference within 2 standard errors of zero.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import bench_repo  # noqa: E402

FAST_TRAIN = """#!/bin/sh
LR=0.02  # placeholder so the file has a constant
echo '{"val_bpb": 1.5, "training_seconds": 0.0, "total_seconds": 0.0, "num_steps": 1}' > "$AUTOLOOP_RESULT"
"""


# ---------------------------------------------------------------------------- part 1: queries


def build_db(root: Path, trials: int) -> Path:
    from serve_support import NightWriter

    repo = root / "big"
    (repo / ".autoloop").mkdir(parents=True)
    start = time.perf_counter()
    writer = NightWriter(repo, "big", git_repo=False, progress_files=False)
    writer.baseline(1.60)
    done = 1
    while done < trials - 2:
        batch = min(500, trials - 2 - done)
        with writer.store.transaction():  # the writer's many small transactions, committed per 500 trials
            writer.night(batch, keep_every=97)
        done += batch
    with writer.store.transaction():
        for i in range(300):
            writer.event("drift" if i % 3 else "noise", f"event {i}: the incumbent shifted by +0.00{i % 10} (within the noise)")
        for i in range(200):
            writer.store.add_idea(f"idea {i}: try something", sets={"LR": f"0.0{i % 9 + 1}"}, source="human")
    for worker in ("gpu0", "gpu1"):
        trial = writer.start(f"running on {worker}", worker=worker)
        writer.progress(trial, 150)
    writer.close()
    print(f"built {trials} trials with the real Store in {time.perf_counter() - start:.1f} s "
          f"({(repo / 'experiments.db').stat().st_size / 1e6:.1f} MB)")
    return repo


def time_queries(repo: Path, repeat: int) -> None:
    from autoloop.serve import queries as q
    from autoloop.serve.app import ServeState
    from autoloop.serve.readonly import ReadOnlyStore

    store = ReadOnlyStore(repo / "experiments.db")
    run = store.get_run("big")
    total = q.trials_page(store, run, limit=1)["total"]
    keep = store.best_trial(run["id"])
    state = ServeState(repo, repo / "experiments.db", db_option=None, token="x", public=False, port=0, host="127.0.0.1")
    cases = [
        ("runs list", lambda: q.runs_list(store)),
        ("summary (headline, best, noise)", lambda: q.summary(store, run)),
        ("progress chart (every trial)", lambda: q.progress(store, run)),
        ("trial table, newest page", lambda: q.trials_page(store, run, offset=0, limit=50)),
        ("trial table, middle page", lambda: q.trials_page(store, run, offset=total // 2, limit=50)),
        ("trial table, oldest page", lambda: q.trials_page(store, run, offset=total - 50, limit=50)),
        ("trial table, status=keep", lambda: q.trials_page(store, run, status="keep", limit=50)),
        ("trial table, kind=proposal,status=crash", lambda: q.trials_page(store, run, status="crash", kind="proposal")),
        ("trial table, one parent commit", lambda: q.trials_page(store, run, parent=keep["trial_commit"])),
        ("running trials (live curves)", lambda: q.live(store, run, repo)),
        ("recent events", lambda: q.events(store, run)),
        ("idea queue", lambda: q.ideas(store, run)),
        ("experiment tree (layout)", lambda: q.tree(store, run)),
        ("trial page (a keep)", lambda: q.trial_page(store, run, keep["number"], repo)),
        ("change stamp (every 0.5 s)", lambda: state.stamp("big")),
    ]
    print(f"\npage queries at {total} trials, read-only, uncached ({repeat} runs each):")
    print(f"  {'query':<42} {'median ms':>10} {'worst ms':>9} {'JSON KB':>8}")
    for name, call in cases:
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            value = call()
            times.append((time.perf_counter() - start) * 1000)
        size = len(json.dumps(value, separators=(",", ":"), default=str)) / 1024
        print(f"  {name:<42} {statistics.median(times):>10.2f} {max(times):>9.2f} {size:>8.1f}")
    store.close()


# ---------------------------------------------------------------------------- part 2: the loop, page open or closed


def page_client(base: str, tag: str, stop, fetched) -> None:
    """What the run page does: hold the event stream, and on each change fetch its views
    in one request that leaves out those it already has (the tree page every 5th change,
    as if a second viewer had it open)."""
    host, port = base.rsplit("//", 1)[1].split(":")
    hashes: dict[str, str] = {}
    while not stop.is_set():
        try:
            sock = socket.create_connection((host, int(port)), timeout=2)
        except OSError:
            time.sleep(0.2)
            continue
        sock.sendall(f"GET /api/stream?run={tag} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        changes = 0
        try:
            buffer = b""
            while not stop.is_set():
                try:
                    chunk = sock.recv(65536)
                except socket.timeout:
                    continue
                if not chunk:
                    break
                buffer += chunk
                if b"event: change" not in buffer:
                    continue
                buffer = b""
                changes += 1
                have = ",".join(f"{k}:{v}" for k, v in hashes.items())
                paths = [f"page?offset=0&limit=50&have={have}"] + (["tree"] if changes % 5 == 0 else [])
                for path in paths:
                    try:
                        with urllib.request.urlopen(f"{base}/api/runs/{tag}/{path}", timeout=10) as reply:
                            body = json.loads(reply.read())
                        fetched.value += 1
                    except (OSError, ValueError):
                        continue
                    for name, part in (body.get("parts") or {}).items():
                        if "hash" in part:
                            hashes[name] = part["hash"]
        finally:
            sock.close()


def loop_round(root: Path, name: str, trials: int, page: str | None) -> dict:
    from autoloop.config import resolve
    from autoloop.loop.controller import Controller
    from autoloop.store import Store

    repo = bench_repo.make_repo(root / name, "LR = 0.02  # learning rate\n", {"fast_train.sh": FAST_TRAIN})
    store = Store(repo / "experiments.db")
    with store.transaction():
        for i in range(trials):
            store.add_idea(f"lr {i}", sets={"LR": f"{0.01 + i * 1e-6:.6f}"})
    store.close()
    config = resolve(repo, {"tag": name, "max_trials": trials + 1, "train_command": "sh fast_train.sh",
                            "proposers": "ideas", "time_budget": 5, "grace_seconds": 30, "verify": False})
    server = browser = client = None
    stop = multiprocessing.Event()
    fetched = multiprocessing.Value("i", 0)
    if page:
        from serve_support import Server

        server = Server(repo)
        if page == "browser":
            from browser_support import Browser

            browser = Browser(server.link)
        else:
            client = multiprocessing.Process(target=page_client, args=(server.base, name, stop, fetched), daemon=True)
            client.start()
    ctl = Controller(config, repo, verifier=None)
    cycles: list[float] = []
    original = ctl.execute
    last = [None]

    def execute(item, ctx):
        trial = original(item, ctx)
        now = time.perf_counter()
        if last[0] is not None:
            cycles.append(now - last[0])
        last[0] = now
        return trial

    ctl.execute = execute
    watched = {"server": server.process.pid if server else None, "client": client.pid if client else None}
    before = {k: cpu_seconds(pid) for k, pid in watched.items() if pid}  # start-up (imports) left out
    cpu = {}
    try:
        ctl.run()
        cpu = {k: cpu_seconds(watched[k]) - v for k, v in before.items() if v is not None}
    finally:
        stop.set()
        if client is not None:
            client.join(5)
        if browser is not None:
            browser.close()
        if server is not None:
            server.close()
    return {"name": name, "page": page or "closed", "median": statistics.median(cycles[5:]),
            "p90": sorted(cycles[5:])[int(0.9 * (len(cycles) - 6))], "fetches": fetched.value,
            "cpu_per_trial": {k: v / trials for k, v in cpu.items() if v is not None}}


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a process has used so far (Linux /proc), else None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10_000, help="trials in the query benchmark's db")
    parser.add_argument("--repeat", type=int, default=30, help="runs of each query")
    parser.add_argument("--loop-trials", type=int, default=150, help="trials per round of the loop benchmark")
    parser.add_argument("--rounds", type=int, default=3, help="pairs of rounds (page closed, then open)")
    parser.add_argument("--browser", action="store_true", help="open the page in headless Chromium instead of the client")
    parser.add_argument("--skip-queries", action="store_true")
    parser.add_argument("--skip-loop", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ.setdefault("AUTOLOOP_CACHE_DIR", str(root / "cache"))
        if not args.skip_queries:
            time_queries(build_db(root, args.trials), args.repeat)
        if not args.skip_loop:
            page = "browser" if args.browser else "client"
            rounds = []
            # Pairs in the order closed-open, open-closed, ...: a machine that slows down or
            # speeds up steadily (another job starting) then shifts both sides alike.
            order = [mode for i in range(args.rounds) for mode in ((None, page) if i % 2 == 0 else (page, None))]
            for i, mode in enumerate(order):
                rounds.append(loop_round(root, f"r{i}", args.loop_trials, mode))
                r = rounds[-1]
                print(f"  round {i + 1}: page {r['page']:<8} median cycle {r['median'] * 1000:7.1f} ms, "
                      f"p90 {r['p90'] * 1000:7.1f} ms" + (f", {r['fetches']} page fetches" if r["fetches"] else "")
                      + "".join(f", {k} CPU {v * 1000:.1f} ms a trial" for k, v in r["cpu_per_trial"].items()),
                      flush=True)
            closed = [r["median"] for r in rounds if r["page"] == "closed"]
            opened = [r["median"] for r in rounds if r["page"] != "closed"]
            mean, se = paired_difference(closed, opened)  # the i-th closed and open rounds are one pair
            print(f"\ncontroller per-trial cycle ({args.loop_trials} trials a round, first 5 left out): "
                  f"page closed {statistics.mean(closed) * 1000:.1f} ms (rounds {', '.join(f'{c * 1000:.1f}' for c in closed)}), "
                  f"page open {statistics.mean(opened) * 1000:.1f} ms (rounds {', '.join(f'{c * 1000:.1f}' for c in opened)})")
            print(f"open - closed, paired by round: {mean * 1000:+.1f} ± {se * 1000:.1f} ms (mean ± se of {len(closed)} "
                  f"pairs): {'no measurable difference (|mean| < 2 se)' if abs(mean) < 2 * se else 'a measurable difference (|mean| >= 2 se)'}")


def paired_difference(closed: list[float], opened: list[float]) -> tuple[float, float]:
    """Mean and standard error of (open - closed) over the rounds' pairs (the i-th of each),
    so that what drifts between pairs (another job, a warming disk) cancels."""
    diffs = [o - c for c, o in zip(closed, opened)]
    if len(diffs) < 2:
        return (diffs[0] if diffs else 0.0), float("inf")
    return statistics.mean(diffs), statistics.stdev(diffs) / len(diffs) ** 0.5

if __name__ == "__main__":
    sys.exit(main())
