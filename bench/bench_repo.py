"""A throwaway git repository holding a train script, for the benchmarks."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

GITIGNORE = ".autoloop/\nexperiments.db*\n__pycache__/\n"


def make_repo(path: Path, train_source: str, extra_files: dict[str, str] | None = None) -> Path:
    """`path` as a git repository with `train.py` (and `extra_files`) committed on main."""
    path.mkdir(parents=True)
    (path / "train.py").write_text(train_source)
    (path / ".gitignore").write_text(GITIGNORE)
    for name, content in (extra_files or {}).items():
        (path / name).write_text(content)
    env = {**os.environ, "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@example.com",
           "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@example.com"}
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "init"]):
        subprocess.run(["git", *args], cwd=path, check=True, env=env)
    return path
