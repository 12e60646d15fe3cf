"""One real CPU night under the strict rule and under the default, at equal compute, then
both final bests re-measured at fresh seeds on val and held-out.

    python bench/night.py                                   # 40 runs a night at 60 steps: ~100 runs in all
    python bench/night.py --runs 12 --steps 20              # a small night: ~35 runs in all
    python bench/night.py --rules two-tier strict confirmed-only --keep /tmp/night
    python bench/night.py --arms scheduler model-only search-only --runs 16 --steps 20 --reserve 3
    python bench/night.py --arms scheduler model-only search-only --budget flops   # equal compute, not runs

With --arms (issue 33): the same night for three proposal arms under the first rule, at
equal compute, the model scripted (STRUCTURAL_EDITS below); the table and what the figures
showed are in docs/search.md. About 15 minutes an arm at that size on 2 shared cores.

Size: 2 x --runs training runs, plus the reserve (the best and the baseline at --reserve
fresh seeds, for each rule: up to 4 x --reserve runs). On 2 idle CPU cores a 60-step run
takes ~25 s of training and ~15-25 s of evaluation, verification and start-up, so the
default is ~100 runs, about 1.5 hours; on a machine shared with other work several times
that (a 4-run, 8-step smoke night took 20 minutes here under a load of 8). The search
grows the model as the night goes (widths double, then quadruple on a success): unbounded,
a late 60-step run of a 1024-wide model took 15 minutes, so the CPU block's sizes are
bounded (`CPU_BOUNDS`; `--unbounded` lifts them). `--runs 30 --steps 40`, the two rules
side by side (`--rules two-tier` beside `--rules strict`, OMP_NUM_THREADS=1 each): 20
minutes a night and 8 a reserve (docs/decisions.md, "A real CPU night").

Each rule gets a fresh git repository with this checkout's train.py and runs the
built-in search proposer (`proposers = ["search"]`) in step mode (deterministic runs:
the same commit at the same seed gives the same val_bpb), through the public controller
API: `Controller(resolve(repo, {...}), repo).run()`, one trial per call, until the night
has spent `--runs` training runs (every measurement of the run counts, an early-stopped
one by the fraction of the steps it ran). With `--budget flops` a run counts by its model
FLOPs over the baseline's (`compute_spent`): a run of a model the search grew to four
times the baseline's compute counts 4, so arms that grow the model and arms that do not
spend the same compute, which counting runs does not give (docs/search.md). The first rule's night sets the count; every
later rule runs to exactly the same count where its trials allow (strict: one run each).
Drift checks are off (they would spend runs on neither rule's proposals); `check` is off.

Then the reserve (autoloop/decide/remeasure.py): the final best and the baseline, each at
`--reserve` fresh seeds that no decision used, measured with verification (val and
held-out), through the run's own controller (`Controller.measure_commit`).

Printed per rule: runs spent, trials, kept, the reported gain (what `autoloop best`
shows today: the baseline's mean minus the best's selection mean), the re-measured gain
on val and on held-out (fresh seeds, paired with the baseline, ± standard error), and
reported / re-measured. Targets (issue 19): the default's re-measured gain >= strict's;
the default's reported gain within 2 standard errors of its re-measured one.

The default's night stops clear losers early (autoloop.loop.stops): a stopped run is a
measurement with status "stopped", counted by the fraction of the budget it ran
(`trials.stopped_at`).

The data: the embedded corpus of a fixed key (`--corpus-key`, the tests' by default),
prepared in the work folder's own cache, never yours. Before, a night read the machine's
cache, whose key is random per machine: nights of one check run on two machines trained on
two different corpora, so a night could only be compared with nights of the same machine
(the third check's first night could not be set beside the second check's, docs/search.md).
With a fixed key, step mode gives the same night on any CPU of the same code.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoloop.config import resolve  # noqa: E402
from autoloop.harness.corpus_key import corpus_key_path, write_key  # noqa: E402
from readme_first_command import corpus_key_bytes  # noqa: E402  (bench/ is on the path: a script's folder)
from autoloop.loop.controller import Controller  # noqa: E402
from autoloop.loop.scheduler import UNTRIED_IN_A_ROW  # noqa: E402
from autoloop.decide.remeasure import headline, reserve_seeds  # noqa: E402
from autoloop.store import Store  # noqa: E402

GIT_ENV = {"GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@example.com",
           "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@example.com"}


# A 2-core CPU cannot train what an unbounded search grows to: in the first night of
# docs/decisions.md strict's best was a 1024-wide model (15 minutes a 60-step run) and its
# next proposal 16384 wide (13 GB). The bench measures the rules, not the CPU, so the CPU
# block's sizes get a range hint (autoloop/proposers/search_space.py): up to 256 wide, 4
# deep and 16,384 tokens a step, 4x, 2x and 8x train.py's CPU scale (the default's best in
# that night, width 256, depth 3, 16,384 tokens, is inside). `--unbounded` leaves train.py
# as it is.
CPU_BOUNDS = {"    DEPTH = 2": "range 1..4 int",
              "    MODEL_DIM = 64": "range 32..256 pow2",
              "    TOTAL_BATCH_TOKENS = 8 * 256": "range 1024..16384 pow2"}


def bounded(source: str) -> str:
    """train.py with CPU_BOUNDS's hints on the CPU block's lines (each must be there)."""
    lines = source.splitlines(keepends=True)
    for start, hint in CPU_BOUNDS.items():
        (i,) = [k for k, line in enumerate(lines) if line.startswith(start + " ") or line.rstrip() == start]
        code, _, comment = lines[i].rstrip("\n").partition("#")
        lines[i] = f"{code.rstrip()}  # {comment.strip() + '; ' if comment.strip() else ''}{hint}\n"
    return "".join(lines)


def make_repo(path: Path, unbounded: bool = False) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    source = (ROOT / "train.py").read_text()
    (path / "train.py").write_text(source if unbounded else bounded(source))
    (path / ".gitignore").write_text(".autoloop/\nexperiments.db*\n__pycache__/\n")
    env = {**os.environ, **GIT_ENV}
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "init"]):
        subprocess.run(["git", *args], cwd=path, check=True, env=env)
    return path


def flags(rule: str, steps: int, seed: int, extra: dict | None = None) -> dict:
    # One trial per call (the night is counted in runs), so the loop's own end-of-night
    # reserve is off: reserve() below measures it once, for both sides. The early stop is
    # the default's, not strict's (autoresearch never stops a run). `extra`: an arm's
    # proposers and schedule (--arms).
    return {"tag": "night", "max_steps": steps, "time_budget": 600, "grace_seconds": 600, "seed": seed,
            "proposers": "search", "decision_rule": rule, "drift_every": 0, "check": False, "max_trials": 1,
            "reserve_seeds": 0, "early_stop": rule != "strict", **(extra or {})}


def runs_spent(store: Store, run_id: int, steps: int) -> float:
    """Training runs the night spent: every measurement, an early-stopped one (fewer steps
    than the budget) by its fraction."""
    total = 0.0
    for trial in store.trials(run_id):
        for m in store.measurements(trial["id"]):
            if m.get("status") == "stopped":  # stopped early: the fraction of the budget it ran
                total += trial.get("stopped_at") or 1.0
                continue
            n = m.get("num_steps")
            total += min(1.0, n / steps) if n else 1.0
    return total


UNITS = {"runs": "runs", "flops": "baseline runs' compute"}


@functools.lru_cache(maxsize=None)  # a commit's cost never changes, and a night asks for it every trial
def run_flops(repo: Path, commit: str, steps: int) -> float:
    """The model FLOPs of one full run of `commit`'s train.py at `steps` steps: the harness's
    own count (autoloop.harness.flops_per_token: 6 per matmul weight plus causal attention)
    of the model its CPU block builds, on the meta device (no weights, no training), times
    the tokens of `steps` optimizer steps. Read from the code, not from the run, so a run
    stopped early or lost costs what it would have."""
    from autoloop import harness as H

    source = subprocess.run(["git", "show", f"{commit}:train.py"], cwd=repo, check=True, capture_output=True,
                            text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.py"
        path.write_text(source)
        module = H.import_train_module(path)
        model = module.build_model(module.model_config(), device="meta")
        return float(H.flops_per_token(model)) * module.TOTAL_BATCH_TOKENS * steps


def compute_spent(store: Store, run_id: int, steps: int, repo: Path) -> float:
    """The night's training compute in runs of the baseline's size (`--budget flops`): each
    measurement costs its commit's `run_flops` over the baseline's, an early-stopped one by
    the fraction of the budget it ran, as in `runs_spent`. A search that grows the model
    pays for it here; counted in runs, a run of a model 8 times the baseline's costs 1."""
    trials = store.trials(run_id)
    base = run_flops(repo, next(t for t in trials if t["kind"] == "baseline")["trial_commit"], steps)
    total = 0.0
    for trial in trials:
        runs = store.measurements(trial["id"])
        if not runs:  # a proposal never trained (a duplicate, an edit that changed nothing): no commit to cost
            continue
        cost = run_flops(repo, trial["trial_commit"], steps) / base
        for m in runs:
            if m.get("status") == "stopped":
                total += cost * (trial.get("stopped_at") or 1.0)
                continue
            n = m.get("num_steps")
            total += cost * (min(1.0, n / steps) if n else 1.0)
    return total


