"""A measurement's run folder: which stage may write where (the trust boundary, on disk).

Every measurement gets a folder the controller's side creates (`.autoloop/<tag>/trials/
<n>/runs/<k>/`). Its layout says who writes what; untrusted code (the trial's training, its
model under evaluation) gets exactly one writable place, and nothing trusted code reads,
binds or runs lies there unless it is read as untrusted data (autoloop.trust.untrusted):

    runs/<k>/
      out/             training's ONLY writable folder: result.json, checkpoint.pt,
                       progress.jsonl (the train-script contract's outputs); read back
                       without following links, within caps, validated; its bytes and
                       files bounded while training runs (autoloop.measure.limits), and
                       deleted when a trial goes over a limit
      compile/         training's own torch.compile cache, writable, fresh per run (seeded
                       from the run's trusted cache, see autoloop.measure.worker), deleted
                       after; bounded with out/
      feed/            the data feed's socket, read-only to training (connecting needs no write)
      data/            the dataset's meta-only view, read-only to training
      train.log        training's stdout and stderr, written by us from a pipe (never read back),
                       capped: past trial-log-mb the trial is stopped and the log cut to head and tail
      source/          the commit's editable files, written by us; read-only to the model process
      eval/, verify/   made fresh by each evaluation (autoloop.measure.evaluation): its log and
                       verdict, written by us; no stage can write there
      job.json, worker.log   the local executor's control files (process ids and the result
                       travel through the worker's own pipe, never through a file)

Inside the sandbox training sees only `out/` and `compile/` writable and `feed/`, `data/`
read-only; the rest of `.autoloop/` is hidden. Unsandboxed a trial can write anywhere its
user can, which is why every read of `out/` still refuses links and caps sizes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

OUT = "out"
RESULT = "result.json"
CHECKPOINT = "checkpoint.pt"
PROGRESS = "progress.jsonl"
LOG = "train.log"


class RunFolder:
    """The paths of one measurement's folder (see the module docstring)."""

    def __init__(self, root: Path | str):
        self.root = Path(root)

    @property
    def out(self) -> Path:
        return self.root / OUT

    @property
    def result(self) -> Path:
        return self.out / RESULT

    @property
    def checkpoint(self) -> Path:
        return self.out / CHECKPOINT

    @property
    def progress(self) -> Path:
        return self.out / PROGRESS

    @property
    def log(self) -> Path:
        return self.root / LOG

    @property
    def compile(self) -> Path:
        return self.root / "compile"

    @property
    def feed(self) -> Path:
        return self.root / "feed"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def source(self) -> Path:
        return self.root / "source"

    def evaluation(self, verify: bool) -> Path:
        return self.root / ("verify" if verify else "eval")

    def fresh(self, path: Path) -> Path:
        """`path` (one of ours, below the run folder) empty and new: an earlier attempt's
        copy is removed, never reused."""
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        return path

    def prepare_training(self) -> None:
        """The folders a training run needs, each new."""
        self.root.mkdir(parents=True, exist_ok=True)
        for path in (self.out, self.compile, self.feed):
            self.fresh(path)

    def writable(self) -> dict[str, Path]:
        """The folders training may write on disk, by the name a limit's reason gives them
        (autoloop.measure.limits)."""
        return {f"{OUT}/": self.out, "compile/": self.compile}

    def discard_outputs(self) -> None:
        """Delete what training wrote (a trial over a limit: its junk), links not followed."""
        for path in (self.out, self.compile):
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.exists():
                shutil.rmtree(path, ignore_errors=True)

    def has_checkpoint(self) -> bool:
        """A regular file at out/checkpoint.pt, looked at without following links."""
        try:
            return self.checkpoint.lstat().st_size > 0 and not self.checkpoint.is_symlink() \
                and self.checkpoint.is_file()
        except OSError:
            return False

