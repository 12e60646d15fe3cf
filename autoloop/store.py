"""experiments.db: the SQLite log of every run and trial.

Concurrency rules
-----------------
The controller is the only writer of experiments.db; reports, `autoloop status` and other
tools read it while a run is going. SQLite gives us that safely only with these rules:

* **WAL journal.** Readers read a snapshot and never block the writer; the writer never
  blocks readers. `synchronous=NORMAL` is durable enough in WAL mode (a power cut can lose
  the last transactions, never corrupt the file) and much faster than FULL.
* **A long busy timeout (30 s)**, both as `sqlite3.connect(timeout=...)` and as
  `PRAGMA busy_timeout`, so a second writer (a second controller started by mistake, a
  remote worker's importer, a test) waits for the lock instead of failing.
* **`BEGIN IMMEDIATE` for every read-then-write** (see `Store.transaction`). A deferred
  `BEGIN` takes the write lock only at its first write; if another connection committed
  after our first read, SQLite cannot upgrade our stale snapshot and fails at once with
  "database is locked" - the busy timeout does not help. `BEGIN IMMEDIATE` takes the write
  lock up front (waiting up to the busy timeout), so the read inside it is current. Trial
  numbers and idea hand-out depend on this.
* **Readers never hold write locks.** Reads run in autocommit mode (no explicit
  transaction) and fetch all rows at once, so the implicit read transaction ends before the
  method returns. Opening a Store only reads, unless migrations are pending.
* The connection is created with `isolation_level=None` (the driver never opens
  transactions behind our back) and `check_same_thread=False`; a re-entrant lock serialises
  threads that share one Store. `transaction()` nests via SAVEPOINTs.

All writes go through `transaction()`, inside which sqlite-utils' own `atomic()` uses
savepoints rather than a (deferred) `BEGIN` of its own.

Schema
------
The schema evolves through `MIGRATIONS`, an ordered list of named functions. Each applied
migration is recorded in `_migrations(name, applied_at)`; opening a database applies the
missing ones in order inside one `BEGIN IMMEDIATE` transaction. A database that records a
migration this code does not know was written by a newer autoloop and is refused rather
than misread. The vocabularies (`Status`, `Kind`, `MetricSource`, `Tier`,
`RunStatus`, `IdeaStatus`) are the single source of truth: the CHECK constraints are generated from
them. SQLite cannot alter a CHECK constraint in place, so adding a value to one of these
enums needs a new migration that rebuilds the affected table.

Values
------
Timestamps are UTC ISO-8601 strings (`utcnow()`). JSON columns (`JSON_COLUMNS`) take and
return Python objects; the Store serialises them. Enum members and plain strings are both
accepted wherever a vocabulary value is expected. Note that SQLite stores a NaN REAL as
NULL, so a NaN metric reads back as None.
"""

from __future__ import annotations

import enum
import json
import math
import re
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from autoloop.errors import AutoloopError, NotFound
from autoloop.base.redact import redact
from autoloop.base.text import CODE_COLUMNS, strip_controls, strip_controls_in


def _import_sqlite_utils():
    """Import sqlite-utils without letting it import pandas (~1 s of every CLI start).

    sqlite-utils imports pandas only to map `pd.Timestamp` to TEXT, which this store
    never inserts. Where pandas is already loaded (a notebook), nothing changes.
    """
    import sys

    if "pandas" in sys.modules or "sqlite_utils" in sys.modules:
        import sqlite_utils
        return sqlite_utils
    sys.modules["pandas"] = None  # type: ignore[assignment]  # makes `import pandas` fail fast
    try:
        import sqlite_utils
    finally:
        del sys.modules["pandas"]
    return sqlite_utils


sqlite_utils = _import_sqlite_utils()

BUSY_TIMEOUT_SECONDS = 30


# ---------------------------------------------------------------------------------------
# Vocabularies (mirrored in the CHECK constraints)
# ---------------------------------------------------------------------------------------


class Status(str, enum.Enum):
    """Outcome of a trial. Every status but `running` is final."""

    RUNNING = "running"
    KEEP = "keep"  # became the new best (verified); the branch stays on its commit
    DISCARD = "discard"  # trained fine but did not beat the best
    CRASH = "crash"  # non-zero exit, NaN loss, no metric
    TIMEOUT = "timeout"  # killed at the deadline
    INVALID = "invalid"  # rejected proposal or failed verification
    INTERRUPTED = "interrupted"  # the controller stopped or died while it ran


class Kind(str, enum.Enum):
    """Why a trial was run."""

    BASELINE = "baseline"
    PROPOSAL = "proposal"
    RERUN = "rerun"
    DRIFT = "drift"
    ABLATION = "ablation"
    REPAIR = "repair"
    LADDER = "ladder"  # a commit measured at a larger scale (autoloop.review.ladder); never a decision's run


class MetricSource(str, enum.Enum):
    """Where a trial's metric comes from; sources are never mixed in comparisons."""

    VERIFIED = "verified"  # re-evaluated out of process by the harness verifier
    HARNESS = "harness"  # from the train script's result JSON, not re-checked
    REPORTED = "reported"  # only the printed `key: value` block (e.g. a third-party script)


class Tier(str, enum.Enum):
    """How far a kept trial's gain is established (autoloop.decide.rule, docs/decisions.md)."""

    BASELINE = "baseline"  # the reference every gain is measured against; nothing to confirm
    ADOPTED = "adopted"  # the branch moved: the paired mean says better
    CONFIRMED = "confirmed"  # ... and the sequential test against the run's noise says so


class RunStatus(str, enum.Enum):
    ACTIVE = "active"
    PAUSED = "paused"
    STOPPED = "stopped"
    FINISHED = "finished"


class IdeaStatus(str, enum.Enum):
    PENDING = "pending"
    TAKEN = "taken"
    DONE = "done"
    DROPPED = "dropped"
    CANCELLED = "cancelled"  # by the user (`autoloop ideas --cancel N`): kept, never proposed


FINAL_STATUSES = frozenset(s for s in Status if s is not Status.RUNNING)

# Columns holding JSON text; the Store converts to and from Python objects.
JSON_COLUMNS: dict[str, frozenset[str]] = {
    "runs": frozenset({"config", "env_changes", "check_result", "islands"}),
    "trials": frozenset({"edits", "result", "flags", "decision", "budget"}),
    "ideas": frozenset({"sets"}),
    "measurements": frozenset({"budget", "curve"}),
    "ladder_rungs": frozenset({"overrides", "seeds", "plan", "result"}),
    "processes": frozenset({"info"}),
}

# Columns constrained to a vocabulary; values are validated before they reach SQLite so
# the error names the allowed values.
ENUM_COLUMNS: dict[str, dict[str, type[enum.Enum]]] = {
    "runs": {"status": RunStatus},
    "trials": {"kind": Kind, "status": Status, "metric_source": MetricSource, "tier": Tier},
    "ideas": {"status": IdeaStatus},
}


