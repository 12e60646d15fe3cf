"""Trials out of experiments.db: `autoloop export` (TSV, CSV, JSON) and
`autoloop.load_trials` (a typed pandas DataFrame for notebooks).

The TSV is autoresearch's `results.tsv`, so its analysis notebook and its other tools
read it unchanged. Its first five columns are exactly autoresearch's - commit (7
characters), val_bpb (6 decimals), memory_gb (peak memory in GB, 1 decimal), status,
description - with autoresearch's rules, which its notebook relies on:

* status is one of autoresearch's three: keep, discard, crash. autoloop's other
  outcomes are crashes there: timeout, invalid (a rejected proposal or a failed
  verification) and interrupted become `crash`, written as val_bpb `0.000000` and
  memory_gb `0.0` (the notebook drops crashes before it plots; a first row without a
  number stopped it with "Axis limits cannot be NaN or Inf");
* a re-measurement of the incumbent (kind rerun or drift) is never an improvement: it
  is `discard` (the row stays, so the line count is the number of finished trials and
  the time spent on re-runs shows; filter on `kind` for the keep rate of changes only);
* a trial still `running` has no outcome yet and is left out;
* rows are in trial order, and the first row is the measured baseline, since the
  notebook takes row 0 as the baseline (its summary divides by it): baseline attempts
  that failed before it (crashed, invalid, interrupted) are left out of the TSV, which
  says so on stderr (`autoloop export`); the CSV and JSON keep every trial;
* a keep or discard without a memory figure (e.g. on a CPU) has memory_gb `0.0`.

autoloop's precise figures follow in later columns: `autoloop_status` (keep, discard,
crash, timeout, invalid, interrupted), `kind`, `metric` (val_bpb at full precision,
empty when there is none), then run, trial, reason, timings, commits and the rest.
Tabs and line breaks in text fields become spaces, so each trial is one line.

The CSV and JSON exports are autoloop's own record: every trial, running ones
included, with autoloop's statuses, full-precision floats and empty fields (JSON null)
for missing values.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from autoloop.errors import AutoloopError, NotFound
from autoloop.review.queries import require_trials, select
from autoloop.store import JSON_COLUMNS, Kind, MetricSource, Status

FORMATS = ("tsv", "csv", "json")
AUTORESEARCH_COLUMNS = ("commit", "val_bpb", "memory_gb", "status", "description")
# autoloop's columns after autoresearch's: (export name, trials column).
EXTRA_COLUMNS = (
    ("run", None), ("trial", "number"), ("kind", "kind"), ("lineage", "lineage"), ("reason", "reason"),
    ("metric_source", "metric_source"), ("heldout_bpb", "heldout_metric"), ("best_before", "best_before"),
    ("delta", "delta"), ("proposer", "proposer"), ("model", "model"), ("idea_id", "idea_id"),
    ("derived_from", "derived_from"), ("training_seconds", "training_seconds"), ("total_seconds", "total_seconds"),
    ("wall_seconds", "wall_seconds"), ("num_steps", "num_steps"), ("total_tokens", "total_tokens"),
    ("num_params", "num_params"), ("mfu_percent", "mfu_percent"), ("peak_memory_mb", "peak_memory_mb"),
    ("seed", "seed"), ("trial_commit", "trial_commit"), ("parent_commit", "parent_commit"),
    ("started_at", "started_at"), ("finished_at", "finished_at"),
)
TABLE_COLUMNS = AUTORESEARCH_COLUMNS + tuple(name for name, _ in EXTRA_COLUMNS)
# The TSV: autoresearch's five, then autoloop's precise status, kind and metric, then the rest.
TSV_COLUMNS = AUTORESEARCH_COLUMNS + ("autoloop_status", "kind", "metric") + tuple(
    name for name, _ in EXTRA_COLUMNS if name != "kind")
# Re-measurements of the incumbent: never an improvement in autoresearch's terms.
_REMEASUREMENTS = (Kind.RERUN.value, Kind.DRIFT.value)
# Process bookkeeping is nobody's data.
_INTERNAL = ("pgid", "pid", "pid_start_time", "heartbeat_at")


_FLATTEN = frozenset({"description", "reason", "model", "proposer"})


def _flat(text):
    """One line: tabs and line breaks become spaces (None stays None: an empty field)."""
    if text is None or ("\t" not in text and "\n" not in text and "\r" not in text):
        return text
    return " ".join(text.replace("\t", " ").split("\n")).replace("\r", " ")


def _table_rows(store, run: dict, flatten: bool) -> list[list]:
    """Rows in TABLE_COLUMNS order, straight from one query; the csv module writes None
    as an empty field and floats with repr (full precision)."""
    sources = ["trial_commit", "metric", "peak_memory_mb", "status", "description"]
    sources += ["NULL" if column is None else column for _, column in EXTRA_COLUMNS]
    cursor = store.db.execute(f"SELECT {', '.join(sources)} FROM trials WHERE run_id = ? ORDER BY number", (run["id"],))
    names = ["commit", "val_bpb", "memory_gb", "status", "description"] + [name for name, _ in EXTRA_COLUMNS]
    flat = [i for i, name in enumerate(names) if name in _FLATTEN] if flatten else []
    run_at = names.index("run")
    rows = []
    for values in cursor.fetchall():
        row = list(values)
        row[0] = row[0][:7] if row[0] else None
        row[2] = round(row[2] / 1024, 1) if row[2] is not None else None
        row[4] = row[4] or ""
        row[run_at] = run["tag"]
        for i in flat:
            row[i] = _flat(row[i])
        rows.append(row)
    return rows


def export_text(store, run: dict, fmt: str, left_out: list[int] | None = None) -> str:
    """The run's trials as TSV, CSV or JSON text (see the module docstring); `left_out`
    collects the trials the TSV leaves out (baseline attempts before the measured one)."""
    fmt = fmt.lower()
    if fmt not in FORMATS:
        raise AutoloopError(f"unknown export format '{fmt}': use one of {', '.join(FORMATS)}")
    require_trials(store, run)
    if fmt == "json":
        # One trial per line, written by the C encoder (indent= would use the slow
        # pure-Python one: seconds for 10,000 trials with their diffs).
        columns = [c["name"] for c in select(store, "PRAGMA table_info(trials)")
                   if c["name"] not in _INTERNAL and c["name"] != "run_id"]
        decode = [i for i, name in enumerate(columns) if name in JSON_COLUMNS["trials"]]
        cursor = store.db.execute(f"SELECT {', '.join(columns)} FROM trials WHERE run_id = ? ORDER BY number", (run["id"],))
        names = ["run", *columns]
        lines = []
        for values in cursor.fetchall():
            row = [run["tag"], *values]
            for i in decode:
                if row[i + 1] is not None:
                    row[i + 1] = json.loads(row[i + 1])
            lines.append(json.dumps(dict(zip(names, row))))
        return "[\n" + ",\n".join(lines) + "\n]\n"
    buffer = io.StringIO()
    if fmt == "tsv":
        writer = csv.writer(buffer, delimiter="\t", lineterminator="\n")
        writer.writerow(TSV_COLUMNS)
        writer.writerows(_tsv_rows(_table_rows(store, run, flatten=True), left_out))
    else:
        writer = csv.writer(buffer, delimiter=",", lineterminator="\n")
        writer.writerow(TABLE_COLUMNS)
        writer.writerows(_table_rows(store, run, flatten=False))
    return buffer.getvalue()


def autoresearch_status(status: str, kind: str, metric: float | None) -> str | None:
    """autoloop's status -> autoresearch's keep | discard | crash; None: not exported
    (still running). See the module docstring."""
    if status == Status.RUNNING.value:
        return None
    if status in (Status.KEEP.value, Status.DISCARD.value) and metric is not None:
        return Status.DISCARD.value if kind in _REMEASUREMENTS else status
    return Status.CRASH.value


def _tsv_rows(table: list[list], left_out: list[int] | None = None) -> list[list]:
    """TABLE_COLUMNS rows -> TSV_COLUMNS rows in autoresearch's terms, in trial order from
    the measured baseline on (the numbers of the failed baseline attempts before it go
    into `left_out`)."""
    at = {name: i for i, name in enumerate(TABLE_COLUMNS)}
    rest = [at[name] for name in TSV_COLUMNS[8:]]
    first = next((i for i, row in enumerate(table) if row[at["kind"]] == Kind.BASELINE.value
                  and autoresearch_status(row[at["status"]], row[at["kind"]], row[at["val_bpb"]]) == Status.KEEP.value),
                 0)
    if left_out is not None:
        left_out.extend(row[at["trial"]] for row in table[:first] if row[at["status"]] != Status.RUNNING.value)
    rows = []
    for row in table[first:]:
        status, kind, metric, memory_gb = row[at["status"]], row[at["kind"]], row[at["val_bpb"]], row[at["memory_gb"]]
        mapped = autoresearch_status(status, kind, metric)
        if mapped is None:
            continue
        if mapped == Status.CRASH.value:
            val_bpb, memory = "0.000000", "0.0"
        else:
            val_bpb, memory = f"{metric:.6f}", f"{memory_gb if memory_gb is not None else 0.0:.1f}"
        rows.append([row[at["commit"]] or "", val_bpb, memory, mapped, row[at["description"]], status, kind, metric,
                     *(row[i] for i in rest)])
    return rows


def write_export(store, run: dict, fmt: str, out: Path | None, left_out: list[int] | None = None) -> str:
    """Export to `out` (written whole, then renamed into place) and return the text."""
    text = export_text(store, run, fmt, left_out)
    if out is not None:
        out = Path(out)
        if out.is_dir():
            raise AutoloopError(f"{out} is a directory: give --out a file name, e.g. {out / ('results.' + fmt.lower())}")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out)
    return text


# ---------------------------------------------------------------------------- notebooks

_INT_COLUMNS = ("number", "idea_id", "derived_from", "num_steps", "total_tokens", "num_params", "seed")
_FLOAT_COLUMNS = ("metric", "heldout_metric", "best_before", "delta", "training_seconds", "total_seconds",
                  "compile_seconds", "eval_seconds", "verify_seconds", "wall_seconds", "mfu_percent", "peak_memory_mb")
_TIME_COLUMNS = ("started_at", "finished_at", "created_at")
_CATEGORIES = {"kind": Kind, "status": Status, "metric_source": MetricSource}


def load_trials(db_path: str | Path, run: str | None = None):
    """The trials of `db_path` as a typed pandas DataFrame, one row per trial.

    `run` is a run tag; None loads every run (the `run` column names each one). Types:
    kind, status and metric_source are categoricals over their full vocabularies;
    integers are nullable `Int64`; metrics and timings `float64` (NaN when missing);
    timestamps `datetime64[ns, UTC]`; text columns the `string` dtype; `edits` and
    `result` hold the decoded JSON objects. Rows are ordered by run, then trial number.
    """
    import pandas as pd

    from autoloop.store import Store

    path = Path(db_path)
    if not path.is_file():
        raise AutoloopError(f"no trial database at {path}: pass the path of an experiments.db")
    store = Store(path)
    try:
        runs = {r["id"]: r["tag"] for r in select(store, "SELECT id, tag FROM runs ORDER BY id")}
        params: tuple = ()
        where = ""
        if run is not None:
            ids = [i for i, tag in runs.items() if tag == run]
            if not ids:
                raise NotFound(f"no run tagged '{run}' in {path} (runs: {', '.join(runs.values()) or 'none'}): check the tag")
            where, params = " WHERE run_id = ?", (ids[0],)
        rows = select(store, f"SELECT * FROM trials{where} ORDER BY run_id, number", params)
        columns = [c["name"] for c in select(store, "PRAGMA table_info(trials)")]
    finally:
        store.close()
    frame = pd.DataFrame.from_records(rows, columns=columns)
    frame.insert(0, "run", frame["run_id"].map(runs) if len(frame) else pd.Series(dtype="string"))
    frame = frame.drop(columns=[c for c in (*_INTERNAL, "id", "run_id") if c in frame.columns])
    for name in JSON_COLUMNS["trials"]:
        frame[name] = frame[name].map(lambda v: json.loads(v) if isinstance(v, str) else None).astype(object)
    for name in _INT_COLUMNS:
        frame[name] = pd.array(frame[name].tolist(), dtype="Int64") if len(frame) else pd.array([], dtype="Int64")
    for name in _FLOAT_COLUMNS:
        frame[name] = pd.to_numeric(frame[name], errors="coerce").astype("float64")
    for name in _TIME_COLUMNS:
        frame[name] = pd.to_datetime(frame[name], utc=True, format="ISO8601")
    for name, vocabulary in _CATEGORIES.items():
        frame[name] = pd.Categorical(frame[name], categories=[m.value for m in vocabulary])
    skip = set(_INT_COLUMNS) | set(_FLOAT_COLUMNS) | set(_TIME_COLUMNS) | set(_CATEGORIES) | set(JSON_COLUMNS["trials"])
    for name in frame.columns:
        if name not in skip:
            frame[name] = frame[name].astype("string")
    return frame.reset_index(drop=True)

