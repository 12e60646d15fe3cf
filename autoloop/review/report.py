"""`autoloop report`: one self-contained HTML page about a run, to read in the morning or
to share.

The page holds a headline (trials, kept, discarded, crashed, invalid, keep rate, GPU
hours, baseline -> best and the relative gain; definitions in `autoloop.review.queries`), a
progress chart (kept trials measured at several seeds with error bars of ±1.96 standard
errors), the loss curves of the baseline and the best trial, the kept changes in order
with their deltas (mean ± standard error where a trial has several runs), the latest
ablation of the kept changes (`autoloop ablate`), the run's measured noise and drift
events, the most common crash and invalid reasons, and the ideas with what became of
them. Charts are drawn with matplotlib's Agg backend (no display needed),
written as PNG files next to the page and embedded in it as base64 data URIs, so the
HTML file alone is the whole report: it can be mailed or attached without its folder.

It only reads the db, so it can be made while the run is still going; the page then
says it is a snapshot and shows running trials as such. Every table is bounded
(`MAX_TABLE_ROWS`) and every query reads only the columns it needs, so a run of
10,000 trials renders in about a second.
"""

from __future__ import annotations

import base64
import html
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from autoloop.errors import AutoloopError
from autoloop.decide.effects import ablation_verdict, format_estimate, format_interval
from autoloop.review.queries import (
    CRASHED, baseline_trial, best_trial, common_reasons, headline, idea_outcomes, kept_trials, latest_ablations,
    noise_info, progress_points, require_trials, select,
)
from autoloop.review.text import describe_noise
from autoloop.store import Kind, Status, utcnow

MAX_TABLE_ROWS = 200
MAX_ANNOTATIONS = 12
PROGRESS_PNG = "progress.png"
CURVES_PNG = "loss_curves.png"
REPORT_HTML = "report.html"

# Colours: kept green, discarded grey, failures warm, the baseline blue.
COLOURS = {
    "keep": "#1a9850", "discard": "#9e9e9e", "crash": "#d73027", "timeout": "#f46d43", "invalid": "#984ea3",
    "interrupted": "#e6ab02", "running": "#2c7fb8", "baseline": "#2c7fb8", "best": "#1a9850",
    "drift": "#8c6d31", "ablation": "#7b3294",
}
_APART = (Status.CRASH.value, Status.TIMEOUT.value, Status.INVALID.value, Status.INTERRUPTED.value, Status.RUNNING.value)


@dataclass
class Report:
    html_path: Path
    images: dict[str, Path] = field(default_factory=dict)
    data: dict = field(default_factory=dict)


def default_out_dir(repo: Path, tag: str) -> Path:
    return Path(repo) / ".autoloop" / tag / "report"