def night(repo: Path, rule: str, steps: int, seed: int, target: float, say, extra: dict | None = None,
          name: str | None = None, budget: str = "runs") -> dict:
    """Trials until `target` runs are spent (or the proposer runs dry). `budget` "flops":
    `target` counts runs of the baseline's size (compute_spent), not runs (runs_spent)."""
    config = resolve(repo, flags(rule, steps, seed, extra))
    rule = name or rule
    spent, trials, started = 0.0, 0, time.monotonic()
    runs = 0.0
    untried = 0  # trials in a row that spent no run: the loop's own stop (UNTRIED_IN_A_ROW) counts
    # within one invocation, and this night invokes the controller once a trial
    while spent < target - 1e-9:
        summary = Controller(config, repo).run()
        trials += summary.trials_run
        store = Store(repo / "experiments.db")
        try:
            run = store.get_run("night")
            before, runs = spent, runs_spent(store, run["id"], steps)
            spent = compute_spent(store, run["id"], steps, repo) if budget == "flops" else runs
        finally:
            store.close()
        cost = f", {spent:.2f} in baseline runs' compute" if budget == "flops" else ""
        say(f"  {rule}: {trials} trials, {runs:.2f} runs{cost} ({time.monotonic() - started:.0f} s)")
        if run["status"] == "stopped":  # Ctrl-C or SIGTERM: the controller stopped; so does the night
            raise SystemExit(f"{rule}: stopped by a signal after {spent:.2f} runs")
        if summary.trials_run == 0:
            say(f"  {rule}: no trial ran ({summary.stop_reason}); the night ends here")
            break
        untried = untried + 1 if spent == before else 0
        if untried >= UNTRIED_IN_A_ROW:
            say(f"  {rule}: {untried} proposals in a row could not be tried; the night ends here, at {spent:.2f} runs")
            break
    figures = {"trials": trials, "runs": runs, "seconds": time.monotonic() - started, "budget": budget}
    if budget == "flops":
        figures["compute"] = spent  # in runs of the baseline's size
    return figures