SQLITE_INT_MIN, SQLITE_INT_MAX = -(2**63), 2**63 - 1


def _storable(value: Any) -> Any:
    """`value` with what SQLite (and JSON) cannot hold made NULL: integers outside 64 bits,
    NaN and infinities, in nested lists and dicts too. Numbers a trial wrote are checked
    where they are read (autoloop.trust.untrusted); this keeps any that slip through from
    ending the controller."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value if SQLITE_INT_MIN <= value <= SQLITE_INT_MAX else None
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _storable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_storable(v) for v in value]
    return value


def ideas_for_run(prefix: str = "") -> str:
    """The SQL condition (one `?`: the run's id) for the ideas a run may take: its own and
    those for any run, not those waiting for a run of another tag not created yet."""
    return f"({prefix}run_id = ? OR ({prefix}run_id IS NULL AND {prefix}run_tag IS NULL))"


def _cut_words(text: str, width: int = 60) -> str:
    """An idea's text on one line, shortened for a message."""
    flat = " ".join(text.split())
    return f"'{flat}'" if len(flat) <= width else f"'{flat[:width - 3]}...'"


def utcnow() -> str:
    """The current time as a UTC ISO-8601 string, e.g. 2025-01-31T02:03:04.567+00:00."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _check(column: str, vocabulary: type[enum.Enum], nullable: bool = False) -> str:
    values = ", ".join(f"'{member.value}'" for member in vocabulary)
    if nullable:
        return f"CHECK ({column} IS NULL OR {column} IN ({values}))"
    return f"CHECK ({column} IN ({values}))"


# ---------------------------------------------------------------------------------------
# Migrations: append only. Never edit or reorder an applied migration; add a new one.
# ---------------------------------------------------------------------------------------


def _m0001_initial(conn: sqlite3.Connection) -> None:
    statements = [
        f"""
        CREATE TABLE runs (
            id INTEGER PRIMARY KEY,
            tag TEXT NOT NULL UNIQUE,
            branch TEXT,
            repo TEXT,
            base_commit TEXT,
            best_commit TEXT,
            config TEXT,
            host TEXT,
            gpu TEXT,
            driver TEXT,
            torch_version TEXT,
            cuda_version TEXT,
            python_version TEXT,
            data_fingerprint TEXT,
            harness_fingerprint TEXT,
            env_changes TEXT,
            status TEXT NOT NULL DEFAULT 'active' {_check('status', RunStatus)},
            pause_reason TEXT,
            stop_requested INTEGER NOT NULL DEFAULT 0,
            created_at TEXT NOT NULL,
            updated_at TEXT NOT NULL
        )""",
        f"""
        CREATE TABLE ideas (
            id INTEGER PRIMARY KEY,
            run_id INTEGER REFERENCES runs(id),
            text TEXT NOT NULL,
            sets TEXT,
            patch TEXT,
            priority INTEGER NOT NULL DEFAULT 0,
            status TEXT NOT NULL DEFAULT 'pending' {_check('status', IdeaStatus)},
            trial_id INTEGER REFERENCES trials(id),
            source TEXT,
            created_at TEXT NOT NULL
        )""",
        f"""
        CREATE TABLE trials (
            id INTEGER PRIMARY KEY,
            run_id INTEGER NOT NULL REFERENCES runs(id),
            number INTEGER NOT NULL,
            lineage TEXT NOT NULL DEFAULT 'main',
            kind TEXT NOT NULL {_check('kind', Kind)},
            status TEXT NOT NULL DEFAULT 'running' {_check('status', Status)},
            reason TEXT,
            derived_from INTEGER REFERENCES trials(id),
            proposer TEXT,
            idea_id INTEGER REFERENCES ideas(id),
            description TEXT,
            parent_commit TEXT,
            trial_commit TEXT,
            diff TEXT,
            edits TEXT,
            metric REAL,
            metric_source TEXT {_check('metric_source', MetricSource, nullable=True)},
            heldout_metric REAL,
            best_before REAL,
            delta REAL,
            training_seconds REAL,
            total_seconds REAL,
            compile_seconds REAL,
            eval_seconds REAL,
            verify_seconds REAL,
            wall_seconds REAL,
            num_steps INTEGER,
            total_tokens INTEGER,
            num_params INTEGER,
            mfu_percent REAL,
            peak_memory_mb REAL,
            seed INTEGER,
            program_hash TEXT,
            model TEXT,
            log_path TEXT,
            checkpoint_path TEXT,
            error_tail TEXT,
            pgid INTEGER,
            pid INTEGER,
            pid_start_time INTEGER,
            heartbeat_at TEXT,
            started_at TEXT,
            finished_at TEXT,
            created_at TEXT NOT NULL,
            result TEXT,
            UNIQUE (run_id, number)
        )""",
        """
        CREATE TABLE measurements (
            id INTEGER PRIMARY KEY,
            trial_id INTEGER NOT NULL REFERENCES trials(id),
            seed INTEGER,
            metric REAL,
            heldout_metric REAL,
            created_at TEXT NOT NULL
        )""",
        """
        CREATE TABLE curves (
            id INTEGER PRIMARY KEY,
            trial_id INTEGER NOT NULL REFERENCES trials(id),
            step INTEGER NOT NULL,
            seconds REAL,
            loss REAL,
            lr REAL,
            grad_norm REAL
        )""",
        """
        CREATE TABLE proposals (
            id INTEGER PRIMARY KEY,
            run_id INTEGER REFERENCES runs(id),
            trial_id INTEGER REFERENCES trials(id),
            proposer TEXT,
            model TEXT,
            prompt_tokens INTEGER,
            completion_tokens INTEGER,
            cost_usd REAL,
            latency_seconds REAL,
            error TEXT,
            created_at TEXT NOT NULL
        )""",
        """
        CREATE TABLE events (
            id INTEGER PRIMARY KEY,
            run_id INTEGER REFERENCES runs(id),
            trial_id INTEGER REFERENCES trials(id),
            kind TEXT NOT NULL,
            message TEXT,
            created_at TEXT NOT NULL
        )""",
        "CREATE INDEX trials_run_status ON trials(run_id, status)",
        "CREATE INDEX ideas_pending ON ideas(status, priority)",
        "CREATE INDEX measurements_trial ON measurements(trial_id)",
        "CREATE INDEX curves_trial ON curves(trial_id, step)",
        "CREATE INDEX proposals_trial ON proposals(trial_id)",
        "CREATE INDEX events_run ON events(run_id, id)",
    ]
    for statement in statements:
        conn.execute(statement)


def _m0002_trust_and_noise(conn: sqlite3.Connection) -> None:
    """Sandboxed trials, out-of-process evaluation, noise-aware decisions, diagnosis.

    runs: how trials were isolated (`sandbox`: "bwrap", "none: <why>", "off (--no-sandbox)"),
    the pooled noise estimate (`noise_sd` of one run, `noise_pair_sd` of a paired difference,
    `noise_df` its degrees of freedom), the decision rule in force, and `autoloop check`'s
    result. trials: the trial's uncertainty (`metric_sd`: standard error of the mean of its
    runs, `n_runs`), the decision's figures (`decision`), the measured budget (`budget`),
    diagnosis `flags`. measurements: one row per training run of a trial's code, with the
    role it played (`candidate`, `incumbent`, `drift`, `ablation`) and the trial whose
    comparison requested it (`for_trial_id`). processes: helper processes (a coding
    agent and its temporary clone) that crash recovery must clean up.
    """
    for table, column, declaration in [
        ("runs", "sandbox", "TEXT"),
        ("runs", "noise_sd", "REAL"),
        ("runs", "noise_pair_sd", "REAL"),
        ("runs", "noise_df", "INTEGER"),
        ("runs", "decision_rule", "TEXT"),
        ("runs", "check_result", "TEXT"),
        ("trials", "metric_sd", "REAL"),
        ("trials", "n_runs", "INTEGER"),
        ("trials", "decision", "TEXT"),
        ("trials", "budget", "TEXT"),
        ("trials", "flags", "TEXT"),
        ("trials", "heldout_sd", "REAL"),
        ("measurements", "role", "TEXT"),
        ("measurements", "for_trial_id", "INTEGER REFERENCES trials(id)"),
        ("measurements", "status", "TEXT"),
        ("measurements", "reason", "TEXT"),
        ("measurements", "num_steps", "INTEGER"),
        ("measurements", "total_tokens", "INTEGER"),
        ("measurements", "training_seconds", "REAL"),
        ("measurements", "wall_seconds", "REAL"),
        ("measurements", "eval_seconds", "REAL"),
        ("measurements", "verified", "INTEGER NOT NULL DEFAULT 0"),
        ("measurements", "budget", "TEXT"),
        ("measurements", "log_path", "TEXT"),
    ]:
        conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
    conn.execute(
        """
        CREATE TABLE processes (
            id INTEGER PRIMARY KEY,
            run_id INTEGER REFERENCES runs(id),
            trial_id INTEGER REFERENCES trials(id),
            what TEXT NOT NULL,
            pid INTEGER,
            pgid INTEGER,
            pid_start_time INTEGER,
            path TEXT,
            info TEXT,
            created_at TEXT NOT NULL,
            ended_at TEXT
        )"""
    )
    conn.execute("CREATE INDEX processes_live ON processes(ended_at)")
    conn.execute("CREATE INDEX measurements_for ON measurements(for_trial_id)")


def _m0003_workers(conn: sqlite3.Connection) -> None:
    """Several workers (autoloop.measure.executors): the device a run trained on
    (`measurements.device`: "cpu", or the CUDA device's name as nvidia-smi gives it; older
    rows have NULL), which worker trained a trial (`trials.worker`), and in islands mode
    each lineage's incumbent (`runs.islands`: {lineage: trial id})."""
    conn.execute("ALTER TABLE measurements ADD COLUMN device TEXT")
    conn.execute("ALTER TABLE trials ADD COLUMN worker TEXT")
    conn.execute("ALTER TABLE runs ADD COLUMN islands TEXT")