def _new_figure(**kwargs):
    """A matplotlib Figure on the Agg canvas. Not pyplot: no global figure registry to
    leak into, nothing that looks for a display, and safe to use from any thread."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise AutoloopError("the report needs matplotlib, which is not installed: pip install 'autoloop[report]'") from None
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


# ---------------------------------------------------------------------------- data


def report_data(store, run: dict) -> dict:
    """Everything the page shows, as plain data (also what the tests compare with the db)."""
    require_trials(store, run)
    head = headline(store, run)
    base, best = baseline_trial(store, run), best_trial(store, run)
    kept = kept_trials(store, run)
    base_metric = base["metric"] if base else None
    for t in kept:
        t["vs_baseline"] = t["metric"] - base_metric if base_metric is not None and t["metric"] is not None else None
    running = select(store, "SELECT number, description, started_at FROM trials WHERE run_id = ? AND status = ? "
                            "ORDER BY number", (run["id"], Status.RUNNING.value))
    curves = {}
    for label, trial in (("baseline", base), ("best", best)):
        if trial is not None and (label == "baseline" or best is None or base is None or best["id"] != base["id"]):
            curves[label] = {
                "trial": trial["number"], "metric": trial["metric"],
                "points": select(store, "SELECT step, seconds, loss FROM curves WHERE trial_id = ? AND loss IS NOT NULL "
                                        "ORDER BY step, id", (trial["id"],)),
            }
    noise = noise_info(store, run)
    noise["drift"] = select(store, "SELECT e.message, e.created_at, t.number AS trial FROM events e LEFT JOIN trials t "
                                   "ON t.id = e.trial_id WHERE e.run_id = ? AND e.kind = 'drift' ORDER BY e.id",
                            (run["id"],))
    return {
        "noise": noise, "ablations": latest_ablations(store, run),
        "run": run, "headline": head, "kept": kept, "points": progress_points(store, run),
        "crash_reasons": common_reasons(store, run, CRASHED),
        "invalid_reasons": common_reasons(store, run, (Status.INVALID.value,)),
        "ideas": idea_outcomes(store, run), "running": running, "curves": curves,
        "flags": flagged_trials(store, run), "workers": worker_counts(store, run),
        "tree": experiment_tree(store, run), "generated_at": utcnow(),
    }


def experiment_tree(store, run: dict) -> dict:
    """The experiment tree's layout (autoloop.review.tree: the same picture as the live page's)."""
    from autoloop.review.tree import layout, tree_rows

    return layout(tree_rows(store, run))


def worker_counts(store, run: dict) -> list[dict]:
    """Trials per worker of a run on several workers (empty for a serial run)."""
    rows = select(store, "SELECT worker, status, COUNT(*) AS n FROM trials WHERE run_id = ? AND worker IS NOT NULL "
                         "GROUP BY worker, status ORDER BY worker", (run["id"],))
    workers: dict[str, dict] = {}
    for row in rows:
        entry = workers.setdefault(row["worker"], {"worker": row["worker"], "trials": 0, "statuses": {}})
        entry["trials"] += row["n"]
        entry["statuses"][row["status"]] = row["n"]
    return list(workers.values())


def flagged_trials(store, run: dict) -> list[dict]:
    """Trials whose curve the diagnosis flagged (autoloop.decide.diagnosis), with the messages."""
    import json

    rows = select(store, "SELECT number, status, description, flags FROM trials WHERE run_id = ? AND flags IS NOT NULL "
                         "ORDER BY number", (run["id"],))
    out = []
    for row in rows:
        flags = json.loads(row["flags"]) if isinstance(row["flags"], str) else row["flags"]
        if flags:
            out.append({"number": row["number"], "status": row["status"], "description": row["description"],
                        "messages": [f.get("message") or f.get("flag") for f in flags]})
    return out


# ---------------------------------------------------------------------------- charts


def progress_chart(data: dict, path: Path) -> Path:
    """Every trial as a point over its number: kept ones marked (with error bars where
    they are means of several runs), the running best as a step line, the baseline as a
    line; trials without a verdict on the metric (crashed, timed out, invalid,
    interrupted, running) in a strip of their own below."""
    _save(progress_figure(data), path)
    return path


def progress_figure(data: dict):
    """The progress chart as a matplotlib Figure (see `progress_chart`)."""
    fig = _new_figure(figsize=(12, 6.8))
    from matplotlib.ticker import MaxNLocator

    points = data["points"]
    head = data["headline"]
    apart = [p for p in points if p["status"] in _APART]
    rows = [s for s in _APART if any(p["status"] == s for p in apart)]
    heights = [6, 0.35 * max(len(rows), 1) + 0.4]
    ax, strip = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": heights, "hspace": 0.08})
    scored = [p for p in points if p["metric"] is not None and p["status"] not in _APART]
    metrics = sorted(p["metric"] for p in scored)
    baseline = head["baseline_metric"]
    if metrics:
        low = metrics[0]
        # Outliers (a diverged trial at 8.0 next to 1.0s) would flatten the chart:
        # the upper limit is the baseline or the 90th percentile, whichever is higher,
        # and points above it are drawn as triangles on the top edge.
        high = max(baseline if baseline is not None else metrics[-1], metrics[int(0.9 * (len(metrics) - 1))])
        span = (high - low) or abs(high) * 0.01 or 0.01
        top, bottom = high + 0.12 * span, low - 0.12 * span
        ax.set_ylim(bottom, top)
        # Drift checks and ablations measure the incumbent and its parts: they are not
        # proposals that failed, so they get markers of their own.
        measured = {kind: [p for p in scored if p["kind"] == kind and p["status"] != Status.KEEP.value and p["metric"] <= top]
                    for kind in (Kind.DRIFT.value, Kind.ABLATION.value)}
        discards = [p for p in scored if p["status"] != Status.KEEP.value
                    and not any(p in group for group in measured.values())]
        kept_all = [p for p in scored if p["status"] == Status.KEEP.value]
        kept = [p for p in kept_all if p["kind"] != Kind.BASELINE.value]
        baselines = [p for p in kept_all if p["kind"] == Kind.BASELINE.value]
        inside = [p for p in discards if p["metric"] <= top]
        above = [p for p in discards if p["metric"] > top]
        size = 14 if len(points) > 500 else 28
        if inside:
            ax.scatter(*_xy(inside), s=size, c=COLOURS["discard"], alpha=0.6, linewidths=0, zorder=2,
                       label=f"discarded ({len(inside)})")
        if above:
            ax.scatter(_xy(above)[0], _arr([top - 0.02 * (top - bottom)] * len(above)), marker="^",
                       s=size + 10, c=COLOURS["discard"], alpha=0.8, zorder=2,
                       label=f"discarded, above the chart ({len(above)})")
        for kind, marker, label in ((Kind.DRIFT.value, "s", "drift check"), (Kind.ABLATION.value, "v", "ablation")):
            if measured[kind]:
                ax.scatter(*_xy(measured[kind]), s=size + 6, marker=marker, facecolors="none",
                           edgecolors=COLOURS[kind], linewidths=1.2, zorder=2, label=f"{label} ({len(measured[kind])})")
        if baselines:
            ax.scatter(*_xy(baselines), s=80, marker="D", c=COLOURS["baseline"], edgecolors="black", linewidths=0.6,
                       zorder=4, label="baseline trial")
        if kept:
            ax.scatter(*_xy(kept), s=70 if len(kept) <= 50 else 36, c=COLOURS["keep"], edgecolors="black",
                       linewidths=0.6, zorder=4, label=f"kept ({len(kept)})")
        _error_bars(ax, kept_all)
        if kept_all:
            xs, ys, best = [], [], None
            for p in kept_all:
                if best is None or p["metric"] < best:
                    best = p["metric"]
                    xs.append(p["number"])
                    ys.append(best)
            xs.append(points[-1]["number"])
            ys.append(ys[-1])
            ax.step(xs, ys, where="post", color=COLOURS["best"], linewidth=2, alpha=0.8, zorder=3, label="running best")
        _annotate_kept(ax, kept_all, points[-1]["number"])
    else:
        ax.text(0.5, 0.5, "no trial has a metric yet", transform=ax.transAxes, ha="center", va="center", color="#666")
    if baseline is not None:
        ax.axhline(baseline, color=COLOURS["baseline"], linestyle="--", linewidth=1.2, zorder=1,
                   label=f"baseline {baseline:.4f}")
    ax.set_ylabel("val_bpb (lower is better)")
    ax.set_title(f"run '{head['run']}': {_plural(head['trials'], 'trial')}, {_plural(head['kept'], 'kept change')}",
                 loc="left", pad=24)
    ax.grid(True, alpha=0.25)
    # Above the axes, in one row: inside, it would hide points of a long run.
    entries = len(ax.get_legend_handles_labels()[0])
    if entries:
        # One row: a second one would run into the title.
        ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=max(entries, 6), fontsize=9 if entries <= 6 else 8,
                  frameon=False, handletextpad=0.3, columnspacing=1.2 if entries <= 6 else 0.8)

    for row, status in enumerate(rows):
        xs = [p["number"] for p in apart if p["status"] == status]
        strip.scatter(_arr(xs), _arr([row] * len(xs)), marker="x" if status in CRASHED else "o", s=30,
                      c=COLOURS[status], linewidths=1.5 if status in CRASHED else 0, zorder=3)
    strip.set_yticks(range(len(rows)))
    strip.set_yticklabels([f"{s} ({sum(1 for p in apart if p['status'] == s)})" for s in rows], fontsize=8)
    strip.set_ylim(-0.7, max(len(rows), 1) - 0.3)
    if not rows:
        strip.set_yticks([])
        strip.text(0.5, 0.5, "no crashed, invalid or interrupted trials", transform=strip.transAxes,
                   ha="center", va="center", color="#666", fontsize=9)
    strip.grid(True, axis="x", alpha=0.25)
    strip.set_xlabel("trial number")
    strip.xaxis.set_major_locator(MaxNLocator(integer=True))
    if points:
        strip.set_xlim(points[0]["number"] - 0.02 * max(len(points), 10), points[-1]["number"] + 0.02 * max(len(points), 10))
    fig.subplots_adjust(left=0.11, right=0.98, top=0.9, bottom=0.1)  # room for "interrupted (206)"
    return fig


def _arr(values):
    # numpy arrays, not lists: matplotlib converts a list of 10,000 floats element by element.
    import numpy as np

    return np.asarray(values, dtype=float)


def _xy(points: list[dict]):
    return _arr([p["number"] for p in points]), _arr([p["metric"] for p in points])


Z95 = 1.96  # error bars: ±1.96 standard errors, a 95% interval of the mean


def interval_points(points: list[dict]) -> list[dict]:
    """The points that get an error bar: a mean of several runs with a standard error."""
    return [p for p in points if (p.get("n_runs") or 0) > 1 and p.get("metric_sd") is not None
            and p.get("metric") is not None]


def _error_bars(ax, kept: list[dict]) -> None:
    """±1.96 standard errors around each kept trial measured at several seeds (its mean
    is itself uncertain; a single run has no bar: its spread is unknown)."""
    barred = interval_points(kept)
    if barred:
        ax.errorbar(_xy(barred)[0], _xy(barred)[1], yerr=_arr([Z95 * p["metric_sd"] for p in barred]), fmt="none",
                    ecolor="#14532d", elinewidth=1.4, capsize=4, zorder=3.5, label="mean ± 1.96 se")


def _annotate_kept(ax, kept: list[dict], last_number: int) -> None:
    """Label kept trials with their description: every one when there are few, else only
    the biggest improvements (labels of a long run would pile up into a smudge)."""
    chosen = kept
    if len(kept) > MAX_ANNOTATIONS:
        steps = sorted((p for p in kept if p.get("delta_step")), key=lambda p: p["delta_step"])
        chosen = sorted(steps[:MAX_ANNOTATIONS // 2], key=lambda p: p["number"])
    first = kept[0]["number"] if kept else 0
    for p in chosen:
        label = p.get("label") or f"#{p['number']}"
        # Labels of points in the right quarter grow leftwards, so they stay inside.
        right = last_number > first and (p["number"] - first) / (last_number - first) > 0.75
        ax.annotate(label, (p["number"], p["metric"]), textcoords="offset points", xytext=(-6 if right else 6, 5),
                    fontsize=8, color="#14532d", rotation=20, ha="right" if right else "left", va="bottom",
                    zorder=5, annotation_clip=True, clip_on=True)


def curves_chart(data: dict, path: Path) -> Path | None:
    """Training loss over steps for the baseline and the best trial (None if neither
    recorded a curve)."""
    curves = {k: v for k, v in data["curves"].items() if v["points"]}
    if not curves:
        return None
    fig = _new_figure(figsize=(12, 4.8))
    from matplotlib.ticker import MaxNLocator

    ax = fig.subplots()
    for label, curve in curves.items():
        xs = [p["step"] for p in curve["points"]]
        ys = [p["loss"] for p in curve["points"]]
        metric = f", val_bpb {curve['metric']:.4f}" if curve.get("metric") is not None else ""
        ax.plot(xs, ys, color=COLOURS[label], linewidth=1.6, marker="o" if len(xs) < 20 else None, markersize=4,
                label=f"{label}: trial {curve['trial']}{metric}")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    steps = {p["step"] for curve in curves.values() for p in curve["points"]}
    if len(steps) == 1:  # one logged step: give the axis integer room instead of ±0.05
        ax.set_xlim(min(steps) - 1, min(steps) + 1)
    ax.set_ylabel("training loss")
    ax.set_title("loss curves", loc="left")
    ax.grid(True, alpha=0.25)
    ax.legend(loc="upper right", fontsize=9)
    fig.subplots_adjust(left=0.11, right=0.98, top=0.9, bottom=0.13)  # aligned with the progress chart
    _save(fig, path)
    return path


def _save(fig, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, dpi=100, format="png")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- HTML


def _e(value) -> str:
    return html.escape("" if value is None else str(value))


def _f(value, spec: str = ".6f") -> str:
    return "–" if value is None else format(value, spec)


def _pct(value) -> str:
    return "–" if value is None else f"{value * 100:.1f}%"


def _img(path: Path | None, alt: str) -> str:
    if path is None:
        return f'<p class="muted">{_e(alt)}: no data recorded.</p>'
    encoded = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img class="chart" alt="{_e(alt)}" src="data:image/png;base64,{encoded}">'


def _stat(key: str, label: str, value: str, note: str = "") -> str:
    note_html = f'<div class="note">{_e(note)}</div>' if note else ""
    return (f'<div class="stat" data-key="{key}"><div class="label">{_e(label)}</div>'
            f'<div class="value">{_e(value)}</div>{note_html}</div>')


def _short(sha: str | None) -> str:
    return (sha or "")[:10]


def render_html(data: dict, progress_png: Path, curves_png: Path | None) -> str:
    run, head = data["run"], data["headline"]
    parts: list[str] = []
    add = parts.append
    add(f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>autoloop report: {_e(run['tag'])}</title><style>{_CSS}</style></head><body><main>")
    add(f"<h1>autoloop report <span class=\"tag\">{_e(run['tag'])}</span></h1>")
    meta = [f"branch <code>{_e(run.get('branch'))}</code>", f"base <code>{_e(_short(run.get('base_commit')))}</code>",
            f"run {_e(run.get('status'))}", f"started {_e((run.get('created_at') or '')[:16].replace('T', ' '))} UTC",
            f"report {_e(data['generated_at'][:16].replace('T', ' '))} UTC"]
    add(f"<p class=\"meta\">{' · '.join(meta)}</p>")
    if data["running"]:
        numbers = ", ".join(str(t["number"]) for t in data["running"])
        add(f"<p class=\"banner\" id=\"snapshot\">The run is still going (trial {_e(numbers)} running): "
            f"this report is a snapshot.</p>")

    # -- headline
    base, best = head["baseline_metric"], head["best_metric"]
    add("<section class=\"stats\" id=\"headline\">")
    add(_stat("trials", "trials", str(head["trials"])))
    add(_stat("kept", "kept", str(head["kept"])))
    add(_stat("discarded", "discarded", str(head["discarded"])))
    add(_stat("crashed", "crashed", str(head["crashed"]), f"{head['timeouts']} timed out" if head["timeouts"] else ""))
    add(_stat("invalid", "invalid", str(head["invalid"])))
    add(_stat("keep_rate", "keep rate", _pct(head["keep_rate"]), f"{head['kept']} of {head['decided']} decided"))
    add(_stat("gpu_hours", "GPU hours", f"{head['gpu_hours']:.2f}"))
    add(_stat("baseline_to_best", "baseline → best", f"{_f(base, '.4f')} → {_f(best, '.4f')}",
              f"trial {head['baseline_trial']} → trial {head['best_trial']}" if best is not None else ""))
    add(_stat("relative_gain", "relative gain", _pct(head["relative_gain"]) if head["relative_gain"] is not None else "–",
              "lower val_bpb is better"))
    add("</section>")
    extra = [f"{n} {s}" for s, n in (("interrupted", head["interrupted"]), ("running", head["running"])) if n]
    if extra:
        add(f"<p class=\"muted\">Also: {_e(', '.join(extra))}.</p>")

    # -- charts
    add("<h2>Progress</h2>")
    add(_img(progress_png, "progress chart"))
    add("<h2>Loss curves</h2>")
    add(_img(curves_png, "loss curves of the baseline and the best trial"))
    add(_tree_section(data.get("tree")))

    # -- kept changes
    kept = data["kept"]
    add(f"<h2>Kept changes <span class=\"count\">{head['kept']}</span></h2>")
    add("<table id=\"kept\"><thead><tr><th>trial</th><th>change</th><th class=\"num\">val_bpb</th>"
        "<th class=\"num\">Δ vs best before</th><th class=\"num\">Δ vs baseline</th><th class=\"num\">held-out</th>"
        "<th>commit</th></tr></thead><tbody>")
    for t in kept[:MAX_TABLE_ROWS]:
        cls = " class=\"baseline\"" if t["kind"] == "baseline" else ""
        desc = t.get("description") or ""
        if t["kind"] == "baseline":
            desc = "baseline: " + desc if not desc.startswith("baseline") else desc
        metric = format_estimate(t["metric"], t.get("metric_sd"), t.get("n_runs")) if t["metric"] is not None else "–"
        add(f"<tr data-trial=\"{t['number']}\"{cls}><td class=\"num\">{t['number']}</td><td>{_e(desc)}</td>"
            f"<td class=\"num\">{_e(metric)}</td><td class=\"num {_sign(t.get('delta'))}\">{_f(t.get('delta'), '+.6f')}</td>"
            f"<td class=\"num {_sign(t.get('vs_baseline'))}\">{_f(t.get('vs_baseline'), '+.6f')}</td>"
            f"<td class=\"num\">{_f(t.get('heldout_metric'))}</td><td><code>{_e(_short(t.get('trial_commit')))}</code></td></tr>")
    add("</tbody></table>")
    if len(kept) > MAX_TABLE_ROWS:
        add(f"<p class=\"muted\">First {MAX_TABLE_ROWS} of {len(kept)}; `autoloop log --status keep` lists all.</p>")

    if any((t.get("n_runs") or 0) > 1 for t in kept):
        add("<p class=\"muted\">val_bpb of several runs: mean ± standard error (runs).</p>")

    # -- ablation
    add(_ablation_section(data["ablations"]))

    # -- noise
    add(_noise_section(data["noise"]))

    # -- failures
    add("<h2>Why trials failed</h2><div class=\"two\">")
    for table_id, title, groups in (("crash-reasons", "Crashes and timeouts", data["crash_reasons"]),
                                    ("invalid-reasons", "Invalid", data["invalid_reasons"])):
        add(f"<div><h3>{_e(title)}</h3>")
        if not groups:
            add("<p class=\"muted\">None.</p></div>")
            continue
        add(f"<table id=\"{table_id}\"><thead><tr><th class=\"num\">count</th><th>reason (latest example)</th>"
            "<th>trials</th></tr></thead><tbody>")
        for g in groups:
            trials = ", ".join(str(n) for n in g["trials"][:8]) + (" …" if len(g["trials"]) > 8 else "")
            add(f"<tr><td class=\"num\">{g['count']}</td><td>{_e(g['reason'])}</td><td>{_e(trials)}</td></tr>")
        add("</tbody></table></div>")
    add("</div>")

    # -- what the curves say
    flagged = data.get("flags") or []
    if flagged:
        add(f"<h2>What the curves say <span class=\"count\">{len(flagged)}</span></h2>")
        add("<table id=\"flags\"><thead><tr><th class=\"num\">#</th><th>status</th><th>description</th>"
            "<th>diagnosis</th></tr></thead><tbody>")
        for f in flagged:
            add(f"<tr><td class=\"num\">{f['number']}</td><td>{_e(f['status'])}</td><td>{_e(f['description'] or '')}</td>"
                f"<td>{'<br>'.join(_e(m) for m in f['messages'])}</td></tr>")
        add("</tbody></table>")

    # -- ideas
    ideas = data["ideas"]
    add(f"<h2>Ideas <span class=\"count\">{len(ideas)}</span></h2>")
    if not ideas:
        add("<p class=\"muted\">No ideas were seeded (autoloop seed).</p>")
    else:
        add("<table id=\"ideas\"><thead><tr><th class=\"num\">id</th><th>idea</th><th>edit</th><th>status</th>"
            "<th>outcome</th></tr></thead><tbody>")
        for idea in ideas[:MAX_TABLE_ROWS]:
            sets = json.loads(idea["sets"]) if idea.get("sets") else None
            edit = ", ".join(f"{k}={v}" for k, v in sets.items()) if sets else ("patch" if idea["has_patch"] else "text only")
            add(f"<tr data-idea=\"{idea['id']}\"><td class=\"num\">{idea['id']}</td><td>{_e(idea['text'])}</td>"
                f"<td><code>{_e(edit)}</code></td><td>{_e(idea['status'])}</td><td>{_idea_outcome(idea, run)}</td></tr>")
        add("</tbody></table>")
        if len(ideas) > MAX_TABLE_ROWS:
            add(f"<p class=\"muted\">First {MAX_TABLE_ROWS} of {len(ideas)}; `autoloop ideas` lists all.</p>")

    # -- workers
    workers = data.get("workers") or []
    if workers:
        add(f"<h2>Workers <span class=\"count\">{len(workers)}</span></h2>")
        add("<table id=\"workers\"><thead><tr><th>worker</th><th class=\"num\">trials</th><th>outcomes</th>"
            "</tr></thead><tbody>")
        for w in workers:
            outcomes = ", ".join(f"{n} {s}" for s, n in sorted(w["statuses"].items()))
            add(f"<tr><td>{_e(w['worker'])}</td><td class=\"num\">{w['trials']}</td><td>{_e(outcomes)}</td></tr>")
        add("</tbody></table>")

    # -- environment
    add("<h2>Run</h2><table class=\"kv\" id=\"run\"><tbody>")
    config = run.get("config") or {}
    rows = [("host", run.get("host")), ("GPU", run.get("gpu")), ("torch", run.get("torch_version")),
            ("CUDA", run.get("cuda_version")), ("Python", run.get("python_version")),
            ("budget", f"{config['max_steps']} steps" if config.get("max_steps") else
             (f"{config['time_budget']:g} s" if config.get("time_budget") is not None else None)),
            ("proposers", ", ".join(config.get("proposers") or []) or None), ("keep margin", config.get("keep_margin")),
            ("noise", describe_noise(data["noise"].get("noise"))), ("decision rule", data["noise"].get("decision_rule")),
            ("data", run.get("data_fingerprint")), ("harness", run.get("harness_fingerprint")),
            ("best commit", head.get("best_commit"))]
    for label, value in rows:
        if value not in (None, ""):
            add(f"<tr><th>{_e(label)}</th><td><code>{_e(value)}</code></td></tr>")
    add("</tbody></table>")
    add("<footer>Generated by autoloop. Metrics are val_bpb (bits per byte) on the fixed validation split; "
        "held-out values come from the verifier.</footer></main></body></html>\n")
    return "".join(parts)


def _tree_section(tree: dict | None) -> str:
    """The experiment tree as inline SVG: kept trials on the trunk, the rest as leaves of
    the commit they were proposed from, islands as lanes (autoloop.review.tree)."""
    if not tree or not tree["nodes"]:
        return ""
    from autoloop.review.tree import svg

    note = (f"{tree['trials']} trials, {tree['keeps']} kept; at most {tree['leaf_cap']} leaves per commit are drawn"
            + (f", the {tree['hidden_keeps']} oldest kept commits are not" if tree.get("hidden_keeps") else "") + ".")
    return (f"<h2>Experiment tree</h2><p class=\"muted\">Every trial under the commit it was proposed from: kept "
            f"trials continue the trunk, the others hang below it (newest first), islands are lanes. Hover a node for "
            f"its trial. {_e(note)}</p><div class=\"tree\" id=\"tree\">{svg(tree)}</div>")


def _ablation_section(ablations: list[dict]) -> str:
    """The latest `autoloop ablate` figures: each kept change's marginal effect."""
    if not ablations:
        return ""
    parts = [f"<h2>Ablation <span class=\"count\">{len(ablations)}</span></h2>",
             "<p class=\"muted\">Each kept change reverted from the best commit and measured against it at the same "
             "seeds. Effect = val_bpb with the change minus without it (negative: the change helps); a change whose "
             "interval contains 0 is a candidate to drop (<code>autoloop finalize --drop-null</code>).</p>",
             "<table id=\"ablation\"><thead><tr><th>trial</th><th>change</th><th class=\"num\">effect</th>"
             "<th class=\"num\">95% interval</th><th class=\"num\">runs</th><th>verdict</th><th>ablation</th>"
             "</tr></thead><tbody>"]
    for a in ablations[:MAX_TABLE_ROWS]:
        f = a.get("figures")
        if f is None:
            effect, interval, n, verdict = "–", "–", "–", f"{a['status']}: {a.get('reason') or ''}"
            cls = ""
        else:
            effect, n, verdict = _f(f.effect, "+.4f"), str(f.n), ablation_verdict(f)
            interval = format_interval(f.low, f.high, f.level).split(" ", 2)[-1] or "–"
            cls = " class=\"drop\"" if f.drop else ""
        parts.append(f"<tr data-trial=\"{a['trial']}\"{cls}><td class=\"num\">{a['trial']}</td>"
                     f"<td>{_e(a.get('description'))}</td><td class=\"num\">{_e(effect)}</td>"
                     f"<td class=\"num\">{_e(interval)}</td><td class=\"num\">{_e(n)}</td><td>{_e(verdict)}</td>"
                     f"<td class=\"num\">{a['ablation']}</td></tr>")
    parts.append("</tbody></table>")
    return "".join(parts)


