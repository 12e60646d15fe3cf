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

from autoloop.base.files import copy_regular_files
from autoloop.trust.import_root import trusted_python_path

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


# What a child imports beyond the harness package, warmed with it: an evaluation's model
# process imports train.py (a trial's may use torch.optim); a training run may also reach
# torch._dynamo (torch.compile on a GPU; torch.optim's optimizers import it on first use,
# which is why train.py's own do not subclass them), torch.profiler and, on a GPU, the
# compiler. A module missing from a prefix is compiled from source by every child that
# imports it, since no child may write bytecode: for torch._dynamo that was 2.5 CPU seconds.
WARM_IMPORTS = {
    "eval": ("torch.optim",),
    "train": ("torch.optim", "torch._dynamo", "torch.profiler"),
}
WARM_BEST_EFFORT = {"eval": (), "train": ("torch._inductor.compile_fx",)}  # absent on some builds
STAMP = ".warm.json"  # in the prefix: what it was filled for (see `_stamp`)
WARM_TIMEOUT_SECONDS = 600

# The prefixes whose warm-up failed in this process: said once and not tried again (every
# child would fail the same way); `force` tries again.
_failed: set[tuple[str, str, str, str]] = set()


def warm_code(kind: str) -> str:
    """The trusted warm-up's program: every harness module, then `WARM_IMPORTS[kind]`."""
    lines = [
        "import importlib, pkgutil",
        "import autoloop.harness as harness",
        "for info in pkgutil.iter_modules(harness.__path__, 'autoloop.harness.'):",
        "    if info.name != 'autoloop.harness.__main__':",
        "        importlib.import_module(info.name)",
        *(f"import {name}" for name in WARM_IMPORTS[kind]),
    ]
    for name in WARM_BEST_EFFORT[kind]:
        lines += ["try:", f"    import {name}", "except Exception:", "    pass"]
    return "\n".join(lines) + "\n"


def _stamp(kind: str, python: str, pythonpath: str) -> dict | None:
    """What a filled prefix was filled for: the interpreter, the harness's sources, torch's
    install and the import path. None where it cannot be told cheaply (another interpreter
    than this one): such a prefix is warmed once per process, as before the stamp. Compared
    as paths, not resolved: two virtual environments share their base's binary but not
    their torch, which is read here from this interpreter's own path."""
    import importlib.util
    import sys

    try:
        if os.path.abspath(python) != os.path.abspath(sys.executable):
            return None
        torch_spec = importlib.util.find_spec("torch")
        torch_init = Path(torch_spec.origin) if torch_spec and torch_spec.origin else None
        return {
            "kind": kind, "code": warm_code(kind), "python": os.path.abspath(python), "version": sys.version,
            "python_mtime": os.stat(os.path.realpath(python)).st_mtime, "pythonpath": pythonpath,
            "harness": _sources_stamp(Path(__file__).resolve().parents[1] / "harness"),
            "torch": [str(torch_init), torch_init.stat().st_mtime] if torch_init else None,
        }
    except (OSError, ValueError, ImportError):
        return None


def _sources_stamp(directory: Path) -> list:
    """Each harness source's name, size and mtime: what Python checks a .pyc against (read
    without importing the harness, which imports torch)."""
    return [[path.relative_to(directory).as_posix(), stat.st_size, stat.st_mtime_ns]
            for path in sorted(directory.rglob("*.py")) for stat in [path.stat()]]


def _read_stamp(prefix: Path) -> dict | None:
    import json

    try:
        with open(prefix / STAMP, "rb") as handle:
            data = json.loads(handle.read(1 << 16))
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _write_stamp(prefix: Path, stamp: dict) -> None:
    import json

    tmp = prefix / f"{STAMP}.{os.getpid()}"
    try:
        tmp.write_text(json.dumps(stamp, sort_keys=True))
        os.replace(tmp, prefix / STAMP)
    except OSError:
        tmp.unlink(missing_ok=True)


