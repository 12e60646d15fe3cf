"""The morning review as text: the tables and blocks `log`, `show`, `best`, `status` and
`ideas` print. Every function takes rows from autoloop.review.queries (or the db through it)
and returns a string or a list of lines; nothing here writes.

Marks in the log: `~` a near miss (discarded, within the noise of the incumbent), `≈` not
distinguishable from the incumbent, `*` an unverified (printed-only) metric, `?` a keep
without verification, `✓` a confirmed keep (an adopted one has none), `stop@40%` a clear
loser stopped early at that share of its budget; each table prints the legend of the
marks it uses.
"""

from __future__ import annotations

import json

from autoloop.decide.effects import (
    ablation_effect, ablation_verdict, decision_figures, decision_of, flags_of, format_estimate, format_interval,
    trial_effect,
)
from autoloop.review.queries import no_diff_reason, select
from autoloop.store import Kind


def format_metric(value) -> str:
    return "-" if value is None else f"{value:.6f}"


def _cut(text: str | None, width: int) -> str:
    text = (text or "").replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


def format_log(run: dict, rows: list[dict], *, total: int | None = None) -> str:
    """The log as a table; `total` (the run's trial count) adds a 'showing N of M' line."""
    if not rows:
        if total == 0:
            return f"run '{run['tag']}' has no trials yet"
        return f"run '{run['tag']}' has no trials matching that"
    cells = []
    for r in rows:
        delta = f"{r['delta']:+.4f}" if r.get("delta") is not None else "-"
        if r.get("near_miss"):
            delta += "~"
        elif r.get("distinguishable") is False:
            delta += "≈"
        # A mean of several runs reads `2.5431 ± 0.0040 (3)`; a single run as before.
        metric = format_estimate(r.get("metric"), r.get("metric_sd"), r.get("n_runs"))
        if r.get("stopped_at") is not None and r.get("metric") is None:
            metric = f"stop@{r['stopped_at']:.0%}"
        if r.get("metric") is not None and r.get("metric_source") == "reported":
            metric += "*"
        elif r.get("status") == "keep" and r.get("metric_source") == "harness":
            metric += "?"
        cells.append((metric, delta))
    # The val_bpb column widens only when a row needs it, so a log of single runs reads as before.
    width = max([9] + [len(m) for m, _ in cells])
    lines = [f"{'#':>4} {'kind':<9} {'status':<11} {'val_bpb':>{width}} {'delta':>9} {'min':>6}  description / reason"]
    for r, (metric, delta) in zip(rows, cells):
        minutes = f"{r['minutes']:.1f}" if r.get("minutes") is not None else "-"
        status = r["status"] + (" ✓" if r.get("status") == "keep" and r.get("tier") == "confirmed" else "")
        lines.append(
            f"{r['number']:>4} {r['kind']:<9} {status:<11} {metric:>{width}} {delta:>9} {minutes:>6}  "
            f"{_cut(r.get('description'), 60)}"
        )
        if r.get("reason"):
            lines.append(f"{'':>{41 + width}}  ↳ {_cut(r['reason'], 100)}")
        for x in r.get("scale") or []:
            lines.append(f"{'':>{41 + width}}  ⤒ {scale_words(x)}")
        if r.get("flags"):
            from autoloop.decide.diagnosis import names

            lines.append(f"{'':>{41 + width}}  ⚑ {names(r['flags'])}")
    if any((r.get("n_runs") or 0) > 1 for r in rows):
        lines.append("val_bpb of several runs: mean ± standard error (runs)")
    if any(r.get("tier") in ("adopted", "confirmed") for r in rows):
        lines.append("keep ✓ confirmed: the sequential test against the run's noise says so; a keep without ✓ is "
                     "adopted: the branch moved on the paired mean, not confirmed")
    if any(r.get("stopped_at") is not None for r in rows):
        lines.append("stop@N%: a clear loser, stopped early at N% of its budget (discarded, no val_bpb)")
    if any(r.get("near_miss") for r in rows):
        lines.append("~ near miss: discarded, but within the noise of the incumbent")
    if any(r.get("distinguishable") is False and not r.get("near_miss") for r in rows):
        lines.append("≈ not distinguishable from the incumbent: the difference is within the measured noise")
    if any(r.get("metric_source") == "reported" for r in rows):
        lines.append("* unverified: only printed by the script, not measured by the harness")
    if any(r.get("status") == "keep" and r.get("metric_source") == "harness" for r in rows):
        lines.append("? kept without verification (--no-verify): the script's own figure, no held-out check")
    if any(r.get("scale") for r in rows):
        lines.append("⤒ the scale ladder: the kept change's effect at a larger scale (with minus without it, paired "
                     "by seed; negative helps): holds, fades (indistinguishable from zero) or reverses")
    if total is not None and total > len(rows):
        lines.append(f"showing {len(rows)} of {total} trials of run '{run['tag']}' (--last N or --status to choose)")
    return "\n".join(lines)


