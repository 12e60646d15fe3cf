"""`autoloop report`: one self-contained HTML page about a run, to read in the morning or
to share.

The page holds a headline (trials, kept, discarded, crashed, invalid, keep rate, GPU or
CPU hours, baseline -> best and the change against the baseline; definitions in
`autoloop.review.queries`), a progress chart, the loss curves of the baseline and the
best trial, the kept changes in order with their deltas (mean ± standard error where a
trial has several runs), every discarded trial with what it tried and why it was
discarded, the latest ablation of the kept changes (`autoloop ablate`), the run's
measured noise, its drift checks and pairs at different machine speeds, the most common
crash and invalid reasons, and the ideas with what became of them.

The charts are inline SVG drawn in plain Python (autoloop.review.charts): the report
works with the README's install, which has no plotting library, and the HTML file alone
is the whole report (it can be mailed or attached without its folder).

The headline's change against the baseline (autoloop.decide.figures: best minus baseline,
`2.19% lower`) is shown as confirmed (green) only when the latest ablation of the best commit found
every kept change helps. When the ablation found some or all of them indistinguishable
from zero, the card says so rather than contradict the ablation table below it.

It only reads the db, so it can be made while the run is still going; the page then
says it is a snapshot and shows running trials as such. Every table is bounded
(`MAX_TABLE_ROWS`) and every query reads only the columns it needs, so a run of
10,000 trials renders in about a second.
"""

from __future__ import annotations

import html
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from autoloop.errors import AutoloopError
from autoloop.decide.effects import ablation_verdict, format_estimate, format_interval
from autoloop.review.charts import curves_svg, ladder_svg, point_groups, progress_svg
from autoloop.decide.figures import change_text, percent_text
from autoloop.loop.cost import cost_note, usd
from autoloop.review.queries import (
    CRASHED, baseline_trial, best_trial, common_reasons, discarded_trials, headline, idea_outcomes, kept_trials,
    ladder_summary, latest_ablations, noise_info, outage_info, progress_points, require_trials, select, trial_delta,
)
from autoloop.review.text import describe_noise, idea_edit
from autoloop.store import Kind, Status, utcnow

MAX_TABLE_ROWS = 200
REPORT_HTML = "report.html"


@dataclass
class Report:
    html_path: Path
    data: dict = field(default_factory=dict)


def default_out_dir(repo: Path, tag: str) -> Path:
    return Path(repo) / ".autoloop" / tag / "report"


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
        t["delta"] = trial_delta(t)
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
    noise["checks"] = select(store, "SELECT number, status, reason FROM trials WHERE run_id = ? AND kind = ? "
                                    "ORDER BY number", (run["id"], Kind.DRIFT.value))
    noise["fresh_checks"] = _fresh_checks(store, run)
    noise["confounded"] = select(store, "SELECT e.message, e.created_at, t.number AS trial FROM events e LEFT JOIN "
                                        "trials t ON t.id = e.trial_id WHERE e.run_id = ? AND e.kind = 'confounded' "
                                        "ORDER BY e.id", (run["id"],))
    ablations = latest_ablations(store, run)
    outages = outage_info(store, run)
    discarded, n_discarded = discarded_trials(store, run, MAX_TABLE_ROWS)
    return {
        "noise": noise, "ablations": ablations, "gain": gain_claim(head, ablations, kept),
        "ladder": ladder_summary(store, run),
        "discarded": discarded, "discarded_total": n_discarded,
        "run": run, "headline": head, "kept": kept, "points": progress_points(store, run),
        "crash_reasons": common_reasons(store, run, CRASHED),
        "invalid_reasons": common_reasons(store, run, (Status.INVALID.value,)),
        "ideas": idea_outcomes(store, run), "running": running, "curves": curves,
        "flags": flagged_trials(store, run), "workers": worker_counts(store, run),
        "tree": experiment_tree(store, run), "generated_at": utcnow(), "outages": outages,
        "lessons": earlier_lessons(store, run),
    }


def earlier_lessons(store, run: dict) -> list[str]:
    """What the project's earlier runs established (autoloop.proposers.memory): the tags
    of this db created before this run and the run's `memory-db` (relative to the db's folder, the repository)."""
    from autoloop.proposers.memory import earlier_trials, lessons

    other = (run.get("config") or {}).get("memory_db")
    path = None
    if other:
        path = Path(other).expanduser()
        path = path if path.is_absolute() else Path(store.path).parent / path
    try:
        return lessons(earlier_trials(store, run["id"], path if path is not None and path.is_file() else None))
    except AutoloopError as error:  # the other db went bad since: this run's report still stands
        return [str(error)]


