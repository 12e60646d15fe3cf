"""How big is the prompt an LLM proposal sends? Characters and estimated tokens.

Builds the llm proposer's prompt (program.md as the system message; the brief from
autoloop/proposers/brief.py with the editable train.py; the answer format) in a throwaway
repository holding this checkout's train.py and program.md, or those of `--rev`. The
brief's code is always this checkout's, so two revisions compare what they hand the model.
Tokens are estimated as characters / 4 (tiktoken is not a dependency); train.py's share is
counted alone too, since every proposal and every agent turn reads it whole.

By default the prompt is the night's first (only the baseline in the db). `--trials N`
builds a night of N trials first (one-constant changes of train.py, kept and discarded,
each with a recorded 256-point loss curve, steps, tokens/s, MFU, peak memory and timings
beside its incumbent's) and an earlier tag of N trials in the same db, so the brief carries
its telemetry and its memory of the earlier run in full; the figures of each section and
the budget (autoloop.proposers.brief.BRIEF_BUDGET_TOKENS) are printed.

    python bench/brief_size.py                 # this checkout, the first prompt
    python bench/brief_size.py --trials 100    # after 100 trials, with an earlier tag of 100
    python bench/brief_size.py --rev HEAD~1    # another commit's train.py and program.md
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_repo import make_repo

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _source(rev: str | None, name: str) -> str:
    if rev is None:
        return (ROOT / name).read_text()
    return subprocess.run(["git", "show", f"{rev}:{name}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def _record_night(store, repo, tag: str, trials: int, source: str, seed: int = 1) -> None:
    """`trials` one-constant proposals on the base commit (every fourth kept), each with a
    candidate run at `seed` and its curve, beside the baseline's run at the same seed."""
    import re

    from autoloop.proposers.brief import files_diff

    base = repo.head()
    constants = re.findall(r"^([A-Z][A-Z0-9_]*) = ([0-9.e-]+)", source, flags=re.M)
    run = store.create_run(tag, branch=f"autoloop/{tag}", base_commit=base, best_commit=base,
                           noise_sd=0.006, noise_pair_sd=0.004, noise_df=4)

    def curve(offset: float) -> list[dict]:
        return [{"step": k, "seconds": 300.0 * (k + 1) / 256, "loss": 3.0 - k / 256 + offset * k / 256,
                 "lr": 1.0} for k in range(256)]

    b = store.new_trial(run["id"], "baseline", description="baseline: the unmodified training script",
                        trial_commit=base, seed=seed)
    store.add_measurement(b["id"], 1.80, seed=seed, role="baseline", status="ok", num_steps=1500,
                          tokens_per_second=480_000.0, curve=curve(0.0))
    store.update_trial(b["id"], status="keep", tier="baseline", metric=1.80, metric_sd=0.003, n_runs=3,
                       num_steps=1500, mfu_percent=38.0, peak_memory_mb=24_000.0, training_seconds=300.0,
                       compile_seconds=25.0, eval_seconds=6.0, wall_seconds=340.0, result={"eval_seconds": 0.0})
    for i in range(trials):
        name, value = constants[i % len(constants)]
        new = f"{float(value) * (1.5 if i % 2 else 0.5):g}"
        changed = source.replace(f"\n{name} = {value}", f"\n{name} = {new}", 1)
        diff = files_diff({"train.py": changed}, lambda _path: source)
        kept = i % 4 == 0
        effect = -0.004 if kept else 0.001 * (i % 7)
        t = store.new_trial(run["id"], "proposal", description=f"{name} {value} -> {new}", diff=diff,
                            best_before=1.80, parent_commit=base, seed=seed, proposer="llm")
        store.add_measurement(t["id"], 1.80 + effect, seed=seed, role="candidate", status="ok",
                              num_steps=1500 - 10 * (i % 9), tokens_per_second=480_000.0 - 3000 * (i % 9),
                              curve=curve(effect * 2))
        store.update_trial(t["id"], status="keep" if kept else "discard", tier="adopted" if kept else None,
                           metric=1.80 + effect, metric_sd=0.003, n_runs=2, delta=effect,
                           decision={"incumbent_id": b["id"], "mean_diff": effect, "se": 0.002, "n": 2,
                                     "low": effect - 0.005, "high": effect + 0.005,
                                     "distinguishable": kept, "near_miss": False},
                           reason="not better than the incumbent at the same seeds" if not kept else "better",
                           num_steps=1500 - 10 * (i % 9), mfu_percent=37.5, peak_memory_mb=24_000.0 + 100 * (i % 5),
                           training_seconds=300.0, compile_seconds=25.0, eval_seconds=6.0, wall_seconds=341.0,
                           result={"eval_seconds": 0.0})


