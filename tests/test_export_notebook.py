"""`autoloop export --format tsv` is read by autoresearch's own analysis notebook.

`notebook()` below re-implements the analysis logic of autoresearch's `analysis.ipynb`
cell by cell, as it is (pandas reads the TSV, statuses upper-cased, crashes filtered
out, the baseline is the first remaining row, the running minimum of kept val_bpb, the
y-limits from the baseline and the best kept value, the summary and the top hits), and
runs it on exports of runs that hold every status and every kind, built with the Store
API in a temporary db. On such a run the notebook used to stop with "Axis limits cannot
be NaN or Inf" (an `interrupted` first row: no number, not a crash).
"""

from __future__ import annotations

import io
import math
import re

import pytest

from autoloop.review.export import TSV_COLUMNS, export_text
from autoloop.store import Kind, Status, Store

pd = pytest.importorskip("pandas")
matplotlib = pytest.importorskip("matplotlib")

AUTORESEARCH = ["commit", "val_bpb", "memory_gb", "status", "description"]


# ---------------------------------------------------------------------------- the notebook


def notebook(tsv_text: str, out_dir) -> dict:
    """autoresearch's analysis.ipynb, cell by cell; returns what it printed and plotted."""
    import matplotlib.pyplot as plt

    plt.switch_backend("Agg")
    printed: list[str] = []
    say = printed.append

    # Cell 1: load.
    df = pd.read_csv(io.StringIO(tsv_text), sep="\t")
    df["val_bpb"] = pd.to_numeric(df["val_bpb"], errors="coerce")
    df["memory_gb"] = pd.to_numeric(df["memory_gb"], errors="coerce")
    df["status"] = df["status"].str.strip().str.upper()

    # Cell 2: outcomes and keep rate.
    counts = df["status"].value_counts()
    n_keep = counts.get("KEEP", 0)
    n_discard = counts.get("DISCARD", 0)
    n_crash = counts.get("CRASH", 0)
    n_decided = n_keep + n_discard
    if n_decided > 0:
        say(f"Keep rate: {n_keep}/{n_decided} = {n_keep / n_decided:.1%}")

    # Cell 3: kept experiments.
    kept = df[df["status"] == "KEEP"].copy()
    for i, row in kept.iterrows():
        say(f"  #{i:3d}  bpb={row['val_bpb']:.6f}  mem={row['memory_gb']:.1f}GB  {row['description']}")

    # Cell 4: val_bpb over time.
    fig, ax = plt.subplots(figsize=(16, 8))
    valid = df[df["status"] != "CRASH"].copy()
    valid = valid.reset_index(drop=True)
    baseline_bpb = valid.loc[0, "val_bpb"]
    below = valid[valid["val_bpb"] <= baseline_bpb + 0.0005]
    disc = below[below["status"] == "DISCARD"]
    ax.scatter(disc.index, disc["val_bpb"], c="#cccccc", s=12, alpha=0.5, zorder=2, label="Discarded")
    kept_v = below[below["status"] == "KEEP"]
    ax.scatter(kept_v.index, kept_v["val_bpb"], c="#2ecc71", s=50, zorder=4, label="Kept",
               edgecolors="black", linewidths=0.5)
    kept_mask = valid["status"] == "KEEP"
    kept_idx = valid.index[kept_mask]
    kept_bpb = valid.loc[kept_mask, "val_bpb"]
    running_min = kept_bpb.cummin()
    ax.step(kept_idx, running_min, where="post", color="#27ae60", linewidth=2, alpha=0.7, zorder=3, label="Running best")
    for idx, bpb in zip(kept_idx, kept_bpb):
        desc = str(valid.loc[idx, "description"]).strip()
        if len(desc) > 45:
            desc = desc[:42] + "..."
        ax.annotate(desc, (idx, bpb), textcoords="offset points", xytext=(6, 6), fontsize=8.0,
                    color="#1a7a3a", alpha=0.9, rotation=30, ha="left", va="bottom")
    best = kept_bpb.min()
    n_total = len(df)
    n_kept = len(df[df["status"] == "KEEP"])
    ax.set_title(f"Autoresearch Progress: {n_total} Experiments, {n_kept} Kept Improvements", fontsize=14)
    ax.legend(loc="upper right", fontsize=9)
    margin = (baseline_bpb - best) * 0.15
    ylim = (best - margin, baseline_bpb + margin)
    ax.set_ylim(*ylim)  # "Axis limits cannot be NaN or Inf" when baseline or best is not a number
    plt.tight_layout()
    plt.savefig(out_dir / "progress.png", dpi=30, bbox_inches="tight")
    plt.close(fig)

    # Cell 5: summary.
    kept = df[df["status"] == "KEEP"].copy()
    baseline_bpb = df.iloc[0]["val_bpb"]
    best_bpb = kept["val_bpb"].min()
    best_row = kept.loc[kept["val_bpb"].idxmin()]
    improvement = (baseline_bpb - best_bpb) / baseline_bpb * 100
    say(f"Baseline val_bpb:  {baseline_bpb:.6f}")
    say(f"Best val_bpb:      {best_bpb:.6f}")
    say(f"Total improvement: {baseline_bpb - best_bpb:.6f} ({improvement:.2f}%)")
    say(f"Best experiment:   {best_row['description']}")
    kept_sorted = kept.reset_index()
    for _, row in kept_sorted.iterrows():
        say(f"  Experiment #{row['index']:3d}: bpb={row['val_bpb']:.6f}  {str(row['description']).strip()}")

    # Cell 6: top hits.
    kept = df[df["status"] == "KEEP"].copy()
    kept["prev_bpb"] = kept["val_bpb"].shift(1)
    kept["delta"] = kept["prev_bpb"] - kept["val_bpb"]
    hits = kept.iloc[1:].copy().sort_values("delta", ascending=False)
    for rank, (_, row) in enumerate(hits.iterrows(), 1):
        say(f"{rank:4d}  {row['delta']:+.6f}  {row['val_bpb']:.6f}  {row['description']}")
    say(f"      {hits['delta'].sum():+.6f}              TOTAL improvement over baseline")

    return {"df": df, "counts": {"keep": int(n_keep), "discard": int(n_discard), "crash": int(n_crash)},
            "ylim": ylim, "baseline": float(baseline_bpb), "best": float(best_bpb), "improvement": float(improvement),
            "total_delta": float(hits["delta"].sum()), "printed": printed}