def _fresh_checks(store, run: dict) -> int:
    """Comparisons whose incumbent was measured again next to the candidate before the
    run's first keep (autoloop.decide.confound): drift checks too."""
    rows = select(store, "SELECT decision FROM trials WHERE run_id = ? AND decision LIKE '%fresh_incumbent_seeds%'",
                  (run["id"],))
    return len(rows)


def gain_claim(head: dict, ablations: list[dict], kept: list[dict]) -> dict:
    """How the headline states the gain, so that it agrees with the ablation table:
    {state: none | measured | confirmed | partly | not confirmed | stale, note}."""
    changes = [t for t in kept if t["kind"] != Kind.BASELINE.value]
    if not changes or head.get("change") is None:
        return {"state": "none", "note": "no change was kept"}
    measured = [a for a in ablations if a.get("figures") is not None]
    current = [a for a in measured if a.get("parent_commit") == head.get("best_commit")]
    if not measured:
        return {"state": "measured", "note": "as measured; `autoloop ablate` checks each kept change"}
    if not current:
        return {"state": "stale", "note": "the ablation measured an earlier best: `autoloop ablate` again"}
    dropped = [a for a in current if a["figures"].drop]
    if not dropped and len(current) >= len(changes):
        return {"state": "confirmed", "note": "every kept change helps in the ablation"}
    if len(dropped) == len(current) >= len(changes):
        return {"state": "not confirmed", "note": "the ablation finds no kept change distinguishable from zero"}
    numbers = ", ".join(str(a["trial"]) for a in dropped)
    if dropped:
        return {"state": "partly", "note": f"the ablation finds no benefit from trial {numbers} "
                                           f"({len(dropped)} of {len(changes)} kept changes)"}
    return {"state": "measured", "note": f"the ablation measured {len(current)} of {len(changes)} kept changes"}


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
    rows = select(store, "SELECT number, status, description, flags FROM trials WHERE run_id = ? AND flags IS NOT NULL "
                         "ORDER BY number", (run["id"],), table="trials")
    out = []
    for row in rows:
        flags = row["flags"]
        if flags:
            out.append({"number": row["number"], "status": row["status"], "description": row["description"],
                        "messages": [f.get("message") or f.get("flag") for f in flags]})
    return out


# ---------------------------------------------------------------------------- HTML


def _e(value) -> str:
    return html.escape("" if value is None else str(value))


def _f(value, spec: str = ".6f") -> str:
    return "–" if value is None else format(value, spec)


def _pct(value) -> str:
    return "–" if value is None else f"{value * 100:.1f}%"


def _stat(key: str, label: str, value: str, note: str = "", state: str | None = None) -> str:
    note_html = f'<div class="note">{_e(note)}</div>' if note else ""
    state_attr = f' data-state="{_e(state)}"' if state else ""
    return (f'<div class="stat" data-key="{key}"{state_attr}><div class="label">{_e(label)}</div>'
            f'<div class="value">{_e(value)}</div>{note_html}</div>')


def _short(sha: str | None) -> str:
    return (sha or "")[:10]


