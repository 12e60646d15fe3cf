"""What one LLM proposal sends: the prompt built for this repository's train.py and program.md.

    python bench/proposal_prompt.py [--trials 20]

Builds the messages the `llm` proposer sends (program.md as the system message; the brief
from autoloop.proposers.brief and the answer format as the user message), in a throwaway
repository holding this checkout's train.py and program.md, twice: at the first proposal
(only the baseline in the history) and after `--trials` proposals (one-constant changes,
as the search makes; the brief's table, themes and diffs are then full). Prints characters
and tokens: tiktoken's o200k_base count when tiktoken is installed (`pip install -e
'.[bpe]'`), else characters / 4. docs/night.md quotes its figures. A rejected answer sent
back for repair (`llm-max-repairs`) resends the whole conversation, so such a proposal
costs about twice this.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_repo import make_repo  # noqa: E402


def token_counter():
    """(count, name): tiktoken's o200k_base (GPT-4o/4.1's) when available, else characters / 4."""
    try:
        import tiktoken

        encoding = tiktoken.get_encoding("o200k_base")
        return (lambda text: len(encoding.encode(text, disallowed_special=()))), "tokens (tiktoken o200k_base)"
    except Exception:  # noqa: BLE001 - not installed, or no cached encoding offline
        return (lambda text: len(text) // 4), "tokens (characters / 4)"


def messages_for(repo_dir: Path, trials: int) -> list[dict]:
    from autoloop.config import resolve
    from autoloop.gitops import GitRepo
    from autoloop.proposers import ProposalContext
    from autoloop.proposers.brief import files_diff, read_program, render_context
    from autoloop.proposers.llm import ANSWER_FORMAT
    from autoloop.store import Store

    repo = GitRepo.open(repo_dir)
    source = (repo_dir / "train.py").read_text()
    constants = re.findall(r"^([A-Z][A-Z0-9_]*) = ([0-9.e-]+)", source, flags=re.M)
    store = Store(repo_dir / f"experiments-{trials}.db")
    try:
        run = store.create_run("bench", branch="autoloop/bench", base_commit=repo.head(), best_commit=repo.head(),
                               noise_sd=0.006, noise_pair_sd=0.004, noise_df=4)
        t = store.new_trial(run["id"], "baseline", description="baseline: the unmodified training script")
        store.update_trial(t["id"], status="keep", metric=1.80, metric_sd=0.003, n_runs=3)
        for i in range(trials):
            name, value = constants[i % len(constants)]
            changed = source.replace(f"\n{name} = {value}", f"\n{name} = {float(value) * 1.5:g}", 1)
            diff = files_diff({"train.py": changed}, lambda _path: source)
            t = store.new_trial(run["id"], "proposal", description=f"{name} {value} -> {float(value) * 1.5:g}",
                                diff=diff, best_before=1.80)
            store.update_trial(t["id"], status="discard", metric=1.80 + 0.001 * (i % 5), metric_sd=0.003, n_runs=2,
                               delta=0.001 * (i % 5), reason="not better than the incumbent at the same seeds")
        config = resolve(repo_dir, {"tag": "bench"})
        ctx = ProposalContext(config=config, store=store, run=store.get_run("bench"), repo=repo,
                              parent_commit=repo.head(), read_parent_file=repo.file_reader(repo.head()))
        program, _hash = read_program(repo_dir)
        user = render_context(ctx) + "\n" + ANSWER_FORMAT.format(path=config.editable[0],
                                                                 editable=", ".join(config.editable))
    finally:
        store.close()
    return [{"role": "system", "content": program or ""}, {"role": "user", "content": user}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="proposals in the history of the second prompt")
    args = parser.parse_args()
    count, unit = token_counter()
    with tempfile.TemporaryDirectory() as tmp:
        repo_dir = make_repo(Path(tmp) / "repo", (ROOT / "train.py").read_text(),
                             {"program.md": (ROOT / "program.md").read_text()})
        print(f"train.py {len((ROOT / 'train.py').read_text()):,} characters, "
              f"program.md {len((ROOT / 'program.md').read_text()):,} characters; counting {unit}")
        for trials in (0, args.trials):
            messages = messages_for(repo_dir, trials)
            text = "".join(m["content"] for m in messages)
            print(f"prompt after {trials:>3} proposals: {len(text):,} characters, {count(text):,} {unit.split()[0]} "
                  f"(system {count(messages[0]['content']):,}, user {count(messages[1]['content']):,})")


if __name__ == "__main__":
    main()
