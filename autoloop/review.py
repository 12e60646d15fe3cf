"""Reading a run back: the log, the status of a running loop, the ideas.

Everything here only reads experiments.db (and a running trial's progress file), so it
is safe to use from another terminal while the controller writes.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

from autoloop.display import format_metric, last_progress

LOG_FIELDS = ("number", "kind", "status", "reason", "metric", "metric_source", "delta", "best_before",
              "description", "proposer", "minutes", "trial_commit", "heldout_metric")


def _minutes(trial: dict) -> float | None:
    if trial.get("wall_seconds"):
        return round(trial["wall_seconds"] / 60, 2)
    return None


def log_rows(store, run: dict, *, last: int | None = None, status: str | None = None, kind: str | None = None) -> list[dict]:
    trials = store.trials(run["id"], status=status, kind=kind, last=last)
    return [{**{k: t.get(k) for k in LOG_FIELDS if k != "minutes"}, "minutes": _minutes(t)} for t in trials]


def _cut(text: str | None, width: int) -> str:
    text = (text or "").replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


def format_log(run: dict, rows: list[dict]) -> str:
    if not rows:
        return f"run '{run['tag']}' has no trials matching that"
    lines = [f"{'#':>4} {'kind':<9} {'status':<11} {'val_bpb':>9} {'delta':>9} {'min':>6}  description / reason"]
    for r in rows:
        delta = f"{r['delta']:+.4f}" if r.get("delta") is not None else "-"
        metric = format_metric(r.get("metric"))
        if r.get("metric") is not None and r.get("metric_source") == "reported":
            metric += "*"
        minutes = f"{r['minutes']:.1f}" if r.get("minutes") is not None else "-"
        lines.append(
            f"{r['number']:>4} {r['kind']:<9} {r['status']:<11} {metric:>9} {delta:>9} {minutes:>6}  "
            f"{_cut(r.get('description'), 60)}"
        )
        if r.get("reason"):
            lines.append(f"{'':>50}  ↳ {_cut(r['reason'], 100)}")
    if any(r.get("metric_source") == "reported" for r in rows):
        lines.append("* unverified: only printed by the script, not measured by the harness")
    return "\n".join(lines)


def run_status(store, run: dict, repo: Path) -> dict:
    trials = store.trials(run["id"])
    best = store.best_trial(run["id"])
    counts: dict[str, int] = {}
    for t in trials:
        counts[t["status"]] = counts.get(t["status"], 0) + 1
    info = {
        "tag": run["tag"], "status": run["status"], "pause_reason": run.get("pause_reason"),
        "branch": run["branch"], "best_commit": run.get("best_commit"),
        "best_metric": best["metric"] if best else None, "best_trial": best["number"] if best else None,
        "trials": len(trials), "counts": counts, "running": None,
    }
    running = [t for t in trials if t["status"] == "running"]
    if running:
        t = running[-1]
        progress = None
        if t.get("log_path"):
            progress = last_progress(Path(t["log_path"]).with_name("progress.jsonl"))
        started = t.get("started_at") or t.get("created_at")
        elapsed = None
        if started:
            elapsed = time.time() - datetime.fromisoformat(started).timestamp()
        budget = (run.get("config") or {}).get("time_budget")
        info["running"] = {
            "number": t["number"], "kind": t["kind"], "description": t.get("description"),
            "elapsed_seconds": elapsed, "step": (progress or {}).get("step"), "loss": (progress or {}).get("loss"),
            "training_seconds": (progress or {}).get("training_seconds"),
            "seconds_left": (progress or {}).get("seconds_left",
                                                 (budget - progress["training_seconds"]) if progress and budget and progress.get("training_seconds") is not None else None),
        }
    return info


def format_status(info: dict) -> str:
    lines = [f"run '{info['tag']}' ({info['status']}) on {info['branch']}: {info['trials']} trials "
             + ", ".join(f"{n} {s}" for s, n in sorted(info["counts"].items()))]
    if info.get("pause_reason"):
        lines.append(f"paused: {info['pause_reason']}")
    if info["best_metric"] is not None:
        lines.append(f"best: val_bpb {format_metric(info['best_metric'])} (trial {info['best_trial']}, {str(info['best_commit'])[:12]})")
    r = info.get("running")
    if r:
        parts = [f"running: trial {r['number']} [{r['kind']}] {r.get('description') or ''}"]
        if r.get("step") is not None:
            parts.append(f"step {r['step']}")
        if r.get("loss") is not None:
            parts.append(f"loss {r['loss']:.4f}")
        if r.get("seconds_left") is not None:
            parts.append(f"{max(r['seconds_left'], 0):.0f}s of training left")
        elif r.get("elapsed_seconds") is not None:
            parts.append(f"{r['elapsed_seconds']:.0f}s elapsed")
        lines.append(" | ".join(parts))
    else:
        lines.append("nothing running")
    return "\n".join(lines)


def format_ideas(store, rows: list[dict]) -> str:
    if not rows:
        return "no ideas yet: seed one with `autoloop seed \"what to try\" --set NAME=VALUE`"
    lines = [f"{'id':>4} {'prio':>4} {'status':<8} {'trial':>5}  idea"]
    for idea in rows:
        trial = ""
        if idea.get("trial_id"):
            t = store.trial_by_id(idea["trial_id"])
            trial = f"{t['number']}" if t else ""
            if t and t.get("status") != "running":
                trial += f" ({t['status']})"
        edit = ""
        if idea.get("sets"):
            edit = " [" + ", ".join(f"{k}={v}" for k, v in idea["sets"].items()) + "]"
        elif idea.get("patch"):
            edit = " [patch]"
        lines.append(f"{idea['id']:>4} {idea['priority']:>4} {idea['status']:<8} {trial:>5}  {_cut(idea['text'], 70)}{edit}")
    return "\n".join(lines)