def render_html(data: dict) -> str:
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
    if data.get("outages"):
        # A model that could not be reached explains a night of search-only or few trials.
        items = "".join(f"<li>{_e(o['line'])}</li>" for o in data["outages"])
        add(f"<div class=\"banner\" id=\"outages\"><p>Proposers that could not be reached:</p><ul>{items}</ul></div>")

    # -- headline: its counts are the chart's groups (charts.point_groups)
    base, best = head["baseline_metric"], head["best_metric"]
    groups = point_groups(data["points"])
    add("<section class=\"stats\" id=\"headline\">")
    add(_stat("trials", "trials", str(head["trials"])))
    add(_stat("kept", "kept", str(len(groups["kept"])), "changes; the baseline is not one"))
    also = [f"{n} {one if n == 1 else many}" for n, one, many in (
        (len(groups["remeasured"]), "drift check or re-run", "drift checks or re-runs"),
        (len(groups["ablation"]), "ablation", "ablations")) if n]
    add(_stat("discarded", "discarded", str(len(groups["discarded"])),
              "proposals; also " + " and ".join(also) if also else "proposals"))
    add(_stat("crashed", "crashed", str(head["crashed"]), f"{head['timeouts']} timed out" if head["timeouts"] else ""))
    add(_stat("invalid", "invalid", str(head["invalid"])))
    add(_stat("keep_rate", "keep rate", _pct(head["keep_rate"]), f"{head['kept']} of {head['decided']} decided"))
    add(_stat("compute_hours", f"{head['compute']} hours", f"{head['compute_hours']:.2f}",
              "wall time of every training run"))
    add(_stat("spent", "spent", usd(head["cost"]["spent_usd"]), cost_note(head["cost"])))
    gain = data["gain"]
    reserve = head.get("reserve")
    change = head.get("change")  # the one baseline -> best pair (autoloop.decide.figures)
    if change is not None and change["source"] != "selection":
        # The reported figure: the best re-measured at fresh seeds no decision used (autoloop.loop.reserve).
        interval = (f"95% interval {_f(change['low'], '+.4f')} to {_f(change['high'], '+.4f')}"
                    if change.get("low") is not None and change.get("high") is not None else "")
        add(_stat("baseline_to_best", "baseline → best",
                  f"{_f(change['baseline'], '.4f')} → {_f(change['best'], '.4f')} ± {_f(reserve['value_se'], '.4f')}",
                  (f"trial {head['baseline_trial']}: nothing was kept; the baseline's own {reserve['n']} runs"
                   if change["source"] == "baseline" else
                   f"trial {head['baseline_trial']} → trial {head['best_trial']}, re-measured at {reserve['n']} fresh "
                   f"seeds (selected at {_f(best, '.4f')})")))
        note = "; ".join(x for x in (change_text(change["delta"]).split(" (")[0], interval or gain["note"]) if x)
        add(_stat("relative_gain", "change vs baseline", percent_text(change["relative"]), note, state=gain["state"]))
    else:
        add(_stat("baseline_to_best", "baseline → best", f"{_f(base, '.4f')} → {_f(best, '.4f')}",
                  (f"trial {head['baseline_trial']} → trial {head['best_trial']}; the selection mean, not re-measured "
                   "at fresh seeds") if best is not None else ""))
        value = percent_text(change["relative"]) if change is not None and gain["state"] != "none" else "–"
        note = (change_text(change["delta"]).split(" (")[0] + "; " if change is not None and gain["state"] != "none"
                else "") + gain["note"]
        add(_stat("relative_gain", "change vs baseline", value, note, state=gain["state"]))
    add(_stat("confirmed", "confirmed", str(head.get("confirmed", 0)),
              f"of {head['kept']} kept; {head.get('stopped_early', 0)} stopped early"))
    add("</section>")
    extra = [f"{n} {s}" for s, n in (("interrupted", head["interrupted"]), ("running", head["running"])) if n]
    if extra:
        add(f"<p class=\"muted\">Also: {_e(', '.join(extra))}.</p>")

    # -- charts
    add("<h2>Progress</h2>")
    add(f"<div class=\"chart\">{progress_svg(data)}</div>")
    add("<p class=\"muted\">Grey points are discarded proposals, labelled with their trial number: the table of "
        "discarded trials below says what each tried and why it was discarded. Hover a point for its details.</p>")
    add("<h2>Loss curves</h2>")
    curves = curves_svg(data)
    add(f"<div class=\"chart\">{curves}</div>" if curves else
        "<p class=\"muted\">No loss curve was recorded for the baseline or the best trial.</p>")
    add(_tree_section(data.get("tree")))

    # -- kept changes
    kept = data["kept"]
    changes = [t for t in kept if t["kind"] != "baseline"]
    add(f"<h2>Kept changes <span class=\"count\">{len(changes)}</span></h2>")
    if not changes:
        where = f" (trial {head['baseline_trial']}, {_f(base, '.4f')})" if base is not None else ""
        add(f"<p class=\"muted\" id=\"kept-none\">No change was kept: the best is still the baseline{_e(where)}.</p>")
    else:
        add("<table id=\"kept\"><thead><tr><th>trial</th><th>change</th><th class=\"num\">val_bpb</th>"
            "<th class=\"num\">Δ vs incumbent</th><th class=\"num\">Δ vs baseline</th><th class=\"num\">held-out</th>"
            "<th>commit</th></tr></thead><tbody>")
        for t in kept[:MAX_TABLE_ROWS]:
            cls = " class=\"baseline\"" if t["kind"] == "baseline" else ""
            desc = t.get("description") or ""
            if t["kind"] == "baseline":
                desc = "baseline: " + desc if not desc.startswith("baseline") else desc
            elif t.get("tier") in ("adopted", "confirmed"):
                desc = f"[{t['tier']}] {desc}"
            metric = format_estimate(t["metric"], t.get("metric_sd"), t.get("n_runs")) if t["metric"] is not None else "–"
            add(f"<tr data-trial=\"{t['number']}\"{cls}><td class=\"num\">{t['number']}</td><td>{_e(desc)}</td>"
                f"<td class=\"num\">{_e(metric)}</td><td class=\"num {_sign(t.get('delta'))}\">{_f(t.get('delta'), '+.4f')}</td>"
                f"<td class=\"num {_sign(t.get('vs_baseline'))}\">{_f(t.get('vs_baseline'), '+.4f')}</td>"
                f"<td class=\"num\">{_f(t.get('heldout_metric'))}</td><td><code>{_e(_short(t.get('trial_commit')))}</code></td></tr>")
        add("</tbody></table>")
        if len(kept) > MAX_TABLE_ROWS:
            add(f"<p class=\"muted\">First {MAX_TABLE_ROWS} of {len(kept)}; `autoloop log --status keep` lists all.</p>")
        several = " val_bpb of several runs: mean ± standard error (runs)." if any(
            (t.get("n_runs") or 0) > 1 for t in kept) else ""
        add(f"<p class=\"muted\">Δ vs incumbent: the difference from the incumbent its decision gives (paired by "
            f"seed where it was measured at several). Δ vs baseline: its mean at the decision seeds minus the "
            f"baseline's (the headline's re-measured change is another measurement). Negative is lower: "
            f"better.{several}</p>")

    # -- discarded
    add(_discarded_section(data["discarded"], data["discarded_total"]))

    # -- ablation
    add(_ablation_section(data["ablations"]))

    # -- the scale ladder
    add(_ladder_section(data.get("ladder") or []))

    # -- noise
    add(_noise_section(data["noise"]))

    # -- failures
    add("<h2>Why trials failed</h2><div class=\"two\">")
    for table_id, title, reasons in (("crash-reasons", "Crashes and timeouts", data["crash_reasons"]),
                                     ("invalid-reasons", "Invalid", data["invalid_reasons"])):
        add(f"<div><h3>{_e(title)}</h3>")
        if not reasons:
            add("<p class=\"muted\">None.</p></div>")
            continue
        add(f"<table id=\"{table_id}\"><thead><tr><th class=\"num\">count</th><th>reason (latest example)</th>"
            "<th>trials</th></tr></thead><tbody>")
        for g in reasons:
            numbers = ", ".join(str(n) for n in g["trials"][:8]) + (" …" if len(g["trials"]) > 8 else "")
            add(f"<tr><td class=\"num\">{g['count']}</td><td>{_e(g['reason'])}</td><td>{_e(numbers)}</td></tr>")
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

    # -- lessons of the project's earlier runs
    if data.get("lessons"):
        add(f"<h2>Lessons from earlier runs <span class=\"count\">{len(data['lessons'])}</span></h2>"
            "<p class=\"muted\">What the project's earlier runs (earlier tags of this db, memory-db) tried, kept and discarded; "
            "effects are val_bpb against the incumbent of the time, negative helps.</p><ul id=\"lessons\">")
        for lesson in data["lessons"]:
            add(f"<li>{_e(lesson)}</li>")
        add("</ul>")

    # -- ideas
    ideas = data["ideas"]
    add(f"<h2>Ideas <span class=\"count\">{len(ideas)}</span></h2>")
    if not ideas:
        add("<p class=\"muted\">No ideas were seeded (autoloop seed).</p>")
    else:
        waiting = _text_waiting(run)
        add("<table id=\"ideas\"><thead><tr><th class=\"num\">id</th><th>idea</th><th>edit</th><th>status</th>"
            "<th>outcome</th></tr></thead><tbody>")
        for idea in ideas[:MAX_TABLE_ROWS]:
            edit = idea_edit(idea) or "text only"
            add(f"<tr data-idea=\"{idea['id']}\"><td class=\"num\">{idea['id']}</td><td>{_e(idea['text'])}</td>"
                f"<td><code>{_e(edit)}</code></td><td>{_e(idea['status'])}</td>"
                f"<td>{_idea_outcome(idea, run, waiting if edit == 'text only' else None)}</td></tr>")
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
    rows = [("host", run.get("host")), ("device", run.get("gpu") or "CPU"), ("torch", run.get("torch_version")),
            ("CUDA", run.get("cuda_version")), ("Python", run.get("python_version")),
            ("budget", f"{config['max_steps']} steps" if config.get("max_steps") else
             (f"{config['time_budget']:g} s" if config.get("time_budget") is not None else None)),
            ("proposers", ", ".join(config.get("proposers") or []) or None), ("keep margin", config.get("keep_margin")),
            ("noise", describe_noise(data["noise"].get("noise"))), ("decision rule", data["noise"].get("decision_rule")),
            ("sandbox", run.get("sandbox")),
            ("data", run.get("data_fingerprint")), ("harness", run.get("harness_fingerprint")),
            ("best commit", head.get("best_commit"))]
    for label, value in rows:
        if value not in (None, ""):
            add(f"<tr><th>{_e(label)}</th><td><code>{_e(value)}</code></td></tr>")
    add("</tbody></table>")
    add("<footer>Generated by autoloop. Metrics are val_bpb (bits per byte) on the fixed validation split; "
        "held-out values come from the verifier.</footer></main></body></html>\n")
    return "".join(parts)