def prompt(train_source: str, program: str, tmp: Path, trials: int = 0) -> list[dict]:
    """The llm proposer's messages: the first proposal after a baseline, or (`trials` > 0)
    the next after a night of `trials` trials with an earlier tag of as many in the db."""
    from autoloop.config import resolve
    from autoloop.gitops import GitRepo
    from autoloop.proposers import ProposalContext
    from autoloop.proposers.brief import render_context
    from autoloop.proposers.llm import ANSWER_FORMAT
    from autoloop.store import Store

    repo_dir = make_repo(tmp / "repo", train_source, {"program.md": program})
    store = Store(repo_dir / "experiments.db")
    try:
        repo = GitRepo.open(repo_dir)
        if trials:
            _record_night(store, repo, "earlier", trials, train_source)
            _record_night(store, repo, "brief", trials, train_source)
        else:
            run = store.create_run("brief", branch="autoloop/brief", base_commit=repo.head(), best_commit=repo.head())
            baseline = store.new_trial(run["id"], "baseline", description="baseline")
            store.update_trial(baseline["id"], status="keep", metric=2.45)
        config = resolve(repo_dir, {"tag": "brief"})
        ctx = ProposalContext(config=config, store=store, run=store.get_run("brief"), repo=repo,
                              parent_commit=repo.head(), read_parent_file=repo.file_reader(repo.head()))
        user = render_context(ctx)
    finally:
        store.close()
    answer = ANSWER_FORMAT.format(path=config.editable[0], editable=", ".join(config.editable))
    return [{"role": "system", "content": program}, {"role": "user", "content": user + "\n" + answer}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", help="a git revision whose train.py and program.md to measure (default: the checkout)")
    parser.add_argument("--trials", type=int, default=0,
                        help="trials in the night before the prompt, and in an earlier tag of the same db (default 0)")
    args = parser.parse_args()
    train_source, program = _source(args.rev, "train.py"), _source(args.rev, "program.md")
    with tempfile.TemporaryDirectory() as tmp:
        messages = prompt(train_source, program, Path(tmp), args.trials)
    from autoloop.proposers.brief import BRIEF_BUDGET_TOKENS

    total = sum(len(m["content"]) for m in messages)
    user = messages[1]["content"]
    print(f"trials:            {args.trials} in this run, {args.trials} in an earlier tag")
    added = 0
    for label, heading in (("telemetry:", "# How the recent trials ran"),
                           ("memory:", "# What earlier runs of this project established")):
        part = section(user, heading)
        added += len(part)
        print(f"{label:<19}{len(part):,} chars, ~{len(part) // 4:,} tokens")
    print(f"revision:          {args.rev or 'checkout'}")
    print(f"train.py:          {len(train_source.splitlines()):,} lines, {len(train_source):,} chars, "
          f"~{len(train_source) // 4:,} tokens")
    print(f"program.md:        {len(program):,} chars (the system message)")
    print(f"prompt (all):      {total:,} chars, ~{total // 4:,} tokens (chars / 4; tiktoken is not installed)")
    print(f"without those two: {total - added:,} chars, ~{(total - added) // 4:,} tokens")
    print(f"budget:            {BRIEF_BUDGET_TOKENS:,} tokens: {'fits' if total // 4 <= BRIEF_BUDGET_TOKENS else 'OVER'}")


def section(text: str, heading: str) -> str:
    """One `# ...` section of the brief, its heading included ('' when absent)."""
    start = text.find(heading)
    if start < 0:
        return ""
    end = text.find("\n\n# ", start + 1)
    return text[start:] if end < 0 else text[start:end]


if __name__ == "__main__":
    main()
