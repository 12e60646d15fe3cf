"""How big is the prompt an LLM proposal sends? Characters and estimated tokens.

Builds the llm proposer's first prompt of a night (program.md as the system message; the
brief from autoloop/proposers/brief.py with the editable train.py; the answer format) in a
throwaway repository holding this checkout's train.py and program.md, or those of `--rev`.
The brief's code is always this checkout's, so two revisions compare what they hand the
model. Tokens are estimated as characters / 4 (tiktoken is not a dependency); train.py's
share is counted alone too, since every proposal and every agent turn reads it whole.

    python bench/brief_size.py                 # this checkout
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


def prompt(train_source: str, program: str, tmp: Path) -> list[dict]:
    """The llm proposer's messages for the first proposal after a baseline."""
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
    args = parser.parse_args()
    train_source, program = _source(args.rev, "train.py"), _source(args.rev, "program.md")
    with tempfile.TemporaryDirectory() as tmp:
        messages = prompt(train_source, program, Path(tmp))
    total = sum(len(m["content"]) for m in messages)
    print(f"revision:          {args.rev or 'checkout'}")
    print(f"train.py:          {len(train_source.splitlines()):,} lines, {len(train_source):,} chars, "
          f"~{len(train_source) // 4:,} tokens")
    print(f"program.md:        {len(program):,} chars (the system message)")
    print(f"prompt (all):      {total:,} chars, ~{total // 4:,} tokens (chars / 4; tiktoken is not installed)")


if __name__ == "__main__":
    main()