_SET_LINE = re.compile(r"^([A-Z][A-Z0-9_]*)\s*=\s*(.*?)\s*(#.*)?$")


def tried(row: dict) -> str:
    """What a trial tried, in a few words: its constants with their old values
    ('MATRIX_LR 0.04 → 0.02'), else the size and first changed lines of its diff."""
    old, new = {}, {}
    changed = []
    for line in (row.get("diff") or "").splitlines():
        if line.startswith(("+++", "---")) or line[:1] not in "+-" or not line[1:].strip():
            continue
        changed.append(line)
        match = _SET_LINE.match(line[1:].strip())
        if match:
            (old if line[0] == "-" else new)[match.group(1)] = match.group(2)
    names = [n for n in new if n in old]
    if names and len(changed) == 2 * len(names):
        return ", ".join(f"{n} {old[n]} → {new[n]}" for n in names)
    if changed:
        plus = sum(1 for c in changed if c[0] == "+")
        first = "; ".join(c[:1] + " " + c[1:].strip()[:60] for c in changed[:2])
        return f"+{plus} −{len(changed) - plus} lines: {first}" + (" …" if len(changed) > 2 else "")
    edits = row.get("edits")
    sets = [f"{k}={v}" for e in (edits or {}).get("edits", []) for k, v in (e.get("sets") or {}).items()]
    return ", ".join(sets) or "–"