# ---------------------------------------------------------------------------- runs with every status


def sha(n: int) -> str:
    return f"{n:040x}"


def make_run(store: Store, tag: str, trials: list[tuple]) -> dict:
    """trials: (kind, status, metric, peak_memory_mb, description); every trial but a
    rejected proposal (invalid without a metric) has a commit."""
    run = store.create_run(tag, base_commit=sha(1))
    for n, (kind, status, metric, memory, description) in enumerate(trials, 1):
        committed = not (status == Status.INVALID and metric is None)
        store.new_trial(run["id"], kind, status=status, metric=metric, peak_memory_mb=memory,
                        description=description, trial_commit=sha(1000 + n) if committed else None,
                        metric_source="harness" if metric is not None else None,
                        reason=None if status in (Status.KEEP, Status.DISCARD, Status.RUNNING) else f"{status.value}\tbecause\nreasons")
    return store.get_run(tag)


K, P = Kind, Kind.PROPOSAL
S = Status
EVERY_STATUS = [
    (K.BASELINE, S.KEEP, 1.090619, 2048.0, "baseline"),
    (P, S.KEEP, 1.031008, 2100.0, "lr 0.015"),
    (P, S.CRASH, None, 3000.0, "crash it"),
    (P, S.TIMEOUT, None, None, "hang"),
    (P, S.INVALID, None, None, "broken constant"),  # rejected before commit
    (P, S.INVALID, 0.5, 2000.0, "leaks the validation set"),  # failed verification: a metric, not a result
    (P, S.INTERRUPTED, None, None, "stopped\tby the\nuser"),
    (K.RERUN, S.DISCARD, 1.0312, 2100.0, "re-run of the incumbent"),
    (K.DRIFT, S.KEEP, 1.0290, 2100.0, "drift check"),  # a re-measurement never counts as an improvement
    (K.ABLATION, S.DISCARD, 1.0400, 2000.0, "ablate the lr change"),
    (K.REPAIR, S.KEEP, 1.0000, None, "repair of trial 3"),  # no memory figure (CPU)
    (P, S.DISCARD, 1.1, 2200.0, 'wider, "quoted", # hash'),
    (P, S.RUNNING, None, None, "in flight"),
]
# The first baseline was interrupted (the controller was killed) and ran again.
BASELINE_RETRIED = [
    (K.BASELINE, S.INTERRUPTED, None, None, "baseline"),
    (K.BASELINE, S.CRASH, None, None, "baseline"),
    (K.BASELINE, S.KEEP, 1.2, 1024.0, "baseline"),
    (P, S.DISCARD, 1.25, 1024.0, "worse"),
    (P, S.TIMEOUT, None, None, "slow"),
]
# Nothing beat the baseline, and the last trial is still running.
NOTHING_KEPT = [
    (K.BASELINE, S.KEEP, 1.5, 512.0, "baseline"),
    (P, S.DISCARD, 1.6, 512.0, "worse"),
    (P, S.INTERRUPTED, None, None, "interrupted"),
    (P, S.RUNNING, None, None, "in flight"),
]
RUNS = {"every-status": EVERY_STATUS, "baseline-retried": BASELINE_RETRIED, "nothing-kept": NOTHING_KEPT}
EXPECTED_STATUS = {  # autoloop's status (and kind) -> autoresearch's
    "keep": "keep", "discard": "discard", "crash": "crash", "timeout": "crash", "invalid": "crash",
    "interrupted": "crash",
}


