"""Pipelining: the idle gap between one trial's end and the next one's start.

    python bench/pipelining.py                 # 8 trials of 10 s, a model that takes 10 s
    python bench/pipelining.py --serial        # the same without prefetching, for comparison
    python bench/pipelining.py --trials 12 --latency 5 --sleep 5

It builds a throwaway git repo whose train.py is the fake training script
(tests/fakes/fake_train.py) made to "train" for --sleep seconds, starts a fake
OpenAI-compatible server on loopback (tests/fakes/fake_openai.py) that takes --latency
seconds per answer, and runs the real Controller with the `llm` proposer and the real
`openai` client. The fake model edits the constants it reads in the prompt's train.py:
it lowers LR towards the optimum (kept) and alternates WIDTH away from it (discarded);
once it proposes an LR change while another LR change is training, so after that one is
kept its prepared proposal no longer applies and is regenerated (the one gap that has to
wait for the model). A gap is trials[n+1].started_at - trials[n].finished_at: the
decision, git archive/reset, taking the prepared proposal (or waiting for it), the
commit and the spawn of the next training process.

Target: median gap under 1 s with prefetching (the serial gap is about --latency).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from conftest import FAKE_TRAIN, make_repo  # noqa: E402
from fakes.fake_openai import FakeOpenAI, Slow  # noqa: E402

from autoloop.config import resolve  # noqa: E402
from autoloop.loop.controller import Controller  # noqa: E402
from autoloop.store import Store  # noqa: E402

# The constant the fake model changes at its n-th answer, and the values it gives each
# constant in turn: LR walks towards the optimum 0.01 (kept), WIDTH away from 64
# (discarded). Answers 3 and 4 are both LR: the 4th is prepared while the 3rd trains,
# against the parent the 3rd replaces, so it no longer applies and is regenerated.
PLAN = ["LR", "WIDTH", "LR", "LR", "WIDTH", "LR", "WIDTH", "LR", "WIDTH", "LR", "WIDTH", "LR"]
VALUES = {
    "LR": ["0.016", "0.0136", "0.0125", "0.0118", "0.0113", "0.011", "0.0107", "0.0105"],
    "WIDTH": ["128", "32", "256", "16", "512", "8"],
}


def fake_model(latency: float):
    answers = {"n": 0, "LR": 0, "WIDTH": 0}

    def respond(body: dict):
        prompt = [m for m in body["messages"] if m["role"] == "user"][0]["content"]
        source = prompt.split("## train.py", 1)[1]
        name = PLAN[answers["n"] % len(PLAN)]
        answers["n"] += 1
        value = VALUES[name][answers[name] % len(VALUES[name])]
        answers[name] += 1
        line = re.search(rf"^{name} = [0-9][0-9.e-]*[ \t]*(?:#.*)?$", source, re.MULTILINE).group(0)
        new = f"{name} = {value}"
        answer = f"DESCRIPTION: {new}\nFILE: train.py\n<<<<<<< SEARCH\n{line}\n=======\n{new}\n>>>>>>> REPLACE\n"
        return Slow(latency, answer)

    return respond


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=8, help="trials including the baseline")
    parser.add_argument("--latency", type=float, default=10.0, help="seconds the fake model takes per answer")
    parser.add_argument("--sleep", type=float, default=10.0, help="seconds each fake training takes")
    parser.add_argument("--serial", action="store_true", help="do not prepare proposals during training")
    args = parser.parse_args()

    if args.serial:
        from autoloop.proposers.llm import LLMProposer

        LLMProposer.slow = False  # the prefetcher only prepares for slow proposers
    with tempfile.TemporaryDirectory(prefix="autoloop-bench-") as tmp:
        os.environ.setdefault("AUTOLOOP_CACHE_DIR", str(Path(tmp) / "cache"))
        os.environ["OPENAI_API_KEY"] = "sk-bench"
        source = FAKE_TRAIN.read_text().replace("SLEEP = 0.0", f"SLEEP = {args.sleep}")
        repo = make_repo(Path(tmp) / "repo", source, {"program.md": (ROOT / "program.md").read_text()})
        with FakeOpenAI([fake_model(args.latency)]) as server:
            config = resolve(repo, {
                "tag": "bench", "proposers": "llm", "llm_model": "fake", "llm_base_url": server.base_url,
                "time_budget": args.sleep, "grace_seconds": 60, "max_trials": args.trials, "verify": False,
            })
            started = time.monotonic()
            summary = Controller(config, repo).run()
            wall = time.monotonic() - started
        with Store(repo / "experiments.db") as store:
            trials = store.trials(store.get_run("bench")["id"])
            events = [e["message"] for e in store.events(kind="prefetch")]

    print(f"{'serial' if args.serial else 'pipelined'}: {len(trials)} trials of {args.sleep:g} s, model latency "
          f"{args.latency:g} s; wall {wall:.1f} s; stop: {summary.stop_reason}")
    print(f"{'trial':>5} {'status':<8} {'description':<16} {'gap before (s)':>15}")
    gaps = []
    for previous, trial in zip([None, *trials], trials):
        gap = None
        if previous is not None and previous.get("finished_at") and trial.get("started_at"):
            gap = (datetime.fromisoformat(trial["started_at"]) - datetime.fromisoformat(previous["finished_at"])).total_seconds()
            gaps.append(gap)
        shown = "-" if gap is None else f"{gap:.3f}"
        print(f"{trial['number']:>5} {trial['status']:<8} {(trial['description'] or '')[:16]:<16} {shown:>15}")
    for message in events:
        print(f"  prefetch: {message}")
    if gaps:
        print(f"gap: median {statistics.median(gaps):.3f} s, mean {statistics.fmean(gaps):.3f} s, "
              f"max {max(gaps):.3f} s, min {min(gaps):.3f} s over {len(gaps)} gaps")
        ok = statistics.median(gaps) < 1.0
        print(f"target median < 1 s: {'met' if ok else 'NOT met'}" + (" (serial run: not expected)" if args.serial else ""))


if __name__ == "__main__":
    main()