def _discarded_section(rows: list[dict], total: int) -> str:
    """Every discarded proposal: what it tried and why it was discarded (the morning's
    main question: what did the night rule out?)."""
    parts = [f"<h2>Discarded <span class=\"count\">{total}</span></h2>"]
    if not rows:
        parts.append("<p class=\"muted\" id=\"discarded-none\">No proposal was discarded.</p>")
        return "".join(parts)
    parts.append("<table id=\"discarded\"><thead><tr><th class=\"num\">trial</th><th>what was tried</th>"
                 "<th>change</th><th class=\"num\">Δ vs incumbent</th><th class=\"num\">runs</th>"
                 "<th>why it was discarded</th></tr></thead><tbody>")
    for t in rows:
        effect = t["effect"]
        delta = _f(t.get("delta"), "+.4f")
        if effect.diff_se is not None and t.get("delta") is not None:
            delta += f" ± {effect.diff_se:.4f}"
        parts.append(f"<tr data-trial=\"{t['number']}\"><td class=\"num\">{t['number']}</td>"
                     f"<td>{_e(t.get('description') or '')}</td><td><code>{_e(tried(t))}</code></td>"
                     f"<td class=\"num {_sign(t.get('delta')) if effect.distinguishable else ''}\">{_e(delta)}</td>"
                     f"<td class=\"num\">{effect.n}</td>"
                     f"<td>{_e(t.get('reason') or '')}</td></tr>")
    parts.append("</tbody></table>")
    if total > len(rows):
        parts.append(f"<p class=\"muted\">First {len(rows)} of {total}; `autoloop log --status discard` lists all.</p>")
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