MAX_SHOWN_MEASUREMENTS = 200


def _num(value, spec: str = ".6f", unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:{spec}}{unit}"
    return f"{value}{unit}"


def format_trial(d: dict, *, with_diff: bool = True) -> str:
    lines = [f"trial {d['number']} of run '{d['run']}' [{d['kind']}]: {d['status']}"]

    def field(label: str, value) -> None:
        if value not in (None, ""):
            lines.append(f"  {label:<14} {value}")

    field("description", d.get("description"))
    proposer = d.get("proposer") or ""
    if d.get("model"):
        proposer += f" (model {d['model']})"
    field("proposer", proposer)
    if d.get("idea"):
        idea = d["idea"]
        sets = ", ".join(f"{k}={v}" for k, v in (idea.get("sets") or {}).items())
        field("idea", f"{idea['id']}: {idea['text']}" + (f" [{sets}]" if sets else ""))
    field("reason", d.get("reason"))
    if d.get("flags"):
        from autoloop.decide.diagnosis import messages

        for message in messages(d["flags"]):
            field("flag", message)

    lines.append("evidence")
    source = f" ({d['metric_source']})" if d.get("metric_source") else ""
    effect = trial_effect(d)
    if effect.n > 1:
        field("val_bpb", f"{format_estimate(effect.metric, effect.se, effect.n)}{source}: mean ± standard error "
                         f"of {effect.n} runs")
    else:
        field("val_bpb", _num(d.get("metric")) + source)
    field("best before", _num(d.get("best_before")))
    field("delta", _num(d.get("delta"), "+.6f"))
    field("tier", TIER_TEXT.get(d.get("tier"), d.get("tier")) if d.get("status") == "keep" else None)
    if d.get("stopped_at") is not None:
        field("stopped early", f"at {d['stopped_at']:.0%} of the budget: a clear loser against the incumbent's "
                               "curve at the same seed (no val_bpb: a stopped run never counts)")
    field("keep margin", d.get("keep_margin"))
    field("held-out bpb", _num(d.get("heldout_metric")) if d.get("heldout_metric") is not None else None)
    if d.get("verify_seconds") is not None:
        field("verified in", _num(d["verify_seconds"], ".1f", " s"))
    measurements = d.get("measurements") or []
    if not _noise_aware(d):
        # A trial from before noise-aware decisions: its re-run values, as they were shown.
        for m in measurements:
            field("measurement", f"val_bpb {_num(m.get('metric'))} (seed {m.get('seed')})")
    for e in d.get("events") or []:
        field("event", f"{e['kind']}: {e['message']}")
    if d.get("progress"):
        p = d["progress"]
        field("progress", ", ".join(f"{k} {v}" for k, v in p.items()))

    if _noise_aware(d):
        lines.extend(_measurement_lines(measurements, d["number"]))
    lines.extend(_decision_lines(d))
    lines.extend(_ablation_lines(d))
    lines.extend(_scale_lines(d))
    lines.extend(_flag_lines(d))

    lines.append("commits")
    field("parent", d.get("parent_commit"))
    field("trial", d.get("trial_commit"))
    field("archived as", d.get("archive_ref"))

    lines.append("run")
    if d.get("row_run"):  # the figures below are one run's: its seed, not the trial's first
        field("seed", f"{d['row_run']['seed']} (the last of {d['row_run']['of']} runs: the steps and times below are "
                      "its own; `measurements` lists every run)")
    else:
        field("seed", d.get("seed"))
    field("lineage", d.get("lineage"))
    field("derived from", d.get("derived_from"))
    field("steps", d.get("num_steps"))
    field("tokens", d.get("total_tokens"))
    field("parameters", d.get("num_params"))
    field("MFU", _num(d.get("mfu_percent"), ".1f", " %") if d.get("mfu_percent") is not None else None)
    field("peak memory", _num(d.get("peak_memory_mb"), ".0f", " MB") if d.get("peak_memory_mb") is not None else None)
    # compile_seconds is the harness clock's untimed warm-up (compilation when torch.compile
    # is on, the first steps either way): named for what it is, beside the compile flag.
    timings = [f"{name} {d[key]:.1f} s" for name, key in (
        ("training", "training_seconds"), ("untimed warm-up", "compile_seconds"), ("eval", "eval_seconds"),
        ("total", "total_seconds"), ("wall", "wall_seconds")) if d.get(key) is not None]
    field("time", ", ".join(timings))
    field("started", d.get("started_at"))
    field("finished", d.get("finished_at"))
    field("program.md", d.get("program_hash"))
    field("checkpoint", d.get("checkpoint_path"))
    field("curve", f"{d['curve_points']} points" if d.get("curve_points") else None)
    field("telemetry", d.get("telemetry"))  # what the proposers' brief says of this run
    result = d.get("result") or {}
    shown = {"val_bpb", "training_seconds", "total_seconds", "compile_seconds", "eval_seconds", "num_steps",
             "total_tokens", "num_params", "mfu_percent", "peak_memory_mb", "seed"}
    for key, value in result.items():
        if key == "compiled" and isinstance(value, bool):
            field("torch.compile", "on" if value else "off")
        elif key not in shown and value is not None:
            field(key, value)

    if with_diff:
        lines.append("diff")
        if d.get("diff"):
            lines.extend("  " + line for line in d["diff"].rstrip("\n").splitlines())
        else:
            lines.append("  (none: " + no_diff_reason(d) + ")")
    if d.get("error_tail") and not d.get("log_tail"):
        lines.append("error tail")
        lines.extend("  " + line for line in d["error_tail"].splitlines())
    if d.get("log_tail") is not None:
        lines.append(f"log: last {len(d['log_tail'])} lines of {d['log_file']}")
        lines.extend("  " + line for line in d["log_tail"])
    elif d.get("log_path"):
        lines.append(f"log: {d['log_path']} is gone")
    return "\n".join(lines)