def warm_pycache(kind: str, python: str, cache_root: Path | str, *, env: dict[str, str] | None = None,
                 force: bool = False) -> float:
    """Fill a bytecode prefix from a trusted process (the harness + torch, no trial code);
    once per (kind, python, prefix, PYTHONPATH) in this process, and not at all where the
    prefix's stamp says an earlier process filled it for the same interpreter, harness and
    torch (each `autoloop` command would otherwise import torch twice more before its first
    trial). Returns the seconds spent.

    For "eval" this is the only writer. For "train" it makes the harness's bytecode there
    current before any trial runs, so an honest trial writes none of it and the integrity
    snapshot can treat any harness .pyc a trial adds or changes there as tampering. The
    stamp grants nothing: Python still checks each .pyc against its source, and whoever
    could write the stamp could write the bytecode, which the snapshot watches.

    A new project's prefix is a copy of a template the user's cache keeps per stamp,
    itself filled by a warm-up into a fresh folder (`_template`): the second project of the
    same harness and torch does not import torch to fill its own. `force` (after planted
    bytecode was removed) always runs the warm-up into the prefix itself.

    A warm-up that fails says so on stderr, once per prefix in this process: the children
    then compile what they import from source (slower, not wrong)."""
    import sys

    prefix = pycache_dir(kind, cache_root)
    base = dict(env if env is not None else os.environ)
    # The harness this process runs, as its children import it (autoloop.trust.import_root).
    base["PYTHONPATH"] = trusted_python_path(base)
    key = (kind, python, str(prefix), base["PYTHONPATH"])
    if (key in _warmed or key in _failed) and not force:
        return 0.0
    stamp = _stamp(kind, python, key[3])
    if not force and stamp is not None and _read_stamp(prefix) == stamp:
        _warmed.add(key)
        return 0.0
    started = time.monotonic()
    failure = None
    if not force and stamp is not None:
        # A new project's prefix is copied from the one a trusted warm-up filled for the
        # same stamp (an import of torch and its compiler: ~10 s of CPU, per project).
        template, failure = _template(kind, stamp, python, base)
        if template is not None and _copy_template(template, prefix):
            _write_stamp(prefix, stamp)
            _warmed.add(key)
            _failed.discard(key)
            return time.monotonic() - started
    if failure is None:
        failure = _run_warm_up(kind, python, base, prefix)
    if failure is None:
        _warmed.add(key)
        _failed.discard(key)
        if stamp is not None:
            _write_stamp(prefix, stamp)
    else:
        if key not in _failed:
            print(f"autoloop: the {kind} bytecode warm-up with {python} failed ({failure[:300]}); its children "
                  f"compile what they import from source, which only makes them slower", file=sys.stderr)
        _failed.add(key)
    return time.monotonic() - started


def _run_warm_up(kind: str, python: str, env: dict[str, str], prefix: Path) -> str | None:
    """Fill `prefix` from a trusted process; the failure's last line, or None."""
    prefix.mkdir(parents=True, exist_ok=True)
    env = dict(env)
    env.pop(ENV_DONT_WRITE_BYTECODE, None)
    env[ENV_PYCACHE_PREFIX] = str(prefix)
    try:
        # From the prefix, not our working folder (a project, where a trial may leave files):
        # `-c` puts the working folder first on the import path.
        done = subprocess.run([python, "-c", warm_code(kind)], env=env, cwd=prefix, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=WARM_TIMEOUT_SECONDS,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if done.returncode == 0:
        return None
    return ((done.stdout or b"").decode(errors="replace").strip().splitlines() or [f"exit {done.returncode}"])[-1]


# Templates kept per kind in the user's cache (each about 100 MB for training's): the
# newest, for the harness and torch of today, and one before it (a second checkout).
TEMPLATES_KEPT = 2


def _template(kind: str, stamp: dict, python: str, env: dict[str, str]) -> tuple[Path | None, str | None]:
    """The user's template prefix for `stamp`, filled now if missing: a warm-up into a fresh
    folder of the cache (which no sandbox sees), renamed into place whole, so a template
    holds only what a trusted warm-up wrote. (template, None), or (None, the warm-up's
    failure)."""
    import hashlib
    import json
    import shutil

    from autoloop.harness.contract import cache_root

    digest = hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:16]
    root = cache_root() / "pycache-templates"
    template = root / f"{kind}-{digest}"
    if (template / STAMP).is_file():
        return template, None
    fresh = root / f".{kind}-{digest}.{os.getpid()}"
    shutil.rmtree(fresh, ignore_errors=True)
    failure = _run_warm_up(kind, python, env, fresh)
    if failure is not None:
        shutil.rmtree(fresh, ignore_errors=True)
        return None, failure
    _write_stamp(fresh, stamp)
    try:
        os.rename(fresh, template)
    except OSError:  # another process put the same template in place first
        shutil.rmtree(fresh, ignore_errors=True)
    _prune_templates(root, kind, keep=template)
    return (template if (template / STAMP).is_file() else None), None


def _prune_templates(root: Path, kind: str, keep: Path) -> None:
    import shutil

    try:
        others = sorted((p for p in root.glob(f"{kind}-*") if p != keep), key=lambda p: p.stat().st_mtime)
    except OSError:
        return
    for old in others[: max(0, len(others) - (TEMPLATES_KEPT - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    for left in root.glob(f".{kind}-*"):  # a warm-up killed before its rename
        try:
            if time.time() - left.stat().st_mtime > 2 * WARM_TIMEOUT_SECONDS:
                shutil.rmtree(left, ignore_errors=True)
        except OSError:
            pass


def _copy_template(template: Path, prefix: Path) -> bool:
    """Copy the template into `prefix` (autoloop.base.files: a copy of the project's own,
    nothing in a prefix is shared between projects). False where any of it fails."""
    try:
        copy_regular_files(template, prefix, skip={STAMP})
    except OSError:
        return False
    return (template / STAMP).is_file()  # not pruned by another process meanwhile