def reserve(repo: Path, rule: str, steps: int, seed: int, k: int, say, extra: dict | None = None,
            name: str | None = None) -> dict:
    """The final best and the baseline at k fresh seeds, val and held-out; the figures."""
    config = resolve(repo, {**flags(rule, steps, seed, extra), "max_trials": None})
    rule = name or rule
    controller = Controller(config, repo)
    controller.open()
    try:
        store, run_id = controller.store, controller.run_row["id"]
        rows = store.trials(run_id)
        base = next(t for t in rows if t["kind"] == "baseline")
        best = store.best_trial(run_id)
        kept = sum(1 for t in rows if t["status"] == "keep" and t["kind"] != "baseline")
        same = best["id"] == base["id"]
        # The night's noise before the reserve: the best's selected decision run would
        # inflate the spread of a group that also holds its reserve runs.
        noise = controller.update_noise()
        val = {"best": {}, "baseline": {}}
        held = {"best": {}, "baseline": {}}
        for s in reserve_seeds(config.seed, k):
            for side, trial in (("best", best),) + ((("baseline", base),) if not same else ()):
                m = controller.measure_commit(trial["trial_commit"], s, owner=trial, role="reserve", verify=True)
                if not m.ok:
                    raise SystemExit(f"{rule}: the {side} failed at reserve seed {s}: {m.reason}")
                val[side][s], held[side][s] = m.metric, m.heldout
                say(f"  {rule}: reserve seed {s}, {side}: val {m.metric:.5f}, held-out {m.heldout:.5f}")
        if same:
            val["baseline"], held["baseline"] = val["best"], held["best"]
        seeds = reserve_seeds(config.seed, k)
        hv = headline(val["best"], val["baseline"], noise, seeds=seeds, same_commit=same)
        hh = headline(held["best"], held["baseline"], None, seeds=seeds, same_commit=same)
        reported = (base["metric"] - best["metric"]) if not same else 0.0
        return {"rule": rule, "kept": kept, "best_trial": best["number"], "reported_gain": reported,
                "val": hv.to_json(), "heldout": hh.to_json(),
                "best_selection_metric": best["metric"], "baseline_selection_metric": base["metric"]}
    finally:
        controller.close()