def _m0004_tiers_and_early_stops(conn: sqlite3.Connection) -> None:
    """Two tiers, early stops and the reserve (issue 19, docs/decisions.md).

    trials: `tier` of a kept trial ("adopted": the branch moved on the paired mean;
    "confirmed": the sequential test said so too; "baseline"), NULL for anything else and
    for rows from before tiers; `stopped_at`: the progress (0..1 of the budget) at which a
    clear loser's run was stopped early, NULL when it was not. measurements: `curve`, the
    run's loss curve (JSON points {step, seconds, loss, lr}), which the early stop
    compares a candidate with and calibrates on. A measurement's status may now also be
    "stopped" (its run ended early, no metric) and its role "reserve" (a run of the best at
    a fresh seed no decision used: the reported figures).
    """
    conn.execute(f"ALTER TABLE trials ADD COLUMN tier TEXT {_check('tier', Tier, nullable=True)}")
    conn.execute("ALTER TABLE trials ADD COLUMN stopped_at REAL")
    conn.execute("ALTER TABLE measurements ADD COLUMN curve TEXT")


def _m0005_machine_speed(conn: sqlite3.Connection) -> None:
    """The machine's speed around each training run (autoloop.measure.probe): the mean of a
    fixed probe's readings before and after training (`measurements.machine_speed`, in
    million loop iterations per second; NULL in step mode and for older rows) and the
    feed's throughput (`measurements.tokens_per_second`: tokens served over the training
    seconds). A pair of runs at different speeds is not a pair (autoloop.decide.confound)."""
    conn.execute("ALTER TABLE measurements ADD COLUMN machine_speed REAL")
    conn.execute("ALTER TABLE measurements ADD COLUMN tokens_per_second REAL")


def _m0006_cancelled_ideas(conn: sqlite3.Connection) -> None:
    """An idea can be cancelled (`autoloop ideas --cancel N`): IdeaStatus gains
    'cancelled', so the ideas table is rebuilt with the new CHECK constraint (SQLite cannot
    alter one in place), same rows, same ids: trials.idea_id still points at them.
    `_migrate` runs this with foreign keys off and checks them before it commits. The
    rebuilt table gains `run_tag`: an idea seeded with `--tag T` before run T exists waits
    for it (run_id NULL, run_tag T) and is bound to the run when `autoloop run --tag T`
    creates it; no other run takes it."""
    columns = [row[1] for row in conn.execute("PRAGMA table_info(ideas)")]
    conn.execute(
        f"""
        CREATE TABLE ideas_rebuilt (
            id INTEGER PRIMARY KEY,
            run_id INTEGER REFERENCES runs(id),
            text TEXT NOT NULL,
            sets TEXT,
            patch TEXT,
            priority INTEGER NOT NULL DEFAULT 0,
            status TEXT NOT NULL DEFAULT 'pending' {_check('status', IdeaStatus)},
            trial_id INTEGER REFERENCES trials(id),
            source TEXT,
            created_at TEXT NOT NULL,
            run_tag TEXT
        )"""
    )
    listed = ", ".join(columns)
    conn.execute(f"INSERT INTO ideas_rebuilt ({listed}) SELECT {listed} FROM ideas")
    conn.execute("DROP TABLE ideas")
    conn.execute("ALTER TABLE ideas_rebuilt RENAME TO ideas")
    conn.execute("CREATE INDEX ideas_pending ON ideas(status, priority)")


LADDER_TAGS = ("holds", "fades", "reverses")  # a kept change at a larger scale (autoloop.decide.ladder)