def _noise_aware(d: dict) -> bool:
    """A trial recorded by the noise-aware controller (measurement roles, a decision)."""
    return bool(decision_of(d)) or any(m.get("role") for m in d.get("measurements") or [])


def _measurement_lines(measurements: list[dict], number: int) -> list[str]:
    if not measurements:
        return ["measurements", "  (none recorded)"]
    lines = [f"measurements ({len(measurements)})",
             f"  {'seed':>6} {'role':<10} {'trial':>5} {'val_bpb':>9} {'held-out':>9} {'steps':>6} "
             f"{'train s':>8} {'wall s':>7} {'speed':>6}  status"]
    for m in measurements[:MAX_SHOWN_MEASUREMENTS]:
        owner = m.get("owner")
        status = m.get("status") or "-"
        if m.get("verified"):
            status += ", verified"
        if m.get("for_trial") not in (None, number):
            status += f", for trial {m['for_trial']}"
        if m.get("reason"):
            status += f": {_cut(m['reason'], 80)}"
        lines.append(
            f"  {_num(m.get('seed')):>6} {m.get('role') or '-':<10} {owner if owner != number else '':>5} "
            f"{_num(m.get('metric')):>9} {_num(m.get('heldout_metric')):>9} {_num(m.get('num_steps')):>6} "
            f"{_num(m.get('training_seconds'), '.1f'):>8} {_num(m.get('wall_seconds'), '.1f'):>7} "
            f"{_num(m.get('machine_speed'), '.2f'):>6}  {status}")
    if len(measurements) > MAX_SHOWN_MEASUREMENTS:
        lines.append(f"  ... {len(measurements) - MAX_SHOWN_MEASUREMENTS} more (`autoloop show N --json` has all)")
    if any(m.get("owner") not in (None, number) for m in measurements):
        lines.append("  (trial: another trial's code, e.g. the incumbent re-measured for this comparison)")
    if any(m.get("machine_speed") is not None for m in measurements):
        lines.append("  (speed: the machine's speed probe around the run; runs at different speeds are not paired)")
    return lines


