"""Integrity checks around every trial: the harness, the data and the budget.

The verifier (autoloop.trust.watch) checks a keep candidate's model; these cheaper checks run
around every trial, because a trial that tampers with the harness or the data spoils
every trial after it, and one that overruns its budget is not comparable whatever its
score.

Fingerprints, before and after each trial
    The harness: sha256 of each source file under autoloop/harness (the evaluation, the
    data loader, the clock, the verifier's own worker). The data: sha256 of each split of
    the prepared dataset (~40 ms for the embedded corpus's 21 MB); a split larger than
    FULL_HASH_MAX_BYTES is watched by size and modification time instead, so a multi-GB
    training split costs nothing per trial (it is hashed in full when the run starts).
    A trial that changed either is `invalid`, naming the files; the run then pauses,
    because every later trial would be measured with something else.

Bytecode and import hooks, before and after each trial
    Python runs a `__pycache__/*.pyc` whose header carries its source's mtime and size
    without reading the source, and runs every `.pth` file (and sitecustomize /
    usercustomize) in site-packages at start-up. So the snapshot also hashes the harness's
    `__pycache__` files (and the harness part of the bytecode prefixes the controller gives
    its children, autoloop.trust.bytecode.pycache_env) and those files in every site-packages
    folder (sysconfig purelib/platlib, site.getsitepackages(), the user site). A trial that
    added or modified one is `invalid`, naming the file (a deleted .pyc is harmless:
    Python compiles the source again). `precompile_harness` writes the harness's own
    bytecode before the run, so a child that writes bytecode finds it current and an
    honest trial never adds a .pyc; `bytecode_problems` checks that every .pyc beside the
    harness sources holds the code of its source (a poisoned one planted before the run
    started pauses it).

Budget, after each successful trial (all numbers come from the result JSON or the
printed block, checked against the budget and against the controller's own clock):
    * step mode (max_steps): num_steps <= max_steps + STEP_SLACK. The harness clock
      stops at exactly max_steps; one step of slack forgives an off-by-one in a script
      that counts its own steps.
    * time mode: training_seconds <= budget * (1 + TIME_TOLERANCE) + one step. The clock
      is checked after each step, so an honest run overshoots by at most its last step;
      the step's length is estimated from the run's own figures (training seconds / timed
      steps) and capped at MAX_STEP_SLACK of the budget, so a script cannot buy slack by
      claiming to have taken few, long steps. TIME_TOLERANCE absorbs timer noise.
    * time mode, the controller's clock: the process's wall time (spawn to exit) must
      be explained by the budget plus the compile and evaluation time the script reports
      (compile is the harness's untimed warm-up steps; evaluation is timed separately)
      plus STARTUP_ALLOWANCE (interpreter and torch import, CUDA init, data loading,
      checkpoint save). A script that trains longer than it says shows up here.
    * tokens: total_tokens may not exceed num_steps * batch_tokens when the script
      reports all three (a self-consistency check; tokens have no independent measure).
    * fingerprints reported in the result JSON (data, harness) must be the run's.

What these cannot catch: a script that lies about compile or evaluation seconds can hide
that much training from the wall-clock check; the runner's kill deadline (budget +
grace_seconds) is the hard bound on that. See docs/verification.md.
"""

from __future__ import annotations

import importlib.util
import marshal
import py_compile
import re
import site
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from autoloop.config import Config
from autoloop.base.status import RunOutcome

FULL_HASH_MAX_BYTES = 512 * 2**20
STEP_SLACK = 1
TIME_TOLERANCE = 0.02
MAX_STEP_SLACK = 0.25
# Untimed start-up allowed on top of budget + reported compile + eval, in seconds.
STARTUP_ALLOWANCE_SECONDS = 30.0
STARTUP_ALLOWANCE_FRACTION = 0.1


def harness_dir() -> Path:
    """The harness that this process (and the training processes it starts) imports."""
    from autoloop.harness.fingerprint import HARNESS_DIR

    return HARNESS_DIR


@dataclass(frozen=True)
class Snapshot:
    """What the harness and the data looked like at one moment."""

    harness: dict[str, str] = field(default_factory=dict)  # relative path -> sha256
    data: dict[str, str] = field(default_factory=dict)  # split -> sha256 or "stat:size:mtime_ns"
    data_dir: str = ""
    bytecode: dict[str, str] = field(default_factory=dict)  # harness .pyc label -> sha256
    hooks: dict[str, str] = field(default_factory=dict)  # site-packages .pth / *customize.py path -> sha256