def _m0007_ladder(conn: sqlite3.Connection) -> None:
    """The scale ladder (autoloop.review.ladder): Kind gains 'ladder' (a commit measured at
    a larger scale: its runs have role 'ladder', never in the noise nor in a decision), so
    the trials table is rebuilt with the new CHECK constraint, same rows and ids, its
    indexes made again. `ladder_rungs` holds one rung: its spec (constant overrides and
    budget factor), its seeds, the cost planned before it started, its status ('running'
    until its last figure, so a restart finds it and goes on) and its headline;
    `ladder_tags` one kept change's effect there (with the change minus without it, paired
    by seed) and its tag."""
    sql = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'trials'").fetchone()[0]
    rebuilt = re.sub(r"CHECK \(kind IN \([^)]*\)\)", lambda _m: _check("kind", Kind), sql, count=1)
    rebuilt = re.sub(r"^CREATE TABLE \"?trials\"?", "CREATE TABLE trials_rebuilt", rebuilt, count=1)
    indexes = [row[0] for row in conn.execute(
        "SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'trials' AND sql IS NOT NULL")]
    columns = ", ".join(row[1] for row in conn.execute("PRAGMA table_info(trials)"))
    conn.execute(rebuilt)
    conn.execute(f"INSERT INTO trials_rebuilt ({columns}) SELECT {columns} FROM trials")
    conn.execute("DROP TABLE trials")
    conn.execute("ALTER TABLE trials_rebuilt RENAME TO trials")
    for index in indexes:
        conn.execute(index)
    conn.execute(
        """
        CREATE TABLE ladder_rungs (
            id INTEGER PRIMARY KEY,
            run_id INTEGER NOT NULL REFERENCES runs(id),
            spec TEXT NOT NULL,
            overrides TEXT,
            budget_factor REAL NOT NULL DEFAULT 1.0,
            seeds TEXT,
            best_trial_id INTEGER REFERENCES trials(id),
            best_commit TEXT,
            plan TEXT,
            result TEXT,
            status TEXT NOT NULL DEFAULT 'running' CHECK (status IN ('running', 'done', 'interrupted')),
            reason TEXT,
            created_at TEXT NOT NULL,
            finished_at TEXT
        )"""
    )
    tags = ", ".join(f"'{t}'" for t in LADDER_TAGS)
    conn.execute(
        f"""
        CREATE TABLE ladder_tags (
            id INTEGER PRIMARY KEY,
            rung_id INTEGER NOT NULL REFERENCES ladder_rungs(id),
            kept_trial_id INTEGER NOT NULL REFERENCES trials(id),
            ladder_trial_id INTEGER REFERENCES trials(id),
            tag TEXT NOT NULL CHECK (tag IN ({tags})),
            small_effect REAL,
            effect REAL NOT NULL,
            low REAL,
            high REAL,
            n INTEGER NOT NULL,
            level REAL,
            created_at TEXT NOT NULL,
            UNIQUE (rung_id, kept_trial_id)
        )"""
    )
    conn.execute("CREATE INDEX ladder_rungs_run ON ladder_rungs(run_id, id)")


MIGRATIONS: list[tuple[str, Callable[[sqlite3.Connection], None]]] = [
    ("0001_initial", _m0001_initial),
    ("0002_trust_and_noise", _m0002_trust_and_noise),
    ("0003_workers", _m0003_workers),
    ("0004_tiers_and_early_stops", _m0004_tiers_and_early_stops),
    ("0005_machine_speed", _m0005_machine_speed),
    ("0006_cancelled_ideas", _m0006_cancelled_ideas),
    ("0007_ladder", _m0007_ladder),
]


# ---------------------------------------------------------------------------------------
# The Store
# ---------------------------------------------------------------------------------------