# The decision's figures, in the order they are read; anything else it holds follows.
_DECISION_FIELDS = (("action", "action"), ("rule", "rule"), ("n", "pairs (n)"), ("mean_diff", "mean difference"),
                    ("se", "standard error"), ("statistic", "statistic"), ("bound", "bound"),
                    ("stopped_because", "stopped because"), ("near_miss", "near miss"),
                    ("distinguishable", "distinguishable"))


def _decision_lines(d: dict) -> list[str]:
    decision = decision_figures(d)
    if not decision or (d.get("kind") == Kind.ABLATION.value and "effect" in decision):
        return []
    lines = ["decision"]

    def add(label: str, value) -> None:
        if isinstance(value, float):
            value = f"{value:+.6f}" if label in ("mean difference",) else f"{value:.6g}"
        elif isinstance(value, bool):
            value = "yes" if value else "no"
        elif isinstance(value, (dict, list)):
            value = json.dumps(value)
        if value not in (None, ""):
            lines.append(f"  {label:<16} {value}")

    interval = format_interval(_float(decision.get("low")), _float(decision.get("high")))
    if "mean_diff" in decision:
        decision["distinguishable"] = trial_effect(d).distinguishable  # as log and the proposers read it
    for key, label in _DECISION_FIELDS:
        add(label, decision.get(key))
        if key == "se" and interval:
            add("interval", interval)
    if decision.get("reason"):
        add("reason", decision["reason"])
    skip = {k for k, _ in _DECISION_FIELDS} | {"low", "high", "reason"}
    for key, value in decision.items():
        if key not in skip:
            add(key.replace("_", " "), value)
    return lines


def _float(value):
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _ablation_line(a) -> str:
    interval = format_interval(a.low, a.high, a.level)
    return (f"effect {_num(a.effect, '+.4f')} ({interval}, {a.n} paired runs): {ablation_verdict(a)}")


def _ablation_lines(d: dict) -> list[str]:
    """For an ablation trial: the effect of the change it reverted. For a kept trial:
    what its ablations found."""
    lines = []
    if d.get("kind") == Kind.ABLATION.value:
        a = ablation_effect(d)
        lines.append("ablation")
        if d.get("ablated_trial") is not None:
            lines.append(f"  reverts the change of trial {d['ablated_trial']} in the best commit")
        lines.append("  " + (_ablation_line(a) if a else "no effect measured"))
        lines.append("  effect = val_bpb with the change minus without it, paired by seed; negative: the change helps")
        return lines
    for row in d.get("ablations") or []:
        a = ablation_effect(row)
        if not lines:
            lines.append("ablations")
        lines.append(f"  trial {row['number']}: " + (_ablation_line(a) if a else f"{row['status']}: {row.get('reason') or ''}"))
    return lines