def harness_file_hashes(directory: Path) -> dict[str, str]:
    """sha256 of every .py file under the harness, by relative path (the fingerprint's inputs)."""
    from autoloop.harness.fingerprint import sha256_file

    return {
        path.relative_to(directory).as_posix(): sha256_file(path)
        for path in sorted(Path(directory).rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def data_signature(data_dir: Path) -> dict[str, str]:
    """Per split: its sha256, or size and mtime for a split over FULL_HASH_MAX_BYTES."""
    from autoloop.harness.constants import SPLITS
    from autoloop.harness.fingerprint import sha256_file

    signature = {}
    for split in SPLITS:
        path = Path(data_dir) / f"{split}.bin"
        try:
            stat = path.stat()
        except FileNotFoundError:
            signature[split] = "missing"
            continue
        if stat.st_size <= FULL_HASH_MAX_BYTES:
            signature[split] = sha256_file(path)
        else:
            signature[split] = f"stat:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}"
    meta = Path(data_dir) / "meta.json"
    signature["meta.json"] = sha256_file(meta) if meta.exists() else "missing"
    return signature


# The label part that marks a prefix's mirror of the harness as imported through the import
# root (autoloop.trust.import_root), beside its mirror as the package's own path.
VIA_IMPORT_ROOT = "[via import root]"


def harness_mirrors(directory: Path, prefix: Path) -> dict[str, Path]:
    """Where a bytecode prefix holds the harness's bytecode: PYTHONPYCACHEPREFIX mirrors each
    source's path as it was imported, so the package's own path and, for this process's own
    harness, the import root's, through which every child imports it. Label part -> folder."""
    resolved = Path(directory).resolve()
    mirrors = {"": Path(prefix) / resolved.relative_to(resolved.anchor)}
    import autoloop

    package = Path(autoloop.__file__).resolve().parent
    if resolved == package / "harness" or package / "harness" in resolved.parents:
        from autoloop.trust.import_root import trusted_import_root

        imported = trusted_import_root() / "autoloop" / resolved.relative_to(package)
        mirrors[VIA_IMPORT_ROOT] = Path(prefix) / imported.relative_to(imported.anchor)
    return mirrors


def harness_bytecode_hashes(directory: Path, prefixes: list[Path] | tuple[Path, ...] = ()) -> dict[str, str]:
    """sha256 of every file in the harness's `__pycache__` folders, and of the harness's
    files under each bytecode prefix (`harness_mirrors`). Labels: `__pycache__/metric.cpython-311.pyc`,
    `<prefix>:metric.cpython-311.pyc`, `<prefix>[via import root]:metric.cpython-311.pyc`."""
    from autoloop.harness.fingerprint import sha256_file

    directory = Path(directory)
    hashes = {}
    for cache in sorted(directory.rglob("__pycache__")):
        for path in sorted(cache.rglob("*")):
            if path.is_file():
                hashes[path.relative_to(directory).as_posix()] = sha256_file(path)
    for prefix in prefixes:
        for mark, mirrored in harness_mirrors(directory, prefix).items():
            if mirrored.is_dir():
                for path in sorted(mirrored.rglob("*")):
                    if path.is_file():
                        hashes[f"{prefix}{mark}:{path.relative_to(mirrored).as_posix()}"] = sha256_file(path)
    return hashes


def bytecode_path(directory: Path, label: str) -> Path:
    """The file behind a label of `harness_bytecode_hashes`."""
    if label.startswith("__pycache__/") or "/__pycache__/" in label:
        return Path(directory) / label
    prefix, _, relative = label.rpartition(":")
    mark = VIA_IMPORT_ROOT if prefix.endswith(VIA_IMPORT_ROOT) else ""
    return harness_mirrors(directory, Path(prefix[: len(prefix) - len(mark)]))[mark] / relative


def remove_planted_bytecode(directory: Path, before: Snapshot, after: Snapshot) -> list[Path] | None:
    """Delete the harness bytecode a run added or changed, when that is all it changed.

    Bytecode is a cache: without the file Python compiles the source again (and the
    trusted warm-up writes it anew), so the run can go on. Returns the files removed, or
    None when the run changed something else too (sources, data, import hooks)."""
    if before.harness != after.harness or before.data != after.data or \
            any(after.hooks.get(k) != v for k, v in before.hooks.items()) or set(after.hooks) - set(before.hooks):
        return None
    planted = [label for label, digest in after.bytecode.items() if before.bytecode.get(label) != digest]
    removed = []
    for label in planted:
        path = bytecode_path(directory, label)
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def site_dirs() -> list[Path]:
    """Every site-packages folder this interpreter reads .pth files from."""
    found: list[Path] = []
    candidates = [sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib")]
    try:
        candidates += list(site.getsitepackages())
    except AttributeError:  # some virtualenv builds lack it
        pass
    try:
        candidates.append(site.getusersitepackages())
    except AttributeError:
        pass
    for candidate in candidates:
        if candidate and Path(candidate).is_dir() and Path(candidate).resolve() not in found:
            found.append(Path(candidate).resolve())
    return found


def import_hook_hashes(dirs: list[Path] | None = None) -> dict[str, str]:
    """sha256 of the files Python runs at start-up from site-packages: *.pth,
    sitecustomize.py, usercustomize.py."""
    from autoloop.harness.fingerprint import sha256_file

    hashes = {}
    for folder in site_dirs() if dirs is None else dirs:
        folder = Path(folder)
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            if path.is_file() and (path.suffix == ".pth" or path.name in ("sitecustomize.py", "usercustomize.py")):
                try:
                    hashes[str(path)] = sha256_file(path)
                except OSError:
                    hashes[str(path)] = "unreadable"
    return hashes


def take_snapshot(harness: Path, data_dir: Path, *, pycache_prefixes: list[Path] | tuple[Path, ...] = (),
                  hook_dirs: list[Path] | None = None) -> Snapshot:
    """The harness sources and bytecode, the data, and the site-packages import hooks now.

    `pycache_prefixes`: the bytecode prefixes autoloop's children use (their harness part
    is covered); `hook_dirs`: the folders searched for .pth files (default: `site_dirs()`).
    """
    return Snapshot(harness=harness_file_hashes(harness), data=data_signature(data_dir), data_dir=str(data_dir),
                    bytecode=harness_bytecode_hashes(harness, pycache_prefixes), hooks=import_hook_hashes(hook_dirs))


_PYC_NAME = re.compile(r"^(?P<stem>.+)\.(?P<tag>[^.]+?)(?:\.opt-(?P<opt>[12]))?\.pyc$")


def bytecode_problems(directory: Path) -> list[str]:
    """Every .pyc beside the harness sources that this interpreter would run, whose code is
    not its source's (compiled here and compared as code objects), e.g. a poisoned .pyc
    written with the real source's mtime and size. Bytecode of other interpreters is
    skipped: this one never reads it."""
    problems = []
    for pyc in sorted(Path(directory).rglob("__pycache__/*.pyc")):
        match = _PYC_NAME.match(pyc.name)
        if not match or match["tag"] != sys.implementation.cache_tag:
            continue
        source = pyc.parent.parent / f"{match['stem']}.py"
        label = pyc.relative_to(directory).as_posix()
        if not source.exists():
            problems.append(f"harness bytecode {label} has no source")
            continue
        try:
            code = marshal.loads(pyc.read_bytes()[16:])
            expected = compile(source.read_bytes(), str(source), "exec", dont_inherit=True,
                               optimize=int(match["opt"] or 0))
        except (ValueError, EOFError, TypeError, SyntaxError, OSError):
            problems.append(f"harness bytecode {label} is unreadable")
            continue
        if code != expected:
            problems.append(f"harness bytecode {label} does not match {source.name}")
    return problems


def precompile_harness(directory: Path) -> None:
    """Write current bytecode for every harness source whose `__pycache__` .pyc is missing or
    stale, as an import would (best effort: a read-only install is skipped), so that a
    training process importing the harness writes nothing there."""
    for source in sorted(Path(directory).rglob("*.py")):
        if "__pycache__" in source.parts:
            continue
        target = source.parent / "__pycache__" / f"{source.stem}.{sys.implementation.cache_tag}.pyc"
        try:
            stat = source.stat()
            if target.exists():
                header = target.read_bytes()[:16]
                if (int.from_bytes(header[8:12], "little") == int(stat.st_mtime) & 0xFFFFFFFF
                        and int.from_bytes(header[12:16], "little") == stat.st_size & 0xFFFFFFFF
                        and header[:4] == importlib.util.MAGIC_NUMBER):
                    continue
            py_compile.compile(str(source), cfile=str(target), doraise=True,
                               invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
        except (OSError, py_compile.PyCompileError):
            continue


def changes(before: Snapshot, after: Snapshot) -> list[str]:
    """Human-readable differences, e.g. ['harness metric.py modified', 'data split val.bin modified']."""
    found = []
    for name in sorted(set(before.harness) | set(after.harness)):
        old, new = before.harness.get(name), after.harness.get(name)
        if old != new:
            what = "added" if old is None else "deleted" if new is None else "modified"
            found.append(f"harness file {name} {what}")
    for name in sorted(set(before.bytecode) | set(after.bytecode)):
        old, new = before.bytecode.get(name), after.bytecode.get(name)
        if new is not None and old != new:  # a deleted .pyc is harmless: the source is compiled again
            found.append(f"harness bytecode {name} {'added' if old is None else 'modified'}")
    for name in sorted(set(before.hooks) | set(after.hooks)):
        old, new = before.hooks.get(name), after.hooks.get(name)
        if new is not None and old != new:
            found.append(f"import hook {name} {'added' if old is None else 'modified'}")
    for name in sorted(set(before.data) | set(after.data)):
        if before.data.get(name) != after.data.get(name):
            label = name if name.endswith(".json") else f"{name}.bin"
            found.append(f"data file {label} changed")
    return found


def dataset_problems(data_dir: Path) -> list[str]:
    """Splits whose content no longer matches the sha256 recorded when they were prepared.

    Splits over FULL_HASH_MAX_BYTES are hashed too: this runs once per run start.
    """
    from autoloop import harness as H

    ds = H.load_dataset(data_dir)
    return [f"data split {name}.bin no longer matches its prepared hash" for name in H.verify_dataset(ds)]


def _number(result: dict, key: str) -> float | None:
    value = result.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def budget_problem(config: Config, outcome: RunOutcome, *, data_fingerprint: str | None = None,
                   harness_fingerprint: str | None = None, measured_by_feed: bool = False) -> str | None:
    """Why a finished trial's report breaks its budget or contradicts the run, or None.

    `measured_by_feed`: the run drew its batches from the harness's data feed, whose own
    figures (autoloop.trust.budget) judge its time; the time rules on the trial's report and on
    the wall clock below are then not applied (they fail honest runs on a busy machine)."""
    result = outcome.result or {}
    steps = _number(result, "num_steps")
    tokens = _number(result, "total_tokens")
    batch_tokens = _number(result, "batch_tokens")

    reported_data = result.get("data_fingerprint")
    if data_fingerprint and isinstance(reported_data, str) and reported_data != data_fingerprint:
        return (f"trained and evaluated on another dataset (data fingerprint {reported_data[:12]}, the run's is "
                f"{data_fingerprint[:12]}): its val_bpb is not comparable")
    reported_harness = result.get("harness_fingerprint")
    if harness_fingerprint and isinstance(reported_harness, str) and reported_harness != harness_fingerprint:
        return (f"ran with another harness (fingerprint {reported_harness[:12]}, the run's is "
                f"{harness_fingerprint[:12]}): its val_bpb was not measured by the fixed harness")

    if steps is not None and tokens is not None and batch_tokens is not None and tokens > steps * batch_tokens:
        return (f"reports {tokens:.0f} training tokens, more than its {steps:.0f} steps of {batch_tokens:.0f} tokens "
                "account for")

    if config.max_steps:
        if steps is not None and steps > config.max_steps + STEP_SLACK:
            return (f"trained {steps:.0f} steps, over its budget of {config.max_steps} "
                    f"(+{STEP_SLACK} allowed)")
        return None
    if measured_by_feed:
        return None

    from autoloop.harness.constants import UNTIMED_WARMUP_STEPS

    budget = float(config.time_budget)
    training = _number(result, "training_seconds")
    step_slack = 0.0
    if training is not None:
        timed_steps = max(1.0, (steps or 1.0) - UNTIMED_WARMUP_STEPS)
        step_slack = min(training / timed_steps, MAX_STEP_SLACK * budget)
        allowed = budget * (1 + TIME_TOLERANCE) + step_slack
        if training > allowed:
            return (f"trained {training:.1f} s, over its {budget:g} s budget (allowed {allowed:.1f} s: "
                    f"one step and {TIME_TOLERANCE:.0%})")
    untimed = sum(_number(result, key) or 0.0 for key in ("compile_seconds", "eval_seconds"))
    startup = STARTUP_ALLOWANCE_SECONDS + STARTUP_ALLOWANCE_FRACTION * budget
    allowed_wall = budget * (1 + TIME_TOLERANCE) + step_slack + untimed + startup
    if outcome.wall_seconds > allowed_wall:
        return (f"ran {outcome.wall_seconds:.0f} s by the controller's clock, more than its {budget:g} s budget "
                f"plus the {untimed:.0f} s of compile and evaluation it reports and {startup:.0f} s of start-up "
                f"(allowed {allowed_wall:.0f} s): it trained longer than it says")
    return None


def describe_pause(found: list[str], tag: str) -> str:
    """The pause reason for a run whose harness or data changed under it."""
    listed = "; ".join(found[:5]) + (f"; and {len(found) - 5} more" if len(found) > 5 else "")
    if any(item.startswith(("harness bytecode", "import hook")) for item in found):
        return (f"bytecode or an import hook of the harness's interpreter changed during the run ({listed}): delete "
                "the named files (bytecode: the harness's __pycache__ folder; Python compiles the sources again) and "
                f"resume with `autoloop run --tag {tag}`")
    if any(item.startswith("harness") for item in found):
        return (f"the harness changed during the run ({listed}): restore it (`git checkout -- autoloop/harness` in "
                f"autoloop's checkout, or reinstall autoloop) and resume with `autoloop run --tag {tag}`, or resume "
                "with --allow-env-change to accept the change")
    return (f"the prepared data changed ({listed}): delete the data folder, prepare it again and resume with "
            f"`autoloop run --tag {tag}`")