def _ladder_section(rungs: list[dict]) -> str:
    """Each rung of the scale ladder: the best against the baseline there, and each kept
    change's effect at the night's scale and at the rung, with its tag (a table and a chart)."""
    if not rungs:
        return ""
    parts = ["<h2>Scale ladder</h2>",
             "<p class=\"muted\">Each kept change left out of the best commit at a larger scale and measured against "
             "it at the same fresh seeds. Effect = val_bpb with the change minus without it (negative: it helps). "
             "<b>holds</b>: it helps there at the decisions' confidence; <b>fades</b>: indistinguishable from zero "
             "there; <b>reverses</b>: it hurts there (<code>autoloop finalize --holds-at-scale</code> keeps only the "
             "changes that hold).</p>"]
    for rung in rungs:
        h = rung.get("headline")
        headline = (f"best {_f(h['best'], '.6f')} against the baseline {_f(h['baseline'], '.6f')}: "
                    f"{_f(h['delta'], '+.4f')} best minus baseline over {h['n']} paired runs" if h else
                    "no pair of the best and the baseline")
        parts.append(f"<h3>at <code>{_e(rung['spec'])}</code></h3><p>{_e(headline)}</p>")
        parts.append("<table class=\"ladder\" id=\"ladder\"><thead><tr><th>trial</th><th>change</th>"
                     "<th class=\"num\">effect at the night's scale</th><th class=\"num\">effect at scale</th>"
                     "<th class=\"num\">interval</th><th class=\"num\">runs</th><th>tag</th></tr></thead><tbody>")
        for t in rung["tags"][:MAX_TABLE_ROWS]:
            interval = (f"{t['low']:+.4f}..{t['high']:+.4f}" if t.get("low") is not None and t.get("high") is not None
                        else "unbounded")
            parts.append(f"<tr data-trial=\"{_e(t['trial'])}\" class=\"{_e(t['tag'])}\"><td class=\"num\">"
                         f"{_e(t['trial'])}</td><td>{_e(t.get('description'))}</td>"
                         f"<td class=\"num\">{_e(_f(t.get('small_effect'), '+.4f'))}</td>"
                         f"<td class=\"num\">{_e(_f(t['effect'], '+.4f'))}</td><td class=\"num\">{_e(interval)}</td>"
                         f"<td class=\"num\">{_e(t['n'])}</td><td>{_e(t['tag'])}</td></tr>")
        parts.append("</tbody></table>")
        chart = ladder_svg(rung)
        if chart:
            parts.append(f"<div class=\"ladder-chart\">{chart}</div>")
    return "".join(parts)