class Store:
    """experiments.db, opened with the concurrency settings described in the module docstring.

    Rows come back as plain dicts with JSON columns decoded. `db` is the underlying
    `sqlite_utils.Database` for ad hoc read queries (reports); write only through the
    methods here so the locking rules hold.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.RLock()
        self._savepoints = 0
        self._columns: dict[str, list[str]] = {}
        _refuse_non_sqlite_file(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.conn = sqlite3.connect(
                str(self.path),
                timeout=BUSY_TIMEOUT_SECONDS,
                isolation_level=None,
                check_same_thread=False,
            )
        except sqlite3.Error as error:
            raise AutoloopError(
                f"cannot open {self.path} ({error}): check that --db points at a writable file"
            ) from error
        try:
            self._configure()
            self.db = sqlite_utils.Database(self.conn, execute_plugins=False)
            self._migrate()
            self._columns = {
                table: [row[1] for row in self.conn.execute(f"PRAGMA table_info({table})")]
                for table in ("runs", "trials", "ideas", "measurements", "curves", "proposals", "events", "processes",
                              "ladder_rungs", "ladder_tags")
            }
        except BaseException:
            self.conn.close()
            raise

    # -- lifecycle ------------------------------------------------------------------------

    def _configure(self) -> None:
        try:
            # busy_timeout first: switching to WAL needs a brief exclusive lock.
            self.conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_SECONDS * 1000}")
            mode = self.conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            self.conn.execute("PRAGMA synchronous = NORMAL")
            self.conn.execute("PRAGMA foreign_keys = ON")
        except sqlite3.DatabaseError as error:
            if _is_not_a_database(error):
                raise AutoloopError(
                    f"{self.path} is not an autoloop database ({error}): "
                    "point --db at an experiments.db or remove the file"
                ) from error
            raise
        if mode.lower() != "wal":
            # WAL needs shared memory; it fails on some network filesystems, and without
            # it readers would block the controller.
            raise AutoloopError(
                f"cannot use WAL journaling for {self.path} (got {mode!r}): "
                "put the database on a local filesystem"
            )

    def close(self) -> None:
        with self._lock:
            self.conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- migrations -----------------------------------------------------------------------

    def applied_migrations(self) -> list[str]:
        """Names recorded in `_migrations`, in the order they were applied."""
        if not self._table_exists("_migrations"):
            return []
        return [row["name"] for row in self.query("SELECT name FROM _migrations ORDER BY rowid")]

    def _migrate(self) -> None:
        known = [name for name, _ in MIGRATIONS]
        if not self._table_exists("_migrations"):
            others = [
                row["name"]
                for row in self.query(
                    "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
                )
            ]
            if others:
                # Someone else's SQLite file: do not add our tables to it.
                raise AutoloopError(
                    f"{self.path} is not an autoloop database (it has tables {', '.join(sorted(others))} "
                    "but no _migrations): point --db at an experiments.db or remove the file"
                )
        # Read-only check first so that opening an up-to-date database never takes the
        # write lock (readers must not block the controller).
        if self.applied_migrations() == known:
            return
        # A migration that rebuilds a table (a new CHECK vocabulary) drops the table other
        # tables' foreign keys point at: SQLite's own recipe turns the keys off around the
        # transaction (the pragma is a no-op inside one) and checks them before the commit.
        self.conn.execute("PRAGMA foreign_keys = OFF")
        try:
            self._apply_migrations(known)
        finally:
            self.conn.execute("PRAGMA foreign_keys = ON")

    def _apply_migrations(self, known: list[str]) -> None:
        with self.transaction():
            before = len(self.conn.execute("PRAGMA foreign_key_check").fetchall())
            self.conn.execute(
                "CREATE TABLE IF NOT EXISTS _migrations (name TEXT PRIMARY KEY, applied_at TEXT NOT NULL)"
            )
            # Re-read under the write lock: another process may have migrated meanwhile.
            applied = set(self.applied_migrations())
            unknown = sorted(applied - set(known))
            if unknown:
                raise AutoloopError(
                    f"experiments.db at {self.path} was written by a newer autoloop "
                    f"(unknown migration '{unknown[0]}'): upgrade autoloop or use another --db"
                )
            for name, migrate in MIGRATIONS:
                if name not in applied:
                    migrate(self.conn)
                    self.conn.execute(
                        "INSERT INTO _migrations (name, applied_at) VALUES (?, ?)", (name, utcnow())
                    )
            broken = self.conn.execute("PRAGMA foreign_key_check").fetchall()
            if len(broken) > before:  # only what the migrations did: an old file's own stay its own
                raise AutoloopError(f"migrating {self.path} would break {len(broken)} reference(s) between its tables "
                                    f"(first: {broken[0][0]} row {broken[0][1]} -> {broken[0][2]}): nothing was changed; "
                                    "please report this with the database")

    # -- transactions and low-level helpers ----------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[Store]:
        """`BEGIN IMMEDIATE` ... `COMMIT`, or `ROLLBACK` if the block raises.

        Use it around every read-then-write. Nested use (from the same thread) becomes a
        SAVEPOINT inside the outer transaction, so Store methods compose.
        """
        with self._lock:
            if self.conn.in_transaction:
                self._savepoints += 1
                name = f"autoloop_sp{self._savepoints}"
                self.conn.execute(f"SAVEPOINT {name}")
                try:
                    yield self
                except BaseException:
                    # An error that already destroyed the transaction leaves nothing to undo.
                    if self.conn.in_transaction:
                        self.conn.execute(f"ROLLBACK TO {name}")
                        self.conn.execute(f"RELEASE {name}")
                    raise
                else:
                    self.conn.execute(f"RELEASE {name}")
                finally:
                    self._savepoints -= 1
                return
            try:
                self.conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as error:
                if "locked" in str(error) or "busy" in str(error):
                    raise AutoloopError(
                        f"{self.path} stayed locked for {BUSY_TIMEOUT_SECONDS} s: another process "
                        "holds a write transaction; close it (e.g. an open sqlite3 shell) and retry"
                    ) from error
                raise
            try:
                yield self
            except BaseException:
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                raise
            try:
                self.conn.execute("COMMIT")
            except BaseException:
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                raise

    def query(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        """Run a read and fetch everything now, so no read transaction outlives the call: the
        one way a reader outside the Store (the review's queries, the db seal) runs SQL of
        its own. Rows are plain dicts (JSON columns not decoded)."""
        with self._lock:
            cursor = self.conn.execute(sql, tuple(params))
            names = [d[0] for d in cursor.description]
            return [dict(zip(names, row)) for row in cursor.fetchall()]


    def _table_exists(self, name: str) -> bool:
        return bool(
            self.query("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,))
        )

    def _encode(self, table: str, fields: dict[str, Any]) -> dict[str, Any]:
        """Validate column names and vocabularies; serialise JSON columns and enums; make
        every value one SQLite takes (`_storable`: a number out of range or not finite is
        NULL), strip every text of control characters but in the code columns
        (autoloop.base.text: a trial's text is data) and then redact it
        (autoloop.base.redact: no secret is ever stored)."""
        columns = self._columns[table]
        json_columns = JSON_COLUMNS.get(table, frozenset())
        enums = ENUM_COLUMNS.get(table, {})
        encoded: dict[str, Any] = {}
        for name, value in fields.items():
            if name not in columns:
                raise TypeError(f"{table} has no column {name!r}")
            if name in enums and value is not None:
                try:
                    value = enums[name](value).value
                except ValueError:
                    allowed = ", ".join(member.value for member in enums[name])
                    raise ValueError(f"{table}.{name} must be one of {allowed}, not {value!r}") from None
            elif name in json_columns and value is not None:
                value = _storable(value) if (table, name) in CODE_COLUMNS else strip_controls_in(_storable(value))
                value = redact(json.dumps(value, allow_nan=False, default=str))
            elif isinstance(value, enum.Enum):
                value = value.value
            elif isinstance(value, Path):
                value = str(value)
            value = _storable(value)
            if isinstance(value, str) and name not in json_columns:
                value = redact(value if (table, name) in CODE_COLUMNS else strip_controls(value))
            encoded[name] = value
        return encoded

    @staticmethod
    def _decode(table: str, row: dict[str, Any] | None) -> dict[str, Any] | None:
        if row is None:
            return None
        for name in JSON_COLUMNS.get(table, ()):
            if row.get(name) is not None:
                row[name] = json.loads(row[name])
        return row

    def rows(self, table: str, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        """A read of `table`'s rows with its JSON columns decoded (for readers: review, the live page)."""
        return self._rows(table, sql, params)

    def _rows(self, table: str, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        return [self._decode(table, row) for row in self.query(sql, params)]  # type: ignore[misc]

    def _insert(self, table: str, fields: dict[str, Any]) -> int:
        encoded = self._encode(table, fields)
        with self.transaction():
            row_id = int(self.db[table].insert(encoded).last_rowid)  # type: ignore[union-attr]
            self._wrote(table, row_id, encoded, inserted=True)
            return row_id

    def _update(self, table: str, row_id: int, fields: dict[str, Any]) -> None:
        encoded = self._encode(table, fields)
        if not encoded:
            return
        assignments = ", ".join(f"{name} = ?" for name in encoded)
        with self.transaction():
            cursor = self.conn.execute(
                f"UPDATE {table} SET {assignments} WHERE id = ?", (*encoded.values(), row_id)
            )
            if cursor.rowcount != 1:
                raise KeyError(f"no row with id {row_id} in {table}")
            self._wrote(table, row_id, encoded)

    # -- what this connection wrote (autoloop.trust.seal) ---------------------------------

    @property
    def mirror(self):
        """The OwnWrites this Store keeps told of its writes (autoloop.trust.seal), or None."""
        return getattr(self, "_mirror", None)

    def watch_own_writes(self, mirror) -> None:
        """Keep `mirror` (autoloop.trust.seal.OwnWrites) told of every row this Store writes,
        so that a seal can tell the controller's own writes, from any of its threads, from
        another process's."""
        with self._lock:
            self._mirror = mirror

    def _wrote(self, table: str, row_id: int, encoded: dict[str, Any], inserted: bool = False) -> None:
        mirror = getattr(self, "_mirror", None)
        if mirror is not None:
            mirror.wrote(table, row_id, encoded, inserted=inserted)

    def data_version(self) -> int:
        """SQLite's data_version: it changes when another connection commits (not ours)."""
        with self._lock:
            return int(self.conn.execute("PRAGMA data_version").fetchone()[0])

    # -- runs -----------------------------------------------------------------------------

    def create_run(self, tag: str, **fields: Any) -> dict[str, Any]:
        """Insert a run (status active) and return it. A tag is unique across the database."""
        now = utcnow()
        with self.transaction():
            if self.get_run(tag) is not None:
                raise AutoloopError(
                    f"a run tagged '{tag}' already exists in {self.path}: resume it or pick another --tag"
                )
            row_id = self._insert("runs", {"created_at": now, "updated_at": now, **fields, "tag": tag})
            return self._run_by_id(row_id)

    def get_run(self, tag: str) -> dict[str, Any] | None:
        rows = self._rows("runs", "SELECT * FROM runs WHERE tag = ?", (tag,))
        return rows[0] if rows else None

    def _run_by_id(self, run_id: int) -> dict[str, Any]:
        rows = self._rows("runs", "SELECT * FROM runs WHERE id = ?", (run_id,))
        if not rows:
            raise KeyError(f"no run with id {run_id}")
        return rows[0]

    def runs(self) -> list[dict[str, Any]]:
        return self._rows("runs", "SELECT * FROM runs ORDER BY id")

    def update_run(self, run_id: int, **fields: Any) -> None:
        """Set fields of a run; `updated_at` is set to now unless given."""
        self._update("runs", run_id, {"updated_at": utcnow(), **fields})

    def request_stop(self, tag: str) -> dict[str, Any]:
        """Ask the controller of run `tag` to stop after the current trial (it polls
        `stop_requested`). The controller clears the flag when it resumes the run."""
        with self.transaction():
            run = self.get_run(tag)
            if run is None:
                known = ", ".join(r["tag"] for r in self.runs()) or "none"
                raise NotFound(f"no run tagged '{tag}' in {self.path} (runs: {known}): check --tag and --db")
            self.update_run(run["id"], stop_requested=1)
            return self._run_by_id(run["id"])

    def stop_requested(self, run_id: int) -> bool:
        rows = self.query("SELECT stop_requested FROM runs WHERE id = ?", (run_id,))
        return bool(rows and rows[0]["stop_requested"])

    # -- trials ---------------------------------------------------------------------------

    def new_trial(self, run_id: int, kind: Kind | str, **fields: Any) -> dict[str, Any]:
        """Insert a trial with the run's next number (1, 2, ...) and return it.

        Status defaults to running. The number is allocated under `BEGIN IMMEDIATE`, so
        numbers stay unique per run across lineages and concurrent writers.
        """
        with self.transaction():
            number = self.query(
                "SELECT COALESCE(MAX(number), 0) + 1 AS n FROM trials WHERE run_id = ?", (run_id,)
            )[0]["n"]
            row_id = self._insert(
                "trials",
                {
                    "status": Status.RUNNING,
                    "created_at": utcnow(),
                    **fields,
                    "run_id": run_id,
                    "number": number,
                    "kind": kind,
                },
            )
            return self.trial_by_id(row_id)  # type: ignore[return-value]

    def update_trial(self, trial_id: int, **fields: Any) -> None:
        """Set fields of a trial.

        Setting a final status also stamps `finished_at` with now, unless it is given or
        already set (a later correction, e.g. keep -> invalid, keeps the first time).
        """
        status = fields.get("status")
        with self.transaction():
            self._update("trials", trial_id, fields)
            if status is not None and Status(status) in FINAL_STATUSES and "finished_at" not in fields:
                self.conn.execute(
                    "UPDATE trials SET finished_at = COALESCE(finished_at, ?) WHERE id = ?",
                    (utcnow(), trial_id),
                )

    def get_trial(self, run_id: int, number: int) -> dict[str, Any] | None:
        rows = self._rows("trials", "SELECT * FROM trials WHERE run_id = ? AND number = ?", (run_id, number))
        return rows[0] if rows else None

    def trial_by_id(self, trial_id: int) -> dict[str, Any] | None:
        rows = self._rows("trials", "SELECT * FROM trials WHERE id = ?", (trial_id,))
        return rows[0] if rows else None

    def kept_trial_of(self, run_id: int, commit: str) -> dict[str, Any] | None:
        """The last kept trial of `run_id` whose commit is `commit` (the incumbent a child of it meets)."""
        rows = self._rows("trials", "SELECT * FROM trials WHERE run_id = ? AND status = 'keep' AND trial_commit = ? "
                                    "ORDER BY number DESC LIMIT 1", (run_id, commit))
        return rows[0] if rows else None

    def trials(
        self,
        run_id: int | None = None,
        status: Status | str | Iterable[Status | str] | None = None,
        kind: Kind | str | Iterable[Kind | str] | None = None,
        last: int | None = None,
        lineage: str | None = None,
    ) -> list[dict[str, Any]]:
        """Trials ordered by (run, number). `status`/`kind` take one value or several;
        `last=N` returns only the N highest-numbered matches (still in ascending order)."""
        where, params = [], []
        if run_id is not None:
            where.append("run_id = ?")
            params.append(run_id)
        if lineage is not None:
            where.append("lineage = ?")
            params.append(lineage)
        for column, value, vocabulary in (("status", status, Status), ("kind", kind, Kind)):
            if value is None:
                continue
            values = [value] if isinstance(value, str) else list(value)
            values = [vocabulary(v).value for v in values]
            where.append(f"{column} IN ({', '.join('?' for _ in values)})")
            params.extend(values)
        sql = "SELECT * FROM trials"
        if where:
            sql += " WHERE " + " AND ".join(where)
        if last is not None:
            sql = f"SELECT * FROM ({sql} ORDER BY run_id DESC, number DESC LIMIT ?)"
            params.append(last)
        sql += " ORDER BY run_id, number"
        return self._rows("trials", sql, params)

    def running_trials(self, run_id: int | None = None) -> list[dict[str, Any]]:
        """Trials still marked running (of one run, or of all runs: for crash recovery)."""
        return self.trials(run_id=run_id, status=Status.RUNNING)

    def best_trial(self, run_id: int, lineage: str | None = None) -> dict[str, Any] | None:
        """The incumbent: the most recent kept trial (a successful baseline is the first), or
        None. The one way to find the best trial (the loop, the review, the proposers).

        A trial is kept only when it beats the incumbent of its time (by the run's decision
        rule), so the latest keep is the best: under the paired rule it is not necessarily
        the lowest single number, which may be a lucky draw of an earlier trial. Kept
        trials of one run share a metric source (verified, or reported for third-party
        scripts), so their metrics are comparable.

        `lineage` (islands mode, autoloop.loop.islands): that lineage's incumbent, the trial
        `runs.islands` names for it; a lineage without one yet starts from the run's main
        line ("main": the latest keep made outside every lineage).
        """
        if lineage is not None and lineage != "main":
            islands = self._run_by_id(run_id).get("islands") or {}
            trial_id = islands.get(lineage) if isinstance(islands, dict) else None
            row = self.trial_by_id(trial_id) if trial_id is not None else None
            if row is not None:
                return row
            lineage = "main"
        sql = "SELECT * FROM trials WHERE run_id = ? AND status = ? AND metric IS NOT NULL"
        params: list[Any] = [run_id, Status.KEEP.value]
        if lineage is not None:
            sql += " AND lineage = ?"
            params.append(lineage)
        else:
            # With parallel lineages (islands) the run's best is the best lineage's incumbent,
            # which need not be the latest keep: the run row names its commit.
            rows = self._rows("trials", sql + " AND trial_commit = (SELECT best_commit FROM runs WHERE id = ?)"
                              " ORDER BY number DESC LIMIT 1", [*params, run_id])
            if rows:
                return rows[0]
        rows = self._rows("trials", sql + " ORDER BY number DESC LIMIT 1", params)
        return rows[0] if rows else None

    # -- ideas ----------------------------------------------------------------------------

    def add_idea(
        self,
        text: str,
        *,
        run_id: int | None = None,
        sets: dict[str, Any] | None = None,
        patch: str | None = None,
        priority: int = 0,
        source: str | None = None,
        run_tag: str | None = None,
    ) -> dict[str, Any]:
        """Queue an idea (status pending). run_id None means any run may take it, unless
        `run_tag` names the run it waits for (not created yet: `bind_waiting_ideas`); `sets`
        maps hyperparameter constant names to values; higher priority is taken first.

        An idea still pending that is the same is refused (AutoloopError), in the same
        transaction as the insert: the same edit (sets and patch) whatever its words, or for
        a text-only idea the same text."""
        with self.transaction():
            same = self._same_pending_idea(text, sets, patch)
            if same is not None:
                raise AutoloopError(
                    f"idea {same['id']} is the same {'edit' if sets or patch else 'text'} and still queued "
                    f"({_cut_words(same['text'])}): not queued twice; `autoloop ideas --cancel {same['id']}` first "
                    "to replace it")
            row_id = self._insert(
                "ideas",
                {
                    "text": text,
                    "run_id": run_id,
                    "sets": sets,
                    "patch": patch,
                    "priority": priority,
                    "source": source,
                    "run_tag": run_tag,
                    "status": IdeaStatus.PENDING,
                    "created_at": utcnow(),
                },
            )
            return self._rows("ideas", "SELECT * FROM ideas WHERE id = ?", (row_id,))[0]

    def _same_pending_idea(self, text: str, sets: dict[str, Any] | None, patch: str | None) -> dict[str, Any] | None:
        edit = (sets or None, patch or None)
        for idea in self._rows("ideas", "SELECT * FROM ideas WHERE status = ? ORDER BY id", (IdeaStatus.PENDING.value,)):
            theirs = (idea.get("sets") or None, idea.get("patch") or None)
            if edit != (None, None) and theirs == edit:
                return idea
            if edit == theirs == (None, None) and " ".join(idea["text"].split()) == " ".join(text.split()):
                return idea
        return None

    def next_idea(self, run_id: int, *, actionable_only: bool = False) -> dict[str, Any] | None:
        """Take the next pending idea for this run (its own or a global one): highest
        priority first, then oldest. It is marked taken in the same transaction, so two
        controllers never take the same idea. `actionable_only` skips text-only ideas
        (no constants, no patch), which wait for an LLM or agent proposer."""
        actionable = " AND (sets IS NOT NULL OR patch IS NOT NULL)" if actionable_only else ""
        with self.transaction():
            rows = self._rows(
                "ideas",
                "SELECT * FROM ideas WHERE status = ? AND " + ideas_for_run() + actionable + " "
                "ORDER BY priority DESC, id LIMIT 1",
                (IdeaStatus.PENDING.value, run_id),
            )
            if not rows:
                return None
            self._update("ideas", rows[0]["id"], {"status": IdeaStatus.TAKEN})
            rows[0]["status"] = IdeaStatus.TAKEN.value
            return rows[0]

    def bind_waiting_ideas(self, run: dict[str, Any]) -> int:
        """Give the ideas seeded for this run's tag before it existed to the run; returns
        how many."""
        with self.transaction():
            return self.conn.execute("UPDATE ideas SET run_id = ? WHERE run_id IS NULL AND run_tag = ?",
                                     (run["id"], run["tag"])).rowcount

    def cancel_idea(self, idea_id: int) -> dict[str, Any]:
        """Mark a pending idea cancelled (kept, never proposed) and return it. An idea that
        is taken (being prepared or tried), done or cancelled already is refused in one line."""
        with self.transaction():
            rows = self._rows("ideas", "SELECT * FROM ideas WHERE id = ?", (idea_id,))
            if not rows:
                raise NotFound(f"there is no idea {idea_id}: `autoloop ideas` lists them with their numbers")
            idea = rows[0]
            why = {
                IdeaStatus.TAKEN.value: "a proposer has taken it (its trial is being prepared or trained); "
                                        "`autoloop stop` ends the run after that trial",
                IdeaStatus.DONE.value: "it was tried already" + "".join(
                    f" (trial {r['number']} of run '{r['tag']}')" for r in self.query(
                        "SELECT t.number, r.tag FROM trials t JOIN runs r ON r.id = t.run_id WHERE t.id = ?",
                        (idea.get("trial_id"),))),
                IdeaStatus.DROPPED.value: "it was dropped already",
                IdeaStatus.CANCELLED.value: "it is cancelled already",
            }.get(idea["status"])
            if why is not None:
                raise AutoloopError(f"idea {idea_id} cannot be cancelled: {why}")
            self._update("ideas", idea_id, {"status": IdeaStatus.CANCELLED})
            idea["status"] = IdeaStatus.CANCELLED.value
            return idea

    def set_idea_status(self, idea_id: int, status: IdeaStatus | str, trial_id: int | None = None) -> None:
        fields: dict[str, Any] = {"status": status}
        if trial_id is not None:
            fields["trial_id"] = trial_id
        self._update("ideas", idea_id, fields)

    def ideas(self, run_id: int | None = None, status: IdeaStatus | str | None = None) -> list[dict[str, Any]]:
        """Ideas oldest first; with run_id, that run's ideas plus the global ones."""
        where, params = [], []
        if run_id is not None:
            where.append(ideas_for_run())
            params.append(run_id)
        if status is not None:
            where.append("status = ?")
            params.append(IdeaStatus(status).value)
        sql = "SELECT * FROM ideas" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY id"
        return self._rows("ideas", sql, params)

    # -- per-trial detail tables ---------------------------------------------------------

    def add_curve(self, trial_id: int, points: Iterable[dict[str, Any]]) -> int:
        """Store a training curve: dicts with step, seconds, loss, lr, grad_norm (missing
        keys are NULL, other keys ignored). Returns the number of points stored."""
        keys = ("step", "seconds", "loss", "lr", "grad_norm")
        rows = [{"trial_id": trial_id, **{k: p.get(k) for k in keys}} for p in points]
        if rows:
            with self.transaction():
                self.db["curves"].insert_all(rows)
        return len(rows)

    def curve(self, trial_id: int) -> list[dict[str, Any]]:
        return self.query(
            "SELECT step, seconds, loss, lr, grad_norm FROM curves WHERE trial_id = ? ORDER BY step, id",
            (trial_id,),
        )

    def add_measurement(
        self, trial_id: int, metric: float | None, *, seed: int | None = None, heldout_metric: float | None = None,
        **fields: Any,
    ) -> int:
        """Record one run of a trial's code (re-runs add more rows for the same trial)."""
        return self._insert(
            "measurements",
            {"trial_id": trial_id, "seed": seed, "metric": metric, "heldout_metric": heldout_metric,
             "created_at": utcnow(), **fields},
        )

    def measurements_for(self, trial_id: int) -> list[dict[str, Any]]:
        """A trial's own measurements and those it asked of the incumbent, in order."""
        return self._rows("measurements", "SELECT * FROM measurements WHERE trial_id = ? OR for_trial_id = ? ORDER BY id",
                          (trial_id, trial_id))

    def update_measurement(self, measurement_id: int, **fields: Any) -> None:
        self._update("measurements", measurement_id, fields)

    # -- helper processes (a coding agent): recorded so crash recovery can end them ---------

    def add_process(self, run_id: int | None, what: str, **fields: Any) -> int:
        return self._insert("processes", {"run_id": run_id, "what": what, "created_at": utcnow(), **fields})

    def update_process(self, process_id: int, **fields: Any) -> None:
        self._update("processes", process_id, fields)

    def end_process(self, process_id: int) -> None:
        self._update("processes", process_id, {"ended_at": utcnow()})

    def live_processes(self, run_id: int | None = None) -> list[dict[str, Any]]:
        sql = "SELECT * FROM processes WHERE ended_at IS NULL"
        params: list[Any] = []
        if run_id is not None:
            sql += " AND run_id = ?"
            params.append(run_id)
        return self._rows("processes", sql + " ORDER BY id", params)

    def measurements(self, trial_id: int) -> list[dict[str, Any]]:
        return self._rows("measurements", "SELECT * FROM measurements WHERE trial_id = ? ORDER BY id", (trial_id,))

    def add_proposal_record(
        self,
        *,
        proposer: str,
        run_id: int | None = None,
        trial_id: int | None = None,
        model: str | None = None,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        cost_usd: float | None = None,
        latency_seconds: float | None = None,
        error: str | None = None,
    ) -> int:
        """Record one call to a proposer (tokens, cost, latency; `error` if it failed)."""
        return self._insert(
            "proposals",
            {
                "run_id": run_id,
                "trial_id": trial_id,
                "proposer": proposer,
                "model": model,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "cost_usd": cost_usd,
                "latency_seconds": latency_seconds,
                "error": error,
                "created_at": utcnow(),
            },
        )

    def add_event(self, run_id: int | None, kind: str, message: str, trial_id: int | None = None) -> int:
        """Log a run-level event, e.g. kind "env_change", "circuit_breaker", "paused"."""
        return self._insert(
            "events",
            {"run_id": run_id, "trial_id": trial_id, "kind": kind, "message": message, "created_at": utcnow()},
        )

    def events(self, run_id: int | None = None, kind: str | None = None, last: int | None = None) -> list[dict[str, Any]]:
        where, params = [], []
        if run_id is not None:
            where.append("run_id = ?")
            params.append(run_id)
        if kind is not None:
            where.append("kind = ?")
            params.append(kind)
        sql = "SELECT * FROM events" + (" WHERE " + " AND ".join(where) if where else "")
        if last is not None:
            sql = f"SELECT * FROM ({sql} ORDER BY id DESC LIMIT ?)"
            params.append(last)
        return self.query(sql + " ORDER BY id", params)

    # -- the scale ladder (autoloop.review.ladder) --------------------------------------------

    def add_rung(self, run_id: int, spec: str, **fields: Any) -> dict[str, Any]:
        """A new rung of the ladder (status running) and its row."""
        row_id = self._insert("ladder_rungs", {**fields, "run_id": run_id, "spec": spec, "created_at": utcnow()})
        return self.rung(row_id)  # type: ignore[return-value]

    def update_rung(self, rung_id: int, **fields: Any) -> None:
        self._update("ladder_rungs", rung_id, fields)

    def rung(self, rung_id: int) -> dict[str, Any] | None:
        rows = self._rows("ladder_rungs", "SELECT * FROM ladder_rungs WHERE id = ?", (rung_id,))
        return rows[0] if rows else None

    def rungs(self, run_id: int) -> list[dict[str, Any]]:
        """The run's rungs, oldest first (none in a database from before the ladder)."""
        if not self._table_exists("ladder_rungs"):
            return []
        return self._rows("ladder_rungs", "SELECT * FROM ladder_rungs WHERE run_id = ? ORDER BY id", (run_id,))

    def set_ladder_tag(self, rung_id: int, kept_trial_id: int, **fields: Any) -> None:
        """One kept change's figures and tag at a rung (a re-measured rung replaces them)."""
        with self.transaction():
            self.conn.execute("DELETE FROM ladder_tags WHERE rung_id = ? AND kept_trial_id = ?",
                              (rung_id, kept_trial_id))
            self._insert("ladder_tags", {**fields, "rung_id": rung_id, "kept_trial_id": kept_trial_id,
                                         "created_at": utcnow()})

    def ladder_tags(self, rung_id: int) -> list[dict[str, Any]]:
        return self.query("SELECT * FROM ladder_tags WHERE rung_id = ? ORDER BY kept_trial_id", (rung_id,))

    def integrity_check(self) -> list[str]:
        """`PRAGMA integrity_check` rows; ["ok"] for a healthy file."""
        return [row[0] for row in self.conn.execute("PRAGMA integrity_check").fetchall()]


# ---------------------------------------------------------------------------------------


def _refuse_non_sqlite_file(path: Path) -> None:
    """Refuse a path that exists but is not a SQLite file, before a writing connection
    touches it. The header is read through SQLite (a read-only connection), never with a
    plain open: closing any file descriptor of the db drops every POSIX lock this process
    holds on it, a read-only connection's beside it included (a live page that seeds),
    and SQLite would then delete the WAL under that connection when another writer closes."""
    if path.is_dir():
        raise AutoloopError(f"{path} is a directory: point --db at an experiments.db file")
    if not path.exists() or path.stat().st_size == 0:
        return  # a new (or empty) file becomes a new database
    from urllib.parse import quote

    probe = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_SECONDS)
    try:
        probe.execute("PRAGMA schema_version").fetchone()
    except sqlite3.DatabaseError as error:
        if _is_not_a_database(error):
            raise AutoloopError(
                f"{path} is not an autoloop database (not a SQLite file): "
                "point --db at an experiments.db or remove the file"
            ) from None
        raise
    finally:
        probe.close()


def _is_not_a_database(error: sqlite3.DatabaseError) -> bool:
    # SQLITE_NOTADB = 26, SQLITE_CORRUPT = 11
    return getattr(error, "sqlite_errorcode", None) in (11, 26) or "not a database" in str(error)
