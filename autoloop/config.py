"""One resolver for the configuration of a run.

Precedence, lowest to highest: the defaults below < `[tool.autoloop]` in the repository's
pyproject.toml < `AUTOLOOP_<FIELD>` environment variables < CLI flags. Every field has
one name in all three places (dashes in TOML and flags, upper case in the environment),
e.g. `time_budget`: `time-budget = 30`, `AUTOLOOP_TIME_BUDGET=30`, `--time-budget 30`.

Every value is checked where it is read, before anything runs: its type (`_coerce`), its
vocabulary (`_CHOICES`) and, for numbers, its range (`_RANGES`: `--time-budget -5` or
`--max-trials -1` is refused in one line naming the option as its source spells it, the
bad value and the fix), so a bad number never reaches a trial. Errors name a setting as
the user wrote it: `time-budget` in TOML, `AUTOLOOP_TIME_BUDGET` in the environment,
`--time-budget` on the command line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import sys
from dataclasses import dataclass, field, fields
from datetime import date
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from autoloop.errors import AutoloopError

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ENV_PREFIX = "AUTOLOOP_"
# autoloop's own folder in the repository (run state, transcripts, checkpoints); never a trial's to edit.
STATE_DIR = ".autoloop"


@dataclass
class Config:
    tag: str = ""  # run name; branch autoloop/<tag>; default: today's date, e.g. nov29
    db: str = "experiments.db"  # trial log, relative to the repository
    train_command: str = "python train.py"  # a leading `python` means this interpreter
    editable: list[str] = field(default_factory=lambda: ["train.py"])  # files proposals may change
    protected: list[str] = field(  # files no proposal may change, whatever `editable` says
        default_factory=lambda: ["autoloop/**", "program.md", "pyproject.toml", ".autoloop/**", "experiments.db*"]
    )
    time_budget: float = 300.0  # seconds of timed training per trial
    max_steps: int | None = None  # step budget instead (deterministic; for tests and quick runs)
    grace_seconds: float = 180.0  # start-up, compile and evaluation allowance on top of the budget
    seed: int = 1337  # the first training seed; the k-th run of a trial trains at seed + k
    dataset: str | None = None  # prepared dataset name or folder; default: the embedded corpus
    max_trials: int | None = None  # stop after this many trials in this invocation (baseline included)
    hours: float | None = None  # stop before a trial that could not finish within this many hours
    keep_margin: float = 0.0  # keep only when val_bpb beats the best by more than this
    # Tried in order, first proposal wins. "auto" = the LLM and/or agent when llm_model /
    # agent_command is set, then search; just search when neither is (proposers/base.py).
    proposers: list[str] = field(default_factory=lambda: ["ideas", "auto"])
    # "chain": the proposers in order, first answer wins; "yield": seeded ideas first, the
    # search re-tunes after a model's structural keep, a model's constant-only answer is the
    # search's point, the rest shared by yield per GPU-minute (autoloop/loop/sources.py).
    schedule: str = "chain"
    schedule_floor: float = 0.1  # under schedule = "yield", the least share of proposals each source gets
    max_consecutive_failures: int = 3  # circuit breaker: crashes/timeouts in a row before re-running the incumbent
    allow_env_change: bool = False  # resume on another GPU / torch / data / harness anyway (recorded)
    verify: bool = True  # verify keep candidates in a fresh process before keeping them
    # A keep's verification sends causality probes enough to catch a next-token peek worth the
    # run's noise (autoloop/harness/probe_power.py), at most this many times the scored windows:
    # the cost of the power (on a CPU at no known noise, 16 makes a keep's verification about 80 s longer).
    probe_factor: int = 16
    # Decisions (docs/decisions.md). "two-tier": a candidate paired with the incumbent on the
    # same seeds is adopted (the branch moves) when the paired mean is lower, and confirmed
    # when the sequential test against the run's noise says so; "confirmed-only": only
    # confirmed candidates move the branch (run again while unclear); "paired": the same
    # rule at alpha 0.05 (its old name); "strict": one run, kept when it beats the best by
    # more than keep_margin (autoresearch's rule).
    decision_rule: str = "two-tier"
    baseline_seeds: int = 3  # the baseline's runs: the first measure of the noise
    max_runs: int = 5  # most runs of one candidate before it is discarded as not distinguishable
    alpha: float | None = None  # null proposals confirmed per proposal; default 0.05, 0.2 under confirmed-only
    futility: float = -0.5  # discard as soon as the paired t statistic is above this (a worse run costs one run)
    # The reported figures: the final best re-measured at this many fresh seeds no decision
    # used (at the end of a night, on `finalize`, `best` and `report`); 0: report the
    # selection mean, marked as such. A short night re-measures at fewer (4% of its runs, >= 2).
    reserve_seeds: int = 4
    # The scale ladder (docs/review.md): at the end of a night that ended by its limit, the
    # best, the baseline and the best with each kept change left out are measured at this
    # larger scale ("DEPTH=8 MODEL_DIM=512", "budget=4x", or both), each kept change tagged
    # holds, fades or reverses; its cost is planned into --hours. None: no ladder.
    ladder: str | None = None
    ladder_seeds: int = 3  # fresh seeds every commit is measured at on the ladder (2 at least)
    ladder_every: int = 0  # also measure the ladder after every K-th kept change (serial runs); 0: at the end only
    early_stop: bool = True  # stop a clear loser's run early, on a rule calibrated on the night's own curves
    drift_every: int = 10  # re-measure the incumbent every N trials (0: never)
    drift_event_sigmas: float = 3.0  # a shift beyond this many paired-noise sds is an event
    drift_pause_sigmas: float = 8.0  # ... and beyond this many, the run pauses
    # Two runs at one seed whose machine speeds (the probe's, autoloop/measure/probe.py)
    # differ by more than this |log ratio| are not a pair (autoloop/decide/confound.py);
    # none: pair them anyway (a GPU run that a busy CPU does not slow).
    pair_speed_tolerance: float | None = 0.25
    requeue_near_misses: bool = False  # retry a discard within the noise once after the incumbent changes
    # A trial that runs out of memory is repaired: this constant halved (the total batch, and
    # so the comparison, unchanged), up to oom_repairs times down the ladder.
    oom_batch_constant: str = "DEVICE_BATCH_SIZE"
    # `autoloop check` (overfit one batch, LR range test, budget plan) before a new run's
    # baseline; a script that cannot overfit one batch stops the run before the night is spent.
    check: bool = True
    oom_repairs: int = 3  # halvings of the batch after out-of-memory
    # LLM and coding-agent proposers (docs/llm.md). Setting llm_model or agent_command puts
    # that proposer into the default chain ("auto"). API keys are read from the environment
    # variable named by llm_api_key_env and never stored in the config, the db or logs.
    llm_model: str | None = None  # model name the server knows, e.g. gpt-4.1 or qwen2.5-coder:32b
    llm_base_url: str | None = None  # OpenAI-compatible endpoint; default: $OPENAI_BASE_URL, else OpenAI
    llm_api_key_env: str = "OPENAI_API_KEY"  # the environment variable that holds the API key
    llm_timeout: float = 600.0  # seconds one request may take before it is retried
    llm_retries: int = 2  # retries of a failed or timed-out request before the chain falls through
    # After failed requests the model is left alone for llm_retry_wait seconds, doubling up
    # to llm_retry_max_wait (autoloop.proposers.outage); as the only source the loop waits
    # for it up to llm_outage_wait seconds of one outage (never past --hours).
    llm_retry_wait: float = 60.0  # seconds before an unreachable model is tried again (doubling each time)
    llm_retry_max_wait: float = 300.0  # the longest wait between tries of an unreachable model
    llm_outage_wait: float = 7200.0  # seconds a run whose only source is a model waits out one outage
    llm_max_repairs: int = 2  # times a rejected answer is sent back with the reason
    llm_prices: dict = field(default_factory=dict)  # $ per 1M tokens: {model: [input, output]}
    # One cap over what the night spends (autoloop/loop/cost.py): model tokens at llm_prices and
    # GPU time at gpu_hour_price (each run holds one GPU for its wall time); the run stops before
    # its next trial would pass it. 0, the default price, is your own machine: tokens only count.
    max_cost: float | None = None  # US dollars the run may spend on model tokens and GPU time
    gpu_hour_price: float = 0.0  # $ per GPU-hour of training (a cloud GPU's rent); 0: GPU time is free
    agent_command: str | None = None  # coding agent run in a throwaway clone, e.g. "claude -p"
    # The project's memory (autoloop/proposers/memory.py): the proposers, `autoloop ideas` and
    # the report know what every earlier tag of this db tried, kept and discarded, and those of
    # this other experiments.db too (another clone's or machine's; read-only; relative to the
    # repository). An edit discarded there on the same parent is not proposed again unless seeded.
    memory_db: str | None = None
    agent_timeout: float = 1800.0  # seconds before the agent is killed
    # Trials under bubblewrap (autoloop/measure/sandbox.py): "auto" where it works here, "on" (an
    # error where it cannot run), "off" (what --no-sandbox sets; recorded on the run).
    sandbox: str = "auto"
    # Scale-out (docs/scale-out.md). "serial": one trial at a time in this folder; "local":
    # one worker per visible GPU (or `workers` pretend devices on a CPU), each in its own git
    # worktree; "ray": one worker per GPU of a Ray cluster (`pip install -e '.[ray]'`).
    executor: str = "serial"
    workers: int = 0  # workers of the local/ray executor; 0: one per GPU
    ray_address: str | None = None  # join this Ray cluster ("auto", "ray://host:10001"); none: start one
    # "shared": every worker trains proposals from the one best commit; "islands": worker k
    # advances its own lineage (branch autoloop/<tag>-w<k>), the best lineage migrating to
    # the others every `migrate_every` trials of the run (0: never).
    search_mode: str = "shared"
    migrate_every: int = 10  # trials between migrations of the best lineage (islands); 0: never
    allow_mixed_devices: bool = False  # workers on different GPU models in one run (their numbers differ)
    # A command run on the night's events (a keep, a confirmed gain, a pause, a lost worker,
    # the end), the event as JSON on stdin (autoloop/loop/notify.py); killed after
    # notify_timeout seconds. It may name secrets ($WEBHOOK_URL): it is never stored in the db.
    notify: str | None = None
    notify_timeout: float = 10.0  # seconds the notify command may take
    # What one trial may spend (autoloop/measure/limits.py, docs/verification.md); a trial
    # over a limit is invalid with the limit named. The defaults never bind an honest GPU trial.
    trial_memory_mb: int | None = None  # resident memory of its processes and its /tmp; default: half the machine's
    trial_processes: int = 1024  # processes at once
    trial_disk_mb: int = 8192  # what out/ and compile/ may hold (and never more than half the disk's free space)
    trial_files: int = 10_000  # files in out/ and compile/
    trial_log_mb: int = 64  # train.log; past it the trial is stopped and its log cut to a head and a tail
    feed_memory_mb: int = 256  # the data feed's batches held in the controller for one trial, all streams together

    def train_argv(self) -> list[str]:
        argv = shlex.split(self.train_command)
        if not argv:
            raise AutoloopError("train-command is empty: set it to e.g. 'python train.py'")
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        return argv

    def with_defaults(self) -> "Config":
        if not self.tag:
            today = date.today()
            self.tag = today.strftime("%b").lower() + str(today.day)
        return self


_FIELDS = {f.name: f for f in fields(Config)}
_HINTS = get_type_hints(Config)
# Fields with a fixed vocabulary; TOML's true/false mean on/off.
_CHOICES = {"sandbox": ("auto", "on", "off"), "decision_rule": ("two-tier", "strict", "paired", "confirmed-only"),
            "executor": ("serial", "local", "ray"), "search_mode": ("shared", "islands"),
            "schedule": ("chain", "yield")}


# The range of every numeric setting: (lowest, whether the lowest itself is allowed,
# highest or None, what the number is, a good value). Checked for every source.
_RANGES: dict[str, tuple[float, bool, float | None, str, str]] = {
    "time_budget": (0, False, None, "seconds of timed training per trial", "300"),
    "max_steps": (1, True, None, "optimizer steps per trial", "200"),
    "grace_seconds": (0, True, None, "seconds allowed on top of the budget", "180"),
    "seed": (0, True, 2**32 - 1000, "the first training seed", "1337"),
    "max_trials": (0, True, None, "trials in this invocation, the baseline included; 0 only recovers", "10"),
    "hours": (0, False, None, "hours the run may take", "8"),
    "keep_margin": (0, True, None, "val_bpb a keep must win by", "0"),
    "max_consecutive_failures": (1, True, None, "crashes in a row before the incumbent is re-run", "3"),
    "baseline_seeds": (1, True, None, "seeds the baseline runs at", "3"),
    "max_runs": (1, True, None, "runs of one candidate at most", "5"),
    "probe_factor": (1, True, None, "probe rows per scored window at most in a keep's verification", "16"),
    "reserve_seeds": (0, True, None, "fresh seeds the best is re-measured at; 0 turns the reserve off", "4"),
    "ladder_seeds": (2, True, None, "fresh seeds each commit is measured at on the ladder", "3"),
    "ladder_every": (0, True, None, "kept changes between ladder rungs; 0 means at the end only", "5"),
    "alpha": (0, False, 0.5, "the chance of a false keep", "0.05"),
    "futility": (-10, True, 10, "the t statistic that stops a candidate early", "-0.5"),
    "drift_every": (0, True, None, "trials between drift checks; 0 means never", "10"),
    "drift_event_sigmas": (0, False, None, "paired-noise sds of a drift event", "3"),
    "drift_pause_sigmas": (0, False, None, "paired-noise sds of a drift that pauses", "8"),
    "pair_speed_tolerance": (0, False, None, "the |log ratio| of machine speeds a pair may differ by", "0.25"),
    "oom_repairs": (0, True, None, "halvings of the batch after out-of-memory", "3"),
    "llm_timeout": (0, False, None, "seconds one LLM request may take", "600"),
    "llm_retries": (0, True, None, "retries of a failed LLM request", "2"),
    "llm_retry_wait": (0, False, None, "seconds before an unreachable model is tried again", "60"),
    "llm_retry_max_wait": (0, False, None, "seconds between tries of an unreachable model at most", "300"),
    "llm_outage_wait": (0, True, None, "seconds a run with only a model waits for it", "7200"),
    "llm_max_repairs": (0, True, None, "times a rejected answer is sent back", "2"),
    "max_cost": (0, True, None, "US dollars of model tokens and GPU time", "20"),
    "gpu_hour_price": (0, True, None, "US dollars per GPU-hour", "2.5"),
    "agent_timeout": (0, False, None, "seconds before the agent is killed", "1800"),
    "workers": (0, True, None, "workers; 0 means one per GPU", "2"),
    "migrate_every": (0, True, None, "trials between migrations; 0 means never", "10"),
    "notify_timeout": (0, False, None, "seconds the notify command may take", "10"),
    "trial_memory_mb": (1, True, None, "MiB of memory a trial may hold", "16384"),
    "trial_processes": (1, True, None, "processes a trial may run at once", "1024"),
    "trial_disk_mb": (1, True, None, "MiB a trial may write to out/ and compile/", "8192"),
    "trial_files": (1, True, None, "files a trial may write", "10000"),
    "trial_log_mb": (1, True, None, "MiB of log a trial may print", "64"),
    "feed_memory_mb": (1, True, None, "MiB the data feed may hold for a trial", "256"),
    "schedule_floor": (0, True, 0.5, "the least share of proposals a source gets", "0.1"),
}


def setting_name(name: str, source: str) -> str:
    """A field as the source spells it: `--time-budget`, `AUTOLOOP_TIME_BUDGET`, `time-budget`."""
    if source.startswith("--"):
        return "--" + name.replace("_", "-")
    if source.startswith("environment"):
        return ENV_PREFIX + name.upper()
    return name.replace("_", "-")


def _shown(name: str, raw: Any, source: str) -> str:
    """`--time-budget -5`, `AUTOLOOP_TIME_BUDGET='-5'`, `time-budget = -5`: the setting as given."""
    key = setting_name(name, source)
    if source.startswith("--"):
        return f"{key} {raw:g}" if isinstance(raw, float) else f"{key} {raw}"
    if source.startswith("environment"):
        return f"{key}={raw} in the environment"
    return f"{key} = {raw!r}"


def _where(source: str) -> str:
    """The source's prefix for an error ('' for a flag or a variable, which name themselves)."""
    return "" if source.startswith(("--", "environment")) else f"{source}: "


def check_range(name: str, value: Any, source: str, raw: Any = None) -> None:
    """Refuse a number outside the field's range (`_RANGES`) in one line: the setting,
    the bad value, what it should be and an example."""
    if name not in _RANGES or value is None or isinstance(value, bool):
        return
    low, inclusive, high, what, good = _RANGES[name]
    shown = _shown(name, value if raw is None else raw, source)
    key = setting_name(name, source)
    example = {"-": f"{key} {good}", "e": f"{key}={good}"}.get(source[0], f"{key} = {good}")
    exclusive_high = name == "alpha"  # alpha = 0.5 would keep half of the changes that do nothing
    if not math.isfinite(value):
        problem = "is not a finite number"
    elif value < low or (value == low and not inclusive):
        problem = f"must be {'at least' if inclusive else 'more than'} {low:g}"
    elif high is not None and (value >= high if exclusive_high else value > high):
        problem = f"must be {'below' if exclusive_high else 'at most'} {high:g}"
    else:
        return
    leave = {"max_trials": "; leave it out for no limit", "hours": "; leave it out for no limit",
             "max_cost": "; leave it out for no limit", "max_steps": "; leave it out to train for the time budget"}
    leave = leave.get(name, "")
    raise AutoloopError(f"{_where(source)}{shown} {problem} ({what}): give e.g. {example}{leave}")


def _coerce(name: str, raw: Any, source: str) -> Any:
    """Turn a TOML, environment or flag value into the field's type, or say what is wrong."""
    value = _coerce_type(name, raw, source)
    if isinstance(value, (int, float)):
        check_range(name, value, source, raw)
    return value


def _coerce_type(name: str, raw: Any, source: str) -> Any:
    if name in _CHOICES:
        value = {True: "on", False: "off"}.get(raw, raw) if isinstance(raw, bool) else str(raw).strip().lower()
        if value not in _CHOICES[name]:
            raise AutoloopError(f"{_where(source)}{_shown(name, raw, source)} is not one of "
                                f"{', '.join(_CHOICES[name])}: fix the value")
        return value
    hint = _HINTS[name]
    args = [a for a in get_args(hint) if a is not type(None)]
    base = args[0] if get_origin(hint) is not None and args and get_origin(hint) is not list else hint
    if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none", "null") and type(None) in get_args(hint)):
        return None
    try:
        if hint is dict or get_origin(hint) is dict:
            # A TOML table, or JSON text in the environment / a flag.
            value = json.loads(raw) if isinstance(raw, str) else raw
            if not isinstance(value, dict):
                raise ValueError(raw)
            return value
        if get_origin(hint) is list or hint is list or get_origin(base) is list:
            if isinstance(raw, str):
                return [part.strip() for part in raw.split(",") if part.strip()]
            return [str(item) for item in raw]
        if base is bool:
            if isinstance(raw, bool):
                return raw
            value = str(raw).strip().lower()
            if value in ("1", "true", "yes", "on"):
                return True
            if value in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if base in (int, float) and isinstance(raw, bool):
            raise ValueError(raw)  # TOML's true is not a number of seconds
        if base is int:
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError(raw)
            return int(raw)
        if base is float:
            return float(raw)
        return str(raw)
    except (TypeError, ValueError):
        kind = getattr(base, "__name__", str(base))
        raise AutoloopError(f"{_where(source)}{_shown(name, raw, source)} is not a valid {kind}: fix the value") from None


def read_pyproject(repo: Path) -> dict[str, Any]:
    path = Path(repo) / "pyproject.toml"
    if not path.exists():
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise AutoloopError(f"{path} does not parse ({exc}): fix the TOML") from None
    section = data.get("tool", {}).get("autoloop", {})
    values = {}
    for key, raw in section.items():
        name = key.replace("-", "_")
        if name not in _FIELDS:
            raise AutoloopError(f"{path}: unknown setting [tool.autoloop] {key}: valid settings are {', '.join(sorted(_FIELDS))}")
        values[name] = _coerce(name, raw, f"{path} [tool.autoloop]")
    return values


def read_environment(environ: dict[str, str] | None = None) -> dict[str, Any]:
    environ = os.environ if environ is None else environ
    values = {}
    for name in _FIELDS:
        key = ENV_PREFIX + name.upper()
        if key in environ:
            values[name] = _coerce(name, environ[key], f"environment {key}")
    return values


def resolve(repo: Path | str = ".", flags: dict[str, Any] | None = None, environ: dict[str, str] | None = None) -> Config:
    """Defaults < pyproject.toml [tool.autoloop] < AUTOLOOP_* environment < flags (None = not given)."""
    merged: dict[str, Any] = {}
    merged.update(read_pyproject(Path(repo)))
    merged.update(read_environment(environ))
    for name, value in (flags or {}).items():
        if name not in _FIELDS:
            raise AutoloopError(f"unknown setting {name!r}")
        if value is not None:
            merged[name] = _coerce(name, value, f"--{name.replace('_', '-')}")
    return dataclasses.replace(Config(), **merged).with_defaults()