def _noise_section(noise: dict) -> str:
    """The run's measured noise and its drift events (nothing for a run from before
    noise-aware decisions)."""
    described = describe_noise(noise.get("noise"))
    drift = noise.get("drift") or []
    if not described and not drift:
        return ""
    parts = ["<h2>Noise and drift</h2>"]
    if described:
        rule = f" Decision rule: {noise['decision_rule']}." if noise.get("decision_rule") else ""
        parts.append(f"<p id=\"noise\">Measured noise: {_e(described)}.{_e(rule)} A difference within about two "
                     "paired standard deviations of zero is not distinguishable from the incumbent.</p>")
    if drift:
        parts.append("<table id=\"drift\"><thead><tr><th class=\"num\">trial</th><th>drift</th><th>when (UTC)</th>"
                     "</tr></thead><tbody>")
        for e in drift[-MAX_TABLE_ROWS:]:
            parts.append(f"<tr><td class=\"num\">{_e(e.get('trial'))}</td><td>{_e(e['message'])}</td>"
                         f"<td>{_e((e.get('created_at') or '')[:16].replace('T', ' '))}</td></tr>")
        parts.append("</tbody></table>")
    else:
        parts.append("<p class=\"muted\">No drift detected.</p>")
    return "".join(parts)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _sign(value) -> str:
    if value is None or value == 0:
        return ""
    return "better" if value < 0 else "worse"