def report(rows: list[dict]) -> str:
    lines = [f"{'rule':<16} {'runs':>6} {'trials':>6} {'kept':>4} {'reported gain':>13} "
             f"{'re-measured val':>19} {'held-out':>19} {'reported/val':>12} {'(rep-val)/se':>12}"]
    for r in rows:
        v, h = r["val"], r["heldout"]
        ratio = r["reported_gain"] / v["gain"] if v["gain"] else float("nan")
        z = (r["reported_gain"] - v["gain"]) / v["gain_se"] if v.get("gain_se") else float("nan")
        lines.append(f"{r['rule']:<16} {r['runs']:>6.2f} {r['trials']:>6} {r['kept']:>4} {r['reported_gain']:>+13.5f} "
                     f"{v['gain']:>+9.5f} ± {v['gain_se'] or 0:.5f} {h['gain']:>+9.5f} ± {h['gain_se'] or 0:.5f} "
                     f"{ratio:>12.2f} {z:>+12.2f}")
    by = {r["rule"]: r for r in rows}
    if "strict" in by and len(rows) > 1:
        default = next(r for r in rows if r["rule"] != "strict")
        lines.append("")
        lines.append(f"target: {default['rule']}'s re-measured gain >= strict's: "
                     f"{default['val']['gain']:+.5f} vs {by['strict']['val']['gain']:+.5f} -> "
                     f"{'met' if default['val']['gain'] >= by['strict']['val']['gain'] else 'NOT MET'}")
        z = abs(default["reported_gain"] - default["val"]["gain"]) / (default["val"]["gain_se"] or float("inf"))
        lines.append(f"target: {default['rule']}'s reported gain within 2 se of its re-measured one: "
                     f"{z:.2f} se -> {'met' if z <= 2 else 'NOT MET'}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- --arms
# Three arms at equal compute on the real train.py in step mode (issue 33): the model
# alone, the search alone, and the scheduler over both (`schedule = "yield"`). The model is
# scripted: a local OpenAI-compatible server (tests/fakes/fake_openai.py) answering, in
# this order, the first edit of STRUCTURAL_EDITS whose text is in the file it was sent
# and not yet answered; the list interleaves structural edits of the model (code, not
# constants; on a CPU they change the CPU block's small model) with constant tweaks, as
# models do. When the list is spent it grinds the learning rates (x1.5, /1.5, then wider
# steps, in turn), as the agents of a public nanoGPT speed-run were seen to do, never
# answering a change it already answered from the same value (the brief lists what was
# tried; the first version repeated itself once its grid was spent, which a real model
# reading the brief would not, and its night never ended). My guess at each edit's effect
# on the CPU block at 20-40 steps is its last field; what it did is printed per arm.
STRUCTURAL_EDITS = [
    ("relu squared to GELU in the MLP",
     "        return self.c_proj(F.relu(self.c_fc(x)).square())",
     "        return self.c_proj(F.gelu(self.c_fc(x)))", "harmful"),
    ("Muon momentum at its full value from step 0: a short run has no time to ramp it",
     "    frac = min(step / MUON_MOMENTUM_WARMUP_STEPS, 1.0) if MUON_MOMENTUM_WARMUP_STEPS > 0 else 1.0",
     "    frac = 1.0", "helpful"),
    ("MATRIX_LR 0.04 -> 0.06 (a constant tweak)",
     "MATRIX_LR = 0.04  # Muon learning rate; range 0.001..0.5 log",
     "MATRIX_LR = 0.06  # Muon learning rate; range 0.001..0.5 log", "constant"),
    ("no final norm before the head",
     "            x = block(x, cos, sin)\n        x = norm(x)\n",
     "            x = block(x, cos, sin)\n", "harmful"),
    ("warm-down as the square root of the linear one: the LR stays high longer",
     "    decay = (1.0 - progress) / WARMDOWN_RATIO",
     "    decay = ((1.0 - progress) / WARMDOWN_RATIO) ** 0.5", "helpful"),
    ("random instead of zero output projections",
     "            nn.init.zeros_(block.attn.c_proj.weight)\n            nn.init.zeros_(block.mlp.c_proj.weight)",
     "            nn.init.uniform_(block.attn.c_proj.weight, -bound, bound)\n"
     "            nn.init.uniform_(block.mlp.c_proj.weight, -bound, bound)", "harmful"),
    ("WARMDOWN_RATIO 0.5 -> 0.3 (a constant tweak)",
     "WARMDOWN_RATIO = 0.5  # linear LR decay at the end",
     "WARMDOWN_RATIO = 0.3  # linear LR decay at the end", "constant"),
    ("attention and MLP in parallel on one norm",
     "        x = x + self.attn(norm(x), cos, sin)\n        return x + self.mlp(norm(x))",
     "        h = norm(x)\n        return x + self.attn(h, cos, sin) + self.mlp(h)", "neutral"),
    ("the embedding's AdamW LR not scaled up at narrow widths",
     '        {"params": embedding, "lr": EMBEDDING_LR * width_scale, "name": "embedding"},',
     '        {"params": embedding, "lr": EMBEDDING_LR, "name": "embedding"},', "harmful"),
]
GRIND = ("MATRIX_LR", "EMBEDDING_LR", "UNEMBEDDING_LR")
GRIND_FACTORS = (1.5, 1 / 1.5, 2.0, 0.5, 1.25, 0.8, 3.0, 1 / 3)

ARMS = {
    "model-only": {"proposers": "llm", "schedule": "chain"},
    "search-only": {"proposers": "search", "schedule": "chain"},
    "scheduler": {"proposers": "llm,search", "schedule": "yield"},
}


class ScriptedModel:
    """The scripted model's answers: a callable for FakeOpenAI (one per arm: it remembers
    what it answered)."""

    def __init__(self):
        self.used: set[int] = set()
        self.grinds = 0
        self.answered: set[tuple[str, str, str]] = set()  # (constant, from, to) of each grind answered

    def __call__(self, body: dict) -> str:
        import re

        from fakes.fake_openai import edit_answer

        sent = "\n".join(m["content"] for m in body["messages"] if m["role"] == "user")
        for i, (what, old, new, _) in enumerate(STRUCTURAL_EDITS):
            if i not in self.used and old in sent:
                self.used.add(i)
                return edit_answer(old, new, what)
        # (constant, factor) in turn: each constant x1.5, then each /1.5, then x2, ...
        grid = [(name, factor) for factor in GRIND_FACTORS for name in GRIND]
        for _ in range(len(grid)):
            name, factor = grid[self.grinds % len(grid)]
            self.grinds += 1
            line = re.search(rf"^{name} = ([0-9.e+-]+)(.*)$", sent, re.M)
            if line:
                value = float(line.group(1))
                change = (name, line.group(1), f"{value * factor:.3g}")
                if change in self.answered or change[1] == change[2]:
                    continue
                self.answered.add(change)
                return edit_answer(line.group(0), f"{name} = {change[2]}{line.group(2)}", f"{name} x{factor:.3g}")
        return "I have nothing more to propose."


def arm_settings(arm: str, base_url: str) -> dict:
    extra = dict(ARMS[arm])
    if "llm" in extra["proposers"]:
        # The scripted model never fails, so no waits; a model that did would be left alone.
        extra.update(llm_model="scripted", llm_base_url=base_url, llm_retries=0, llm_outage_wait=0,
                     llm_retry_wait=3600)
    return extra


def sources_of(repo: Path) -> dict:
    """The arm's proposals per proposer, kept per proposer, and what each scripted edit did."""
    store = Store(repo / "experiments.db")
    try:
        rows = [t for t in store.trials(store.get_run("night")["id"]) if t["kind"] in ("proposal", "repair")]
    finally:
        store.close()
    by: dict[str, list[int]] = {}
    for t in rows:
        counts = by.setdefault(t["proposer"] or "?", [0, 0])
        counts[0] += 1
        counts[1] += t["status"] == "keep"
    edits = {}
    for what, *_ in STRUCTURAL_EDITS:
        hit = next((t for t in rows if what in (t.get("description") or "")), None)
        if hit is not None:
            effect = (hit["metric"] - hit["best_before"]) if hit.get("metric") is not None and hit.get("best_before") else None
            edits[what] = {"status": hit["status"], "proposer": hit["proposer"], "delta": effect}
    return {"sources": by, "edits": edits}


def arms_report(rows: list[dict]) -> str:
    flops = any("compute" in r for r in rows)
    lines = [f"{'arm':<12} {'runs':>6} " + (f"{'compute':>7} " if flops else "")
             + f"{'trials':>6} {'kept':>4} {'re-measured val gain':>22} {'held-out gain':>20}  proposals (kept) by source"]
    for r in rows:
        v, h = r["val"], r["heldout"]
        src = ", ".join(f"{k} {n} ({kept})" for k, (n, kept) in sorted(r["sources"].items()))
        compute = f"{r.get('compute', float('nan')):>7.2f} " if flops else ""
        lines.append(f"{r['rule']:<12} {r['runs']:>6.2f} {compute}{r['trials']:>6} {r['kept']:>4} "
                     f"{v['gain']:>+11.5f} ± {v['gain_se'] or 0:.5f} {h['gain']:>+10.5f} ± {h['gain_se'] or 0:.5f}  {src}")
    by = {r["rule"]: r for r in rows}
    if {"scheduler", "model-only", "search-only"} <= set(by):
        sched = by["scheduler"]
        better = max((by["model-only"], by["search-only"]), key=lambda r: r["val"]["gain"])
        se = ((sched["val"]["gain_se"] or 0) ** 2 + (better["val"]["gain_se"] or 0) ** 2) ** 0.5
        ahead = sched["val"]["gain"] - better["val"]["gain"]
        lines.append("")
        lines.append(f"target: the scheduler ahead of the better arm ({better['rule']}) by at least one standard error "
                     f"of the difference: {ahead:+.5f} vs se {se:.5f} -> {'met' if se and ahead >= se else 'NOT MET'}")
    lines.append("")
    lines.append("the scripted edits (guess -> status, change of val_bpb from the incumbent, per arm):")
    for what, _, _, guess in STRUCTURAL_EDITS:
        cells = []
        for r in rows:
            e = r["edits"].get(what)
            if e is not None:
                d = f"{e['delta']:+.4f}" if e["delta"] is not None else "-"
                cells.append(f"{r['rule']}: {e['status']} {d} ({e['proposer']})")
        lines.append(f"  [{guess}] {what}: " + ("; ".join(cells) or "not tried"))
    return "\n".join(lines)


def tests_corpus_key() -> str:
    """The tests' corpus key, the nights' default: every night reads the same text."""
    return corpus_key_bytes("tests").hex()


def use_corpus(work: Path, key_hex: str) -> Path:
    """Point this process (and every run it starts) at a cache in `work` holding the corpus
    key `key_hex`; a work folder kept from a night with another key is refused."""
    key = corpus_key_bytes(key_hex)
    cache = work / "cache"
    path = corpus_key_path(cache)
    if path.exists() and path.read_bytes() != key:
        sys.exit(f"{work} holds a night of another corpus key: use a new --keep folder")
    if not path.exists():
        write_key(path, key)
    os.environ["AUTOLOOP_CACHE_DIR"] = str(cache)
    return cache


def run_arms(args, work: Path, say) -> list[dict]:
    sys.path.insert(0, str(ROOT / "tests"))
    from fakes.fake_openai import FakeOpenAI

    rows, target = [], args.runs
    for arm in args.arms:
        repo = make_repo(work / arm, args.unbounded)
        with FakeOpenAI([ScriptedModel()], model="scripted") as server:
            extra = arm_settings(arm, server.base_url)
            say(f"{arm}: night of {target:g} {UNITS[args.budget]} at {args.steps} steps in {repo}")
            spent = night(repo, args.rules[0], args.steps, args.seed, target, say, extra, name=arm, budget=args.budget)
            if not rows:  # the later arms match the first night's exact count
                target = spent["compute" if args.budget == "flops" else "runs"]
            row = reserve(repo, args.rules[0], args.steps, args.seed, args.reserve, say, extra, name=arm)
        rows.append({**row, **spent, **sources_of(repo)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=float, default=40,
                    help="Training runs a night (the equal compute); with --budget flops, runs of the baseline's size.")
    ap.add_argument("--budget", choices=list(UNITS), default="runs",
                    help="What a night's --runs counts: runs (each run 1, whatever its model), or flops (each run by "
                         "its model FLOPs over the baseline's, so a search that grows the model pays for it).")
    ap.add_argument("--steps", type=int, default=60, help="Training steps per run (step mode).")
    ap.add_argument("--reserve", type=int, default=4, help="Fresh seeds the final bests are re-measured at.")
    ap.add_argument("--seed", type=int, default=1337, help="The runs' base seed.")
    ap.add_argument("--rules", nargs="+", default=["two-tier", "strict"],
                    help="Decision rules, the default first (its night sets the run count).")
    ap.add_argument("--arms", nargs="+", choices=list(ARMS),
                    help="Instead of comparing rules: these proposal arms under the first rule, at equal compute "
                         "(model-only, search-only, scheduler; the model is scripted, see STRUCTURAL_EDITS).")
    ap.add_argument("--keep", type=Path, help="Work in this folder and keep it (default: a temporary one).")
    ap.add_argument("--corpus-key", default=tests_corpus_key(),
                    help="The embedded corpus's key, 64 hex digits or `tests` (default: the tests' key, so that nights compare "
                         "across machines).")
    ap.add_argument("--json", type=Path, help="Also write the figures here.")
    ap.add_argument("--unbounded", action="store_true",
                    help="Leave train.py's CPU sizes unbounded (the search may grow a model past what the CPU trains).")
    args = ap.parse_args()

    def say(text: str) -> None:
        print(text, flush=True)

    work = args.keep or Path(tempfile.mkdtemp(prefix="night-"))
    work.mkdir(parents=True, exist_ok=True)
    use_corpus(work, args.corpus_key)
    if args.arms:
        rows = run_arms(args, work, say)
        print()
        print(arms_report(rows))
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return 0
    rows, target = [], args.runs
    for rule in args.rules:
        repo = make_repo(work / rule, args.unbounded)
        say(f"{rule}: night of {target:g} {UNITS[args.budget]} at {args.steps} steps in {repo}")
        spent = night(repo, rule, args.steps, args.seed, target, say, budget=args.budget)
        if not rows:  # the later rules match the first night's exact count
            target = spent["compute" if args.budget == "flops" else "runs"]
        row = reserve(repo, rule, args.steps, args.seed, args.reserve, say)
        rows.append({**row, **spent})
    print()
    print(report(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if not args.keep:
        print(f"(work folder {work} left for inspection; delete it when done)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
