"""The harness's bytecode, kept where no trial can write it.

Bytecode (why every child gets PYTHONPYCACHEPREFIX, `pycache_env`)
    Python trusts a .pyc in `__pycache__` whose header carries the source's mtime and
    size, so a trial that writes a poisoned `autoloop/harness/__pycache__/metric.*.pyc`
    with the real file's mtime and size would change every later evaluation. With
    PYTHONPYCACHEPREFIX set, Python neither reads nor writes `__pycache__` beside the
    sources: it uses the prefix folder. Training and evaluation get separate prefixes
    under the controller's cache: training's is writable by training (its own cache; its
    harness part is written first by `warm_pycache` and then watched by the integrity
    snapshot); the evaluator's is written only by `warm_pycache` (a trusted process that imports
    the harness and torch, no trial code) and is read-only for the evaluator
    (PYTHONDONTWRITEBYTECODE=1, read-only in the sandbox) and never visible writable to a
    training run. Unsandboxed, the evaluator's prefix is watched: a change while the
    worker ran fails the evaluation, naming the file. The integrity snapshot
    (autoloop.trust.integrity) also covers the harness's `__pycache__` and the `.pth` files of
    site-packages around every training run.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

PYCACHE_KINDS = ("train", "eval")
# Python's own flags for the bytecode cache.
ENV_PYCACHE_PREFIX = "PYTHONPYCACHEPREFIX"
ENV_DONT_WRITE_BYTECODE = "PYTHONDONTWRITEBYTECODE"

# The prefixes warm_pycache filled in this process (a worker process inherits them, see
# autoloop.measure.worker's WARMED_ENV).
_warmed: set[tuple[str, str, str, str]] = set()


def warmed() -> list[tuple[str, str, str, str]]:
    """The prefixes this process has filled (for a worker process to inherit)."""
    return sorted(_warmed)


def mark_warmed(keys) -> None:
    """Prefixes a parent process filled already (see autoloop.measure.worker's WARMED_ENV)."""
    _warmed.update(keys)


def pycache_dir(kind: str, cache_root: Path | str) -> Path:
    if kind not in PYCACHE_KINDS:
        raise ValueError(f"pycache kind must be one of {PYCACHE_KINDS}, not {kind!r}")
    return Path(cache_root) / "pycache" / kind


def pycache_env(kind: str, cache_root: Path | str) -> dict[str, str | None]:
    """Environment entries for an autoloop child process's bytecode (None = unset it).

    Both prefixes are written only by `warm_pycache`, a trusted process that imports no
    trial code; the children read them (PYTHONDONTWRITEBYTECODE=1, and the sandbox mounts
    them read-only). kind "train": what training imports (torch, its compiler, the
    harness), so a trial starts fast and no trial can leave bytecode behind for the runs
    after it (the incumbent's re-measurements among them). kind "eval": the evaluator's,
    which imports the trial's train.py. A change in either is tampering (autoloop.trust.integrity).
    """
    return {
        ENV_PYCACHE_PREFIX: str(pycache_dir(kind, cache_root)),
        ENV_DONT_WRITE_BYTECODE: "1",
    }


def warm_pycache(kind: str, python: str, cache_root: Path | str, *, env: dict[str, str] | None = None,
                 force: bool = False) -> float:
    """Fill a bytecode prefix from a trusted process (the harness + torch, no trial code);
    once per (kind, python, prefix, PYTHONPATH) in this process. Returns the seconds spent.

    For "eval" this is the only writer. For "train" it makes the harness's bytecode there
    current before any trial runs, so an honest trial writes none of it and the integrity
    snapshot can treat any harness .pyc a trial adds or changes there as tampering."""
    prefix = pycache_dir(kind, cache_root)
    base = dict(env if env is not None else os.environ)
    key = (kind, python, str(prefix), base.get("PYTHONPATH", ""))
    if key in _warmed and not force:
        return 0.0
    prefix.mkdir(parents=True, exist_ok=True)
    base.pop(ENV_DONT_WRITE_BYTECODE, None)
    base[ENV_PYCACHE_PREFIX] = str(prefix)
    started = time.monotonic()
    code = "import autoloop.harness.evaluate as e; e._harness_modules()"
    if kind == "train":
        # What a training run imports beyond the harness: the optimizers and, on a GPU, the
        # compiler (imported lazily by torch.compile); best effort.
        code += "\ntry:\n    import torch.optim, torch._dynamo, torch._inductor.compile_fx\nexcept Exception:\n    pass"
    done = subprocess.run([python, "-c", code], env=base, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=600, check=False)
    if done.returncode == 0:
        _warmed.add(key)
    return time.monotonic() - started