def _idea_outcome(idea: dict, run: dict) -> str:
    if idea.get("trial") is None:
        return "<span class=\"muted\">not tried yet</span>" if idea["status"] == "pending" else "<span class=\"muted\">–</span>"
    where = f"trial {idea['trial']}" if idea.get("trial_run") == run["tag"] else f"run {idea['trial_run']} trial {idea['trial']}"
    status = idea.get("trial_status") or ""
    delta = f" ({idea['trial_delta']:+.6f})" if idea.get("trial_delta") is not None else ""
    return f"{_e(where)}: <span class=\"status {_e(status)}\">{_e(status)}</span>{_e(delta)}"


_CSS = """
:root { --fg:#1f2328; --muted:#656d76; --line:#d0d7de; --bg:#fff; --soft:#f6f8fa; --good:#1a7f37; --bad:#cf222e; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--fg);
  font:15px/1.45 -apple-system, BlinkMacSystemFont, "Segoe UI", Helvetica, Arial, sans-serif; }
main { max-width:1200px; margin:0 auto; padding:28px 32px 48px; }
h1 { font-size:26px; margin:0 0 4px; }
h1 .tag { font-family:ui-monospace, SFMono-Regular, Menlo, monospace; background:var(--soft); border:1px solid var(--line);
  border-radius:6px; padding:1px 8px; font-size:22px; }
h2 { font-size:19px; margin:32px 0 10px; padding-bottom:4px; border-bottom:1px solid var(--line); }
h3 { font-size:15px; margin:8px 0; }
.count { color:var(--muted); font-weight:normal; font-size:15px; }
.meta, .muted, footer { color:var(--muted); }
.meta { margin:0 0 18px; }
.banner { background:#fff8c5; border:1px solid #d4a72c; border-radius:6px; padding:8px 12px; }
code { font-family:ui-monospace, SFMono-Regular, Menlo, monospace; font-size:13px; }
.stats { display:grid; grid-template-columns:repeat(auto-fill, minmax(170px, 1fr)); gap:10px; }
.stat { border:1px solid var(--line); border-radius:8px; padding:10px 12px; background:var(--soft); }
.stat .label { color:var(--muted); font-size:13px; }
.stat .value { font-size:22px; font-weight:600; font-variant-numeric:tabular-nums; }
.stat .note { color:var(--muted); font-size:12px; }
.stat[data-key="relative_gain"] .value { color:var(--good); }
.stat[data-key="baseline_to_best"] { grid-column:span 2; }
.stat .value { white-space:nowrap; }
img.chart { width:100%; height:auto; border:1px solid var(--line); border-radius:6px; }
table { border-collapse:collapse; width:100%; font-size:14px; }
th, td { text-align:left; padding:5px 8px; border-bottom:1px solid var(--line); vertical-align:top; }
thead th { background:var(--soft); font-weight:600; }
tbody tr:nth-child(even) { background:#fbfcfd; }
td.num, th.num { text-align:right; font-variant-numeric:tabular-nums; white-space:nowrap; }
td.better { color:var(--good); } td.worse { color:var(--bad); }
tr.baseline td { color:var(--muted); font-style:italic; }
tr.drop td { color:var(--bad); }
.two { display:grid; grid-template-columns:1fr 1fr; gap:24px; }
@media (max-width:800px) { .two { grid-template-columns:1fr; } }
table.kv th { width:140px; background:none; color:var(--muted); font-weight:normal; }
.status.keep { color:var(--good); font-weight:600; } .status.crash, .status.timeout { color:var(--bad); }
.status.invalid { color:#8250df; }
footer { margin-top:36px; font-size:13px; }
div.tree { overflow-x:auto; border:1px solid var(--line); border-radius:6px; }
"""