def scale_words(x: dict) -> str:
    """'at WIDTH=4: holds, effect -0.0500 (-0.0550..-0.0450)': one kept change at one rung."""
    interval = f" ({x['low']:+.4f}..{x['high']:+.4f})" if x.get("low") is not None and x.get("high") is not None else ""
    return f"at {x['spec']}: {x['tag']}, effect {x['effect']:+.4f}{interval}"


def _scale_lines(d: dict) -> list[str]:
    """A kept trial's tags on the scale ladder."""
    rows = d.get("scale") or []
    if not rows:
        return []
    lines = ["scale ladder"]
    for x in rows:
        small = f"; {x['small_effect']:+.4f} at the night's scale" if x.get("small_effect") is not None else ""
        lines.append(f"  {scale_words(x)}{small} ({x['n']} paired runs, ladder trial {x['ladder_trial']})")
    lines.append("  effect = val_bpb with the change minus without it at the larger scale; negative: it helps there")
    return lines


def _ladder_best_lines(rungs: list[dict]) -> list[str]:
    lines = []
    for rung in rungs:
        h = rung.get("headline")
        if h:
            interval = (f", {h['level']:.0%} interval {h['low']:+.4f}..{h['high']:+.4f}"
                        if h.get("low") is not None and h.get("high") is not None else "")
            lines.append(f"  at {rung['spec']}: {h['best']:.6f} vs baseline {h['baseline']:.6f}: "
                         f"{h['delta']:+.4f} best minus baseline ({h['n']} paired runs{interval})")
        else:
            lines.append(f"  at {rung['spec']}: no pair of the best and the baseline")
        for tag in ("holds", "fades", "reverses"):
            trials = [str(t["trial"]) for t in rung["tags"] if t["tag"] == tag]
            if trials:
                lines.append(f"    {tag:<9} trial {', '.join(trials)}")
    return lines


def _flag_lines(d: dict) -> list[str]:
    flags = flags_of(d)
    if not flags:
        return []
    return ["flags"] + [f"  {f.get('flag')}" + (f": {f['message']}" if f.get("message") else "") for f in flags]


TIER_TEXT = {
    "adopted": "adopted (the branch moved on the paired mean; not confirmed by the sequential test)",
    "confirmed": "confirmed (the sequential test against the run's measured noise says so)",
    "baseline": "baseline (the reference every gain is measured against)",
}


def format_headline(h: dict, change: dict | None = None) -> list[str]:
    """The re-measured figures (autoloop.loop.reserve.headline_of) as `best` prints them;
    the difference from the baseline as every command writes it (autoloop.decide.figures)."""
    from autoloop.decide.figures import baseline_to_best, change_text

    se = f" ± {h['value_se']:.6f}" if h.get("value_se") is not None else ""
    if h.get("source") == "baseline":
        return [f"  val_bpb   {h['value']:.6f}{se}: the baseline's own {h['n']} runs (nothing was kept; never selected)"]
    change = change or baseline_to_best(h.get("baseline_metric"), h.get("selection_metric"), h)
    interval = (f"; 95% interval {change['low']:+.4f} to {change['high']:+.4f}"
                if change.get("low") is not None and change.get("high") is not None else "")
    return [f"  val_bpb   {h['value']:.6f}{se}: re-measured at {h['n']} fresh seed{'s' if h['n'] != 1 else ''} "
            "no decision used",
            f"  baseline  {format_metric(h.get('baseline_metric'))} (trial {h.get('baseline_trial')}): "
            f"{change_text(change['delta'], change['baseline'])[:-1]}{interval})"]


