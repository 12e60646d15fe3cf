"""Trials out of experiments.db: `autoloop export` (TSV, CSV, JSON) and
`autoloop.load_trials` (a typed pandas DataFrame for notebooks).

The TSV starts with autoresearch's `results.tsv` columns - commit (7 characters),
val_bpb, memory_gb (peak memory in GB, one decimal), status, description - so
autoresearch's analysis notebook reads it as is; autoloop's own columns follow. Rules
that keep it readable by that notebook and by line-oriented tools:

* one trial per line: tabs and newlines inside text fields become spaces (TSV only; the
  CSV and JSON keep text verbatim);
* a missing value is an empty field (pandas reads NaN), never autoresearch's 0.000000
  placeholder for a crash, so a crash cannot be mistaken for a perfect score;
* statuses are autoloop's own (keep, discard, crash, timeout, invalid, interrupted,
  running): the notebook counts keep/discard/crash and skips the rest;
* floats are written with full precision (`repr`), so the values read back equal the db.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from autoloop.errors import AutoloopError
from autoloop.review import require_trials, select
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


def export_text(store, run: dict, fmt: str) -> str:
    """The run's trials as TSV, CSV or JSON text (see the module docstring)."""
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
    writer = csv.writer(buffer, delimiter="\t" if fmt == "tsv" else ",", lineterminator="\n")
    writer.writerow(TABLE_COLUMNS)
    writer.writerows(_table_rows(store, run, flatten=fmt == "tsv"))
    return buffer.getvalue()


def write_export(store, run: dict, fmt: str, out: Path | None) -> str:
    """Export to `out` (written whole, then renamed into place) and return the text."""
    text = export_text(store, run, fmt)
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
                raise AutoloopError(f"no run tagged '{run}' in {path} (runs: {', '.join(runs.values()) or 'none'}): check the tag")
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