def expected_rows(trials: list[tuple]) -> list[dict]:
    """What the export must say, in autoresearch's terms, from the trials' definition."""
    rows = []
    for n, (kind, status, metric, memory, description) in enumerate(trials, 1):
        if status == S.RUNNING:
            continue
        mapped = EXPECTED_STATUS[status.value]
        if kind in (K.RERUN, K.DRIFT) and mapped == "keep":
            mapped = "discard"
        rows.append({"trial": n, "kind": kind.value, "autoloop_status": status.value, "status": mapped,
                     "metric": metric, "memory": memory})
    # Trial order, from the measured baseline on: failed baseline attempts before it are left out.
    first = next(i for i, r in enumerate(rows) if r["kind"] == "baseline" and r["status"] == "keep")
    return rows[first:]


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "experiments.db") as store:
        for tag, trials in RUNS.items():
            make_run(store, tag, trials)
        yield store


# With nothing kept but the baseline, the notebook sets equal y-limits: matplotlib widens
# them and warns, as it does for autoresearch's own results.tsv of such a night.
@pytest.mark.filterwarnings("ignore:Attempting to set identical low and high ylims")
@pytest.mark.parametrize("tag", list(RUNS))
def test_the_notebook_reads_the_export(store, tmp_path, tag):
    text = export_text(store, store.get_run(tag), "tsv")
    result = notebook(text, tmp_path)
    expected = expected_rows(RUNS[tag])
    # Only autoresearch's three statuses; the counts add up to every finished trial.
    counts = result["counts"]
    assert sum(counts.values()) == len(result["df"]) == len(expected)
    for status in ("keep", "discard", "crash"):
        assert counts[status] == sum(r["status"] == status for r in expected), status
    # Finite axis limits, the baseline is the measured baseline, the best the best kept change.
    assert all(math.isfinite(v) for v in result["ylim"]), result["ylim"]
    baseline = next(m for k, s, m, _, _ in RUNS[tag] if k == K.BASELINE and s == S.KEEP)
    kept = [r["metric"] for r in expected if r["status"] == "keep"]
    assert result["baseline"] == pytest.approx(baseline, abs=5e-7)
    assert result["best"] == pytest.approx(min(kept), abs=5e-7)
    assert math.isfinite(result["improvement"]) and result["total_delta"] == pytest.approx(baseline - min(kept), abs=2e-6)
    assert (tmp_path / "progress.png").stat().st_size > 0


