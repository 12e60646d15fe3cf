"""The fixture run of the review tests: a real tiny CPU run, made by the real Controller.

The repository's train.py is the fake training script (tests/fakes/fake_train.py) plus
a few lines that save a "checkpoint" (its constants, as JSON), so finalize has weights
to keep. Ideas are seeded so that the run has every outcome, in a known order:

    1 baseline keep        LR=0.02: 1.0906
    2 lr 0.015        keep     1.0310
    3 crash it        crash    (RuntimeError: CUDA out of memory (pretend))
    4 lr 0.01         keep     1.0000
    5 wider           discard  1.1000
    6 broken constant invalid  (syntax error)
    7 hang            timeout  (killed at the 1+2 s deadline)
    8 lr 0.012        discard  1.0063
    9 crash again     crash    (the same reason as 3)

plus one text-only idea that the ideas proposer leaves pending.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
from pathlib import Path

from conftest import FAKE_TRAIN, make_repo

TAG = "night"
CHECKPOINTING = '''

if __name__ == "__main__" and os.environ.get("AUTOLOOP_CHECKPOINT"):
    # The fake's "weights": enough to tell which trial's checkpoint was kept.
    with open(os.environ["AUTOLOOP_CHECKPOINT"], "w") as handle:
        json.dump({"LR": LR, "WIDTH": WIDTH}, handle)
'''
IDEAS = [
    ("lr 0.015", {"LR": "0.015"}),
    ("crash it", {"MODE": "'crash'"}),
    ("lr 0.01", {"LR": "0.01"}),
    ("wider", {"WIDTH": "128"}),
    ("broken constant", {"WIDTH": "(64"}),
    ("hang", {"MODE": "'hang'"}),
    ("lr 0.012", {"LR": "0.012"}),
    ("crash again", {"MODE": "'crash'", "LR": "0.03"}),
    ("try rotary embeddings", None),
]
EXPECTED = {  # number: (kind, status)
    1: ("baseline", "keep"), 2: ("proposal", "keep"), 3: ("proposal", "crash"), 4: ("proposal", "keep"),
    5: ("proposal", "discard"), 6: ("proposal", "invalid"), 7: ("proposal", "timeout"), 8: ("proposal", "discard"),
    9: ("proposal", "crash"),
}
GIT_ENV = {"GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "t@example.com"}


def build_run(root: Path) -> Path:
    """Make the repository and run the real controller over it; returns the repo path."""
    from autoloop.config import resolve
    from autoloop.controller import Controller
    from autoloop.store import Store

    repo = make_repo(root / "repo", FAKE_TRAIN.read_text() + CHECKPOINTING)
    config = resolve(repo, {"tag": TAG, "time_budget": 1, "grace_seconds": 2, "max_trials": 30,
                            "proposers": "ideas"})
    store = Store(repo / config.db)
    try:
        for text, sets in IDEAS:
            store.add_idea(text, sets=sets, source="human")
    finally:
        store.close()
    # verifier=None: the fake has no model to rebuild; its metric is the harness kind.
    summary = Controller(config, repo, verifier=None).run()
    assert summary.trials_run == len(EXPECTED), summary
    return repo


WRITER = """
import sys
from autoloop.config import resolve
from autoloop.controller import Controller

repo = sys.argv[1]
config = resolve(repo, {"tag": sys.argv[2], "time_budget": 1, "grace_seconds": 2, "max_trials": int(sys.argv[3]),
                        "proposers": "ideas", "allow_env_change": True})  # the harness may change meanwhile
Controller(config, repo, verifier=None).run()
"""


def copy_repo(source: Path, target: Path) -> Path:
    """A private copy of the fixture repository (git, db and .autoloop/) for a test
    that writes. The db's log and checkpoint paths still point into the original,
    which the review code reads only."""
    shutil.copytree(source, target, symlinks=True)
    return target


def db_rows(repo: Path, sql: str, params=()) -> list[dict]:
    """Read the db with plain sqlite3: the tests' independent view of the truth."""
    conn = sqlite3.connect(repo / "experiments.db")
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(sql, params).fetchall()]
    finally:
        conn.close()


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout
