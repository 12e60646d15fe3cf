"""What one measurement asks of a worker, and what the worker answers.

A measurement has two halves (docs/architecture.md, docs/scale-out.md): the controller's
(checkout, seals, the db and git) and the worker's (data feed, sandbox, training, budget
check, evaluation: `autoloop.measure.worker.run_job`). The worker may run in the controller's
process (the serial slot), in a worker subprocess on the same machine, or on a Ray node
that shares no filesystem with the controller. So everything the worker needs travels in
a `MeasureJob`, and everything the controller records comes back in a `JobResult`, both
plain data with a JSON round-trip:

* plain types only (str, int, float, bool, None, lists, dicts with str keys): a job must
  survive `json.dumps`, a pickle to a Ray node and an older or newer autoloop at the other
  end (unknown keys are ignored when reading, missing ones take their defaults);
* paths as str, never `Path`: on another machine they mean nothing by themselves, and a
  remote executor rewrites the machine-specific ones (data_dir, caches, python; None
  means "the worker's own default") before it hands the job to `run_job`;
* no controller, store, repo or verifier object: the worker has no db and no git, and
  whatever state the controller keeps across trials (the harness fingerprint, the run's
  data fingerprint) is copied in as values.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

JOB_KINDS = ("train", "verify")
RESULT_STATUSES = ("ok", "crash", "timeout", "invalid", "aborted", "lost", "stopped")


def _from_dict(cls, data: dict[str, Any]):
    if not isinstance(data, dict):
        raise ValueError(f"a {cls.__name__} is a JSON object, not {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class MeasureJob:
    """One training run of one commit at one seed (kind "train"), or the evaluation of a
    run's existing checkpoint (kind "verify": val, held-out and causality, what a keep
    candidate's runs go through; with `verify` False val and its probes only, the
    determinism re-check of a keep candidate under --no-verify).

    Paths are the controller's unless a remote executor rewrote them; None means the
    worker's own default (its interpreter, its harness, its cache folders)."""

    kind: str  # "train" | "verify"
    commit: str  # the commit measured (the worker never reads git: `sources` holds its files)
    seed: int
    role: str = "candidate"  # baseline | candidate | incumbent | drift | rerun | ablation
    tag: str = ""  # the run's tag, for the pause message a changed harness gives
    # The train script relative to the project folder, and the commit's editable files
    # {relative path: text}: what the evaluator imports (copied to run_dir/source), and
    # what a remote worker writes as its project. Empty when the command names no .py.
    script: str | None = "train.py"
    sources: dict[str, str] = field(default_factory=dict)
    train_argv: list[str] = field(default_factory=list)
    time_budget: float = 300.0
    max_steps: int | None = None
    grace_seconds: float = 180.0
    dataset: str | None = None  # the configured dataset name (a remote worker prepares it)
    data_dir: str = ""  # the prepared dataset, as the worker sees it
    data_fingerprint: str | None = None  # the run's: a result naming another dataset is invalid
    harness_fingerprint: str | None = None  # the run's harness (None: not known yet, not checked)
    # harness_mode: the real verifier is on (feed, sandbox, integrity snapshots, meta-only
    # data view). external_eval: val_bpb comes from the harness's evaluator (off with
    # --no-verify). verify: held-out and causality too (a train job of a keep candidate).
    harness_mode: bool = True
    external_eval: bool = True
    verify: bool = False
    # A keep candidate's verification: probes enough to catch a next-token peek worth the
    # run's paired noise (`probe_noise`, bpb; None: unknown) with probability 95%, at most
    # `probe_factor` x the scored windows (None: the harness's cap).
    probe_power: bool = False
    probe_noise: float | None = None
    probe_factor: int | None = None
    sandbox: str = "auto"  # the sandbox mode (autoloop.measure.sandbox.detect)
    harness_dir: str | None = None  # the harness whose files the integrity snapshot hashes
    integrity_python: str | None = None  # the interpreter of the trusted re-warm of bytecode
    cache_root: str | None = None  # the harness's cache (prepared data; autoloop's import root link)
    pycache_root: str | None = None  # the project's trusted bytecode prefixes' root (read-only to every stage)
    # The run's trusted torch.compile cache, filled by the baseline's first run (the user's own
    # code) and copied into each run's own cache; None: every run compiles from scratch.
    compile_seed: str | None = None
    python: str | None = None  # the interpreter of the trusted warm-up and the evaluator
    hidden: list[str] = field(default_factory=list)  # hidden from training: .git, .autoloop, the db (-wal, -shm)
    db_path: str | None = None  # the db, hidden from the evaluator
    env: dict[str, str] = field(default_factory=dict)  # extra environment (the slot's device: CUDA_VISIBLE_DEVICES)
    # A candidate's first run: the night's early-stop rule and the incumbent's curve at the
    # same seed ({"rule": StopRule.to_json(), "incumbent_curve": [...]}, autoloop.loop.stops);
    # the worker stops a clear loser (status "stopped"). None: never stopped.
    early_stop: dict | None = None
    # The run's baseline start-up ({"cpu_seconds", "wall_seconds"}, autoloop.trust.startup):
    # what the budget allows a trial before its first batch. None: the rule's default.
    startup_reference: dict | None = None
    # What the trial may spend (autoloop.measure.limits.TrialLimits.to_dict); empty: the defaults.
    limits: dict = field(default_factory=dict)
    # verify jobs: the run's checkpoint and its result JSON (the device it trained on)
    checkpoint: str | None = None
    result: dict | None = None
    # For `python -m autoloop.measure.worker`: where to run (run_job's arguments win when given).
    project_dir: str | None = None
    run_dir: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in JOB_KINDS:
            raise ValueError(f"job kind must be one of {JOB_KINDS}, not {self.kind!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MeasureJob":
        return _from_dict(cls, data)

    @classmethod
    def from_json(cls, text: str) -> "MeasureJob":
        return cls.from_dict(json.loads(text))


@dataclass
class JobResult:
    """What a worker gives back for one job; the controller seals, decides and records.

    status: ok | crash | timeout | invalid | aborted | lost ("lost": the worker itself died,
    its process or its Ray actor or node; set by a slot, never by run_job) | stopped (the
    early stop ended a clear loser's run: no metric; fields["stopped_at"] its progress). metric:
    val_bpb (the evaluator's, or the script's own without external evaluation), None
    unless ok. heldout: held-out bpb (verify). fields: the run's figures for the
    measurement and the trial row (wall_seconds, error_tail, result without its curve,
    timings, steps, tokens, `budget` figures, eval_seconds). result: the result JSON,
    curve included. device: "cpu", or the CUDA device's name. worker: the slot's name.
    pause: why the run must pause (the harness or the data changed under the run),
    None when it need not. repaired: harness bytecode the run planted, removed and
    written again by the trusted warm-up (the controller refreshes its reference).
    files: {name relative to the run folder: bytes}, only from a worker that does not
    share the controller's disk; the controller writes them into the run folder."""

    status: str
    reason: str | None = None
    metric: float | None = None
    metric_source: str | None = None
    heldout: float | None = None
    fields: dict = field(default_factory=dict)
    result: dict | None = None
    device: str | None = None
    worker: str | None = None
    pause: str | None = None
    repaired: list[str] = field(default_factory=list)
    files: dict[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in RESULT_STATUSES:
            raise ValueError(f"job status must be one of {RESULT_STATUSES}, not {self.status!r}")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        # JSON has no bytes: file contents travel as base64.
        data["files"] = {name: base64.b64encode(content).decode("ascii") for name, content in self.files.items()}
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "JobResult":
        data = dict(data)
        files = data.get("files") or {}
        data["files"] = {name: content if isinstance(content, bytes) else base64.b64decode(content)
                         for name, content in files.items()}
        return _from_dict(cls, data)

    @classmethod
    def from_json(cls, text: str) -> "JobResult":
        return cls.from_dict(json.loads(text))

    @classmethod
    def lost(cls, reason: str, *, worker: str | None = None) -> "JobResult":
        """The answer a slot gives when its worker died before it wrote a result."""
        return cls("lost", reason=reason, worker=worker)