def format_best(b: dict) -> str:
    lines = [f"best of run '{b['run']}': trial {b['best_trial']} at {b['best_commit']}"]
    if b.get("description"):
        lines.append(f"  {b['description']}")
    source = f" ({b['metric_source']})" if b.get("metric_source") else ""
    selection = f"{format_estimate(b['metric'], b.get('metric_sd'), b.get('n_runs'))}{source}"
    if b.get("tier") in TIER_TEXT:
        lines.append(f"  tier      {TIER_TEXT[b['tier']]}")
    if b.get("reserve"):
        lines.extend(format_headline(b["reserve"], b.get("change")))
        if b["reserve"].get("source") != "baseline":
            lines.append(f"  selected  at {selection}: the mean the decisions saw (a lucky draw: not the figure to report)")
        if b["reserve"].get("heldout") is not None:
            lines.append(f"  held-out  {format_metric(b['reserve']['heldout'])} at the fresh seeds")
    else:
        lines.append(f"  val_bpb   {selection}: the selection mean, not re-measured at fresh seeds "
                     "(it looks better than it is)")
    if b.get("baseline_metric") is not None and not b.get("reserve") and b.get("delta") is not None:
        from autoloop.decide.figures import change_text

        lines.append(f"  baseline  {format_metric(b['baseline_metric'])} (trial {b['baseline_trial']}): "
                     f"{change_text(b['delta'], b['baseline_metric'])}")
    if b.get("heldout_metric") is not None or b.get("baseline_heldout_metric") is not None:
        lines.append(f"  held-out  {format_metric(b.get('heldout_metric'))} "
                     f"(baseline {format_metric(b.get('baseline_heldout_metric'))})")
    else:
        lines.append("  held-out  - (not verified)")
    lines.extend(_ladder_best_lines(b.get("ladder") or []))
    confirmed = f" ({b['confirmed']} confirmed)" if b.get("confirmed") is not None else ""
    lines.append(f"  {b['kept']} kept change(s){confirmed} in {b['trials']} trials on {b['branch']}; "
                 "`autoloop finalize` makes a clean branch of them")
    return "\n".join(lines)


def format_status(info: dict) -> str:
    from autoloop.decide.figures import counts_text, pair_text

    lines = [f"run '{info['tag']}' ({info['status']}) on {info['branch']}: {info['trials']} trials "
             + counts_text(info["counts"])]
    if info.get("pause_reason"):
        lines.append(f"paused: {info['pause_reason']}")
    if info["best_metric"] is not None:
        metric = format_estimate(info["best_metric"], info.get("best_metric_sd"), info.get("best_n_runs"))
        tier = f", {info['best_tier']}" if info.get("best_tier") in ("adopted", "confirmed") else ""
        lines.append(f"best: val_bpb {metric} (trial {info['best_trial']}{tier}, {str(info['best_commit'])[:12]})")
        if info.get("best_metric_source") not in (None, "verified"):
            lines[-1] += f" - unverified ({info['best_metric_source']})"
        if info.get("change") and info["change"]["source"] == "reserve":
            lines.append(pair_text(info["change"]))
    if info.get("overfitting"):
        lines.append(info["overfitting"])
    lines.extend(f"proposer: {o['line']}" for o in info.get("outages") or ())
    lines.extend(format_noise(info))
    held = info.get("controller")
    if held:
        folder = f" (project {held['folder']})" if held.get("folder") else ""
        lines.append(f"controller: pid {held['pid']} runs '{held.get('tag')}' in this working tree since "
                     f"{held.get('since', '?')}{folder}")
    running = info.get("running_all") or ([info["running"]] if info.get("running") else [])
    for r in running:
        worker = f"[{r['worker']}] " if r.get("worker") else ""
        parts = [f"running: {worker}trial {r['number']} [{r['kind']}] {r.get('description') or ''}"]
        if r.get("step") is not None:
            parts.append(f"step {r['step']}" + (f"/{r['max_steps']}" if r.get("max_steps") else ""))
        if r.get("loss") is not None:
            parts.append(f"loss {r['loss']:.4f}")
        if r.get("steps_left") is not None:  # step mode: the budget is steps, its seconds only reported
            parts.append(f"{r['steps_left']} steps left")
        elif r.get("seconds_left") is not None:
            parts.append(f"{max(r['seconds_left'], 0):.0f}s of training left")
        elif r.get("elapsed_seconds") is not None:
            parts.append(f"{r['elapsed_seconds']:.0f}s elapsed")
        lines.append(" | ".join(parts))
    again = info.get("remeasuring")
    if again and not running:
        lines.append(f"running: re-measuring the best (trial {again['trial']}) at fresh seeds for the reported "
                     f"figures: {again['done']} of {again['of']} runs done")
    elif not running:
        lines.append("nothing running")
    if len(info.get("workers") or {}) > 1:
        lines.append("workers: " + "; ".join(
            f"{name} {sum(c.values())} trials ({', '.join(f'{n} {s}' for s, n in sorted(c.items()))})"
            for name, c in sorted(info["workers"].items())))
    return "\n".join(lines)