def _noise_section(noise: dict) -> str:
    """The run's measured noise, its drift checks (what each found, a failed one named as
    failed), and the pairs of runs left out for a different machine speed."""
    described = describe_noise(noise.get("noise"))
    drift, checks = noise.get("drift") or [], noise.get("checks") or []
    confounded, fresh = noise.get("confounded") or [], noise.get("fresh_checks") or 0
    if not described and not drift and not checks and not confounded and not fresh:
        return ""
    parts = ["<h2>Noise and drift</h2>"]
    if described:
        rule = f" Decision rule: {noise['decision_rule']}." if noise.get("decision_rule") else ""
        parts.append(f"<p id=\"noise\">Measured noise: {_e(described)}.{_e(rule)} A difference within about two "
                     "paired standard deviations of zero is not distinguishable from the incumbent.</p>")
    done = [c for c in checks if c["status"] in (Status.KEEP.value, Status.DISCARD.value)]
    failed = [c for c in checks if c["status"] in (Status.CRASH.value, Status.TIMEOUT.value, Status.INVALID.value,
                                                   Status.INTERRUPTED.value)]
    summary = []
    if checks or fresh:
        summary.append(f"{len(done) + fresh} drift check{'s' if len(done) + fresh != 1 else ''} measured the incumbent "
                       "again" + (f" ({fresh} of them next to a candidate, before the run's first keep)" if fresh else ""))
    for c in failed:
        verb = {"crash": "crashed", "timeout": "timed out", "invalid": "was invalid",
                "interrupted": "was interrupted"}[c["status"]]
        summary.append(f"the drift check of trial {c['number']} {verb} ({c.get('reason') or 'no reason recorded'}): "
                       "drift was not measured then")
    if summary:
        parts.append(f"<p id=\"drift-checks\">{_e('; '.join(summary))}.</p>")
    if drift:
        parts.append("<table id=\"drift\"><thead><tr><th class=\"num\">trial</th><th>drift</th><th>when (UTC)</th>"
                     "</tr></thead><tbody>")
        for e in drift[-MAX_TABLE_ROWS:]:
            parts.append(f"<tr><td class=\"num\">{_e(e.get('trial'))}</td><td>{_e(e['message'])}</td>"
                         f"<td>{_e((e.get('created_at') or '')[:16].replace('T', ' '))}</td></tr>")
        parts.append("</tbody></table>")
    elif done or fresh:
        parts.append("<p class=\"muted\" id=\"no-drift\">No drift detected by the drift checks that ran.</p>")
    else:
        parts.append("<p class=\"muted\" id=\"no-drift\">No drift check has measured the incumbent again yet: drift "
                     "is unknown.</p>")
    if confounded:
        parts.append(f"<h3>Pairs at different machine speeds <span class=\"count\">{len(confounded)}</span></h3>"
                     "<table id=\"confounded\"><thead><tr><th class=\"num\">trial</th><th>what happened</th>"
                     "</tr></thead><tbody>")
        for e in confounded[-MAX_TABLE_ROWS:]:
            parts.append(f"<tr><td class=\"num\">{_e(e.get('trial'))}</td><td>{_e(e['message'])}</td></tr>")
        parts.append("</tbody></table>")
    return "".join(parts)


def _sign(value) -> str:
    if value is None or value == 0:
        return ""
    return "better" if value < 0 else "worse"


def _text_waiting(run: dict) -> str | None:
    """Why a pending text-only idea waits under this run's settings (None: something reads text)."""
    import dataclasses

    from autoloop.config import Config
    from autoloop.proposers.seeding import waiting_reason

    known = {f.name for f in dataclasses.fields(Config)}
    try:
        config = dataclasses.replace(Config(), **{k: v for k, v in (run.get("config") or {}).items() if k in known})
    except (TypeError, ValueError):
        return None
    return waiting_reason(config, [])


def _idea_outcome(idea: dict, run: dict, waiting: str | None = None) -> str:
    if idea.get("trial") is None:
        if idea["status"] != "pending":
            return "<span class=\"muted\">–</span>"
        if waiting:
            return f"<span class=\"waiting\">waiting: {_e(waiting)}</span>"
        return "<span class=\"muted\">not tried yet</span>"
    where = f"trial {idea['trial']}" if idea.get("trial_run") == run["tag"] else f"run {idea['trial_run']} trial {idea['trial']}"
    status = idea.get("trial_status") or ""
    delta = f" ({idea['trial_delta']:+.4f})" if idea.get("trial_delta") is not None else ""
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
.stat[data-key="relative_gain"][data-state="confirmed"] .value { color:var(--good); }
.stat[data-key="baseline_to_best"] { grid-column:span 2; }
.stat .value { white-space:nowrap; }
div.chart { border:1px solid var(--line); border-radius:6px; padding:6px 4px 0; }
div.chart svg { display:block; width:100%; height:auto; }
.stat[data-state="not confirmed"] .value, .stat[data-state="partly"] .value { color:var(--bad); }
.stat[data-state="measured"] .value, .stat[data-state="stale"] .value, .stat[data-state="none"] .value { color:var(--fg); }
.waiting { color:#9a6700; }
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
    """Write report.html (its charts inline) into `out_dir`; return its path."""
    data = report_data(store, run)
    _label_kept(data)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise AutoloopError(f"{out_dir} is a file: give --out a folder for report.html")
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("progress.png", "loss_curves.png"):  # written by older versions; the page no longer uses them
        (out_dir / stale).unlink(missing_ok=True)
    page = render_html(data)
    target = out_dir / REPORT_HTML
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, target)
    return Report(html_path=target, data=data)


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
