"""The environment half of the train-script contract (see docs/architecture.md).

Every variable is optional: unset means the harness default, so `python train.py` works
by hand. The controller sets all of them for a trial.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from autoloop.harness.constants import DEFAULT_SEED, DEFAULT_TIME_BUDGET
from autoloop.harness.errors import HarnessError

ENV_TIME_BUDGET = "AUTOLOOP_TIME_BUDGET"
ENV_MAX_STEPS = "AUTOLOOP_MAX_STEPS"
ENV_SEED = "AUTOLOOP_SEED"
ENV_RESULT = "AUTOLOOP_RESULT"
ENV_CHECKPOINT = "AUTOLOOP_CHECKPOINT"
ENV_PROGRESS = "AUTOLOOP_PROGRESS"
ENV_DATA_DIR = "AUTOLOOP_DATA_DIR"
ENV_CACHE_DIR = "AUTOLOOP_CACHE_DIR"
ENV_COMPILE_CACHE = "AUTOLOOP_COMPILE_CACHE"
# "external": the controller evaluates the checkpoint in a separate process (autoloop.harness
# .evaluate), so train.py skips its own evaluation; unset or "internal": train.py evaluates.
ENV_EVAL = "AUTOLOOP_EVAL"
EVAL_MODES = ("internal", "external")


def cache_root() -> Path:
    """Where prepared data and compile caches live: $AUTOLOOP_CACHE_DIR, else XDG cache."""
    if os.environ.get(ENV_CACHE_DIR):
        return Path(os.environ[ENV_CACHE_DIR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "autoloop"


# The embedded corpus's name carries its generator's version (autoloop/harness/synthetic.py):
# a change to the language is a new name. Its key is in its fingerprint.
EMBEDDED_DATASET = "synthetic-v1"


def embedded_dataset_name() -> str:
    return EMBEDDED_DATASET


def default_data_dir() -> Path:
    if os.environ.get(ENV_DATA_DIR):
        return Path(os.environ[ENV_DATA_DIR]).expanduser()
    return cache_root() / "data" / embedded_dataset_name()


def _number(name: str, kind, default):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise HarnessError(f"{name}={raw!r} is not a valid {kind.__name__}: set it to a number or unset it") from None
    if value <= 0 and name != ENV_SEED:
        raise HarnessError(f"{name}={raw!r} must be positive: set it to a number above zero or unset it")
    return value


def _eval_mode() -> str:
    raw = os.environ.get(ENV_EVAL, "").strip().lower() or "internal"
    if raw not in EVAL_MODES:
        raise HarnessError(f"{ENV_EVAL}={raw!r} is not one of {', '.join(EVAL_MODES)}: set one of them or unset it")
    return raw


def _path(name: str) -> Path | None:
    raw = os.environ.get(name, "").strip()
    return Path(raw).expanduser() if raw else None


@dataclass(frozen=True)
class RunSpec:
    time_budget: float
    max_steps: int | None
    seed: int
    result_path: Path | None
    checkpoint_path: Path | None
    progress_path: Path | None
    data_dir: Path
    compile_cache_dir: Path
    # True under AUTOLOOP_EVAL=external: write the checkpoint, leave val_bpb to the harness.
    external_eval: bool = False

    @classmethod
    def from_env(cls) -> "RunSpec":
        return cls(
            time_budget=float(_number(ENV_TIME_BUDGET, float, DEFAULT_TIME_BUDGET)),
            max_steps=_number(ENV_MAX_STEPS, int, None),
            seed=_number(ENV_SEED, int, DEFAULT_SEED),
            result_path=_path(ENV_RESULT),
            checkpoint_path=_path(ENV_CHECKPOINT),
            progress_path=_path(ENV_PROGRESS),
            data_dir=default_data_dir(),
            compile_cache_dir=_path(ENV_COMPILE_CACHE) or cache_root() / "compile",
            external_eval=_eval_mode() == "external",
        )

    @property
    def step_mode(self) -> bool:
        return self.max_steps is not None


def configure_compile_cache(spec: RunSpec) -> None:
    """Point inductor's and triton's caches at a folder the run controls.

    Consecutive trials then reuse compiled graphs and autotuning results instead of
    paying for compilation from scratch each time (the default cache lives in /tmp,
    which some machines wipe). An explicit user setting wins.
    """
    root = spec.compile_cache_dir
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HarnessError(
            f"cannot create the compile cache folder {root} ({exc.strerror}): set {ENV_COMPILE_CACHE} to a writable folder"
        ) from None
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