@pytest.mark.parametrize("tag", list(RUNS))
def test_the_export_is_autoresearchs_results_tsv(store, tag):
    text = export_text(store, store.get_run(tag), "tsv")
    lines = text.splitlines()
    header = lines[0].split("\t")
    assert header[:5] == AUTORESEARCH and header == list(TSV_COLUMNS)
    assert header[5:7] == ["autoloop_status", "kind"]
    expected = expected_rows(RUNS[tag])
    assert len(lines) == 1 + len(expected)
    df = pd.read_csv(io.StringIO(text), sep="\t", dtype=str, keep_default_na=False)
    for (_, row), want in zip(df.iterrows(), expected):
        assert int(row["trial"]) == want["trial"]
        assert (row["status"], row["autoloop_status"], row["kind"]) == (want["status"], want["autoloop_status"], want["kind"])
        if want["status"] == "crash":  # autoresearch's placeholders for a crash
            assert (row["val_bpb"], row["memory_gb"]) == ("0.000000", "0.0")
        else:
            assert row["val_bpb"] == f"{want['metric']:.6f}"
            assert row["memory_gb"] == (f"{want['memory'] / 1024:.1f}" if want["memory"] is not None else "0.0")
        # The precise figures follow: the metric at full precision, empty when there is none.
        assert row["metric"] == (repr(want["metric"]) if want["metric"] is not None else "")
        assert re.fullmatch(r"[0-9a-f]{7}|", row["commit"])
    assert df.iloc[0]["kind"] == "baseline" and float(df.iloc[0]["val_bpb"]) > 0
    for line in lines:  # one trial per line, five leading fields always present
        assert len(line.split("\t")) == len(TSV_COLUMNS)


def test_the_notebook_stopped_on_the_old_export(tmp_path):
    """The bug, kept reproducible: an `interrupted` first row with no number, as the old
    export wrote it, gives the notebook NaN axis limits."""
    old = "commit\tval_bpb\tmemory_gb\tstatus\tdescription\n\t\t\tinterrupted\tbaseline\nabc1234\t1.1\t2.0\tkeep\tbaseline\n"
    with pytest.raises(ValueError, match="Axis limits cannot be NaN or Inf"):
        notebook(old, tmp_path)


def test_the_tsv_is_in_trial_order_and_says_what_it_leaves_out(store, tmp_path):
    """Trial 2 came before trial 1 in the export (the measured baseline moved first): rows are
    in trial order, the real status stays in autoloop_status, and the baseline attempts that
    failed before the measured baseline are left out, which `autoloop export` says."""
    from typer.testing import CliRunner

    from autoloop.cli import app

    left_out: list[int] = []
    text = export_text(store, store.get_run("baseline-retried"), "tsv", left_out)
    df = pd.read_csv(io.StringIO(text), sep="\t", dtype=str, keep_default_na=False)
    assert [int(n) for n in df["trial"]] == [3, 4, 5] and left_out == [1, 2]
    every = pd.read_csv(io.StringIO(export_text(store, store.get_run("every-status"), "tsv")), sep="\t", dtype=str,
                        keep_default_na=False)
    numbers = [int(n) for n in every["trial"]]
    assert numbers == sorted(numbers)
    assert list(every.loc[every["autoloop_status"] == "invalid", "status"]) == ["crash", "crash"]
    assert list(every.loc[every["autoloop_status"] == "timeout", "val_bpb"]) == ["0.000000"]
    result = CliRunner().invoke(app, ["export", "--repo", str(tmp_path), "--db", str(store.path), "--tag",
                                      "baseline-retried"])
    assert result.exit_code == 0
    assert "note: trial 1, 2 (baseline attempts that failed before the measured baseline) left out" in result.output


def test_csv_and_json_keep_autoloops_own_statuses(store):
    run = store.get_run("every-status")
    df = pd.read_csv(io.StringIO(export_text(store, run, "csv")))
    assert list(df["status"]) == [t[1].value for t in EVERY_STATUS]