def describe_noise(noise: dict | None) -> str | None:
    """'one run sd 0.0050, paired difference sd 0.0030 (12 df)', or None when unmeasured."""
    if not noise:
        return None
    parts = []
    if noise.get("run_sd") is not None:
        parts.append(f"one run sd {noise['run_sd']:.4f}")
    if noise.get("pair_sd") is not None:
        parts.append(f"paired difference sd {noise['pair_sd']:.4f}")
    text = ", ".join(parts)
    if noise.get("df") is not None:
        text += f" ({noise['df']} df)"
    return text


def format_noise(info: dict) -> list[str]:
    """The status lines about noise: the estimate, the rule, drift and noise events.
    Nothing for a run from before noise-aware decisions."""
    lines = []
    described = describe_noise(info.get("noise"))
    if described:
        rule = f"; decision rule {info['decision_rule']}" if info.get("decision_rule") else ""
        lines.append(f"noise: {described}{rule}")
    for e in info.get("noise_events") or []:
        lines.append(f"noise event: {e['message']}")
    for e in info.get("drift") or []:
        where = f" (trial {e['trial']})" if e.get("trial") is not None else ""
        lines.append(f"drift{where}: {e['message']}")
    return lines


def idea_edit(idea: dict) -> str:
    """What an idea edits, in a few words: "patch, LR=0.01" for both (the patch is applied
    first, then the constants are set), "" for a text-only idea. Rows have `patch` or
    `has_patch`."""
    parts = ["patch"] if idea.get("patch") or idea.get("has_patch") else []
    return ", ".join(parts + [f"{k}={v}" for k, v in (idea.get("sets") or {}).items()])


def format_ideas(store, rows: list[dict]) -> str:
    if not rows:
        return "no ideas yet: seed one with `autoloop seed \"what to try\" --set NAME=VALUE`"
    trial_ids = [idea["trial_id"] for idea in rows if idea.get("trial_id")]
    trials: dict[int, dict] = {}
    for start in range(0, len(trial_ids), 500):  # one query per 500 ideas, not one per idea
        chunk = trial_ids[start:start + 500]
        for t in select(store, f"SELECT id, number, status FROM trials WHERE id IN ({', '.join('?' for _ in chunk)})", chunk):
            trials[t["id"]] = t
    lines = [f"{'id':>4} {'prio':>4} {'status':<9} {'trial':>5}  idea"]
    for idea in rows:
        trial = ""
        t = trials.get(idea.get("trial_id"))
        if t:
            trial = f"{t['number']}"
            if t.get("status") != "running":
                trial += f" ({t['status']})"
        edit = f" [{idea_edit(idea)}]" if idea_edit(idea) else ""
        lines.append(f"{idea['id']:>4} {idea['priority']:>4} {idea['status']:<9} {trial:>5}  {_cut(idea['text'], 70)}{edit}")
        if idea.get("run_tag") and not idea.get("run_id") and idea.get("status") == "pending":
            lines.append(f"{'':>26}↳ waits for run '{idea['run_tag']}': `autoloop run --tag {idea['run_tag']}` starts it")
        if idea.get("waiting"):
            lines.append(f"{'':>26}↳ waiting: {idea['waiting']}")
        if idea.get("tried_before"):  # autoloop.proposers.memory: the project's earlier runs
            lines.append(f"{'':>26}↳ {idea['tried_before']}")
    return "\n".join(lines)