def build_report(store, run: dict, out_dir: Path) -> Report:
    """Write report.html and the chart PNGs into `out_dir`; return their paths."""
    _new_figure()  # fail with the one-line error before anything is written
    data = report_data(store, run)
    _label_kept(data)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise AutoloopError(f"{out_dir} is a file: give --out a folder for report.html and its charts")
    out_dir.mkdir(parents=True, exist_ok=True)
    progress = progress_chart(data, out_dir / PROGRESS_PNG)
    curves = curves_chart(data, out_dir / CURVES_PNG)
    if curves is None and (out_dir / CURVES_PNG).exists():
        (out_dir / CURVES_PNG).unlink()  # a stale chart from an earlier report would mislead
    page = render_html(data, progress, curves)
    target = out_dir / REPORT_HTML
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, target)
    images = {"progress": progress}
    if curves is not None:
        images["loss_curves"] = curves
    return Report(html_path=target, images=images, data=data)


def _label_kept(data: dict) -> None:
    """Give the kept points of the progress chart their labels and step sizes."""
    by_number = {t["number"]: t for t in data["kept"]}
    for p in data["points"]:
        t = by_number.get(p["number"])
        if t is None or p["status"] != Status.KEEP.value:
            continue
        desc = (t.get("description") or "").strip()
        if t["kind"] == "baseline":
            desc = "baseline"
        p["label"] = f"#{p['number']} {desc[:32] + ('…' if len(desc) > 32 else '')}".strip()
        p["delta_step"] = t.get("delta") or 0.0
