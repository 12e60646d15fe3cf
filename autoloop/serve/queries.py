"""The live page's data: what each view shows, as plain JSON-ready dicts.

Built on `autoloop.review.queries` wherever it already answers the question (the headline and
the best as `autoloop best` reports them, the noise, a trial as `autoloop show` shows
it), so the page and the CLI never disagree. What is new here is bounded for 10,000
trials:

* the trial table is paginated (`MAX_PAGE` rows at most) on the `(run_id, number)` index;
* the progress chart is columnar (a few numbers per trial, no descriptions but the kept
  trials' labels) and holds at most `MAX_POINTS` trials (the latest);
* the tree is capped by `autoloop.review.tree`;
* diffs, logs, event messages and curves are cut (`MAX_DIFF_CHARS`, `LOG_LINES`,
  `MAX_MESSAGE`, `CURVE_POINTS`), each cut said in the payload.

What the page shows from a running trial comes from its progress file, read by
`autoloop.trust.untrusted` (no links, regular files only, capped) and only inside the
project's `.autoloop/` folder. The seed of the run in flight is not in the db until the
run ends; it follows from the controller's seed rule (a trial's k-th run uses the k-th
seed of the run, `Controller.seeds`), and for an incumbent re-measured for a comparison
it is the seed the candidate has and the incumbent lacks.

Nothing secret is served: of the run's stored config only `SHOWN_CONFIG` (budget,
rule, proposers, models; `llm_api_key_env` is the *name* of a variable, never its
value; no agent command, base URL or notify command, which may hold credentials), and
no environment.
"""

from __future__ import annotations

import math
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from autoloop.errors import AutoloopError
from autoloop.store import ideas_for_run
from autoloop.trust import untrusted as files


def thin(points: list, limit: int) -> list:
    """At most `limit` points, evenly spaced, the first and the last kept."""
    if limit < 2 or len(points) <= limit:
        return list(points)
    step = (len(points) - 1) / (limit - 1)
    return [points[round(i * step)] for i in range(limit)]


def stamp(path) -> tuple[int, int] | None:
    """(size, mtime in ns) of a file without following a link: what changed-detection
    compares; None when absent."""
    import os

    try:
        info = os.lstat(path)
    except (OSError, ValueError):
        return None
    return info.st_size, info.st_mtime_ns
from autoloop.review.tree import layout, tree_rows

MAX_PAGE = 200
DEFAULT_PAGE = 50
MAX_POINTS = 20_000
CURVE_POINTS = 400
MAX_DIFF_CHARS = 200_000
LOG_LINES = 60
MAX_MESSAGE = 400
EVENTS_SHOWN = 20
IDEAS_SHOWN = 50
MAX_DESCRIPTION = 300
SHOWN_CONFIG = ("time_budget", "max_steps", "seed", "proposers", "decision_rule", "keep_margin", "alpha", "max_runs",
                "baseline_seeds", "drift_every", "workers", "executor", "search_mode", "migrate_every", "dataset",
                "llm_model", "llm_api_key_env")
# Events that are not news for someone glancing at the page (an agent's transcript is
# long, and arrives with every proposal).
QUIET_EVENTS = ("transcript",)
LOG_COLUMNS = ("number", "kind", "status", "reason", "metric", "metric_source", "metric_sd", "n_runs", "delta",
               "best_before", "description", "proposer", "wall_seconds", "lineage", "worker", "parent_commit",
               "trial_commit", "heldout_metric", "decision", "flags", "started_at", "finished_at", "tier", "stopped_at")


def clean(value: Any) -> Any:
    """JSON-safe: NaN and infinities become None (JSON has neither), keys become text."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)


def _cut(text: str | None, limit: int) -> str | None:
    if text is None:
        return None
    text = str(text)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _select(store, sql: str, params=(), *, table: str | None = None) -> list[dict]:
    from autoloop.review.queries import select

    return select(store, sql, params, table=table)


# ---------------------------------------------------------------------------- runs


def runs_list(store) -> list[dict]:
    """Every run of the db, newest first, with its trial count."""
    rows = _select(store, "SELECT r.tag, r.status, r.pause_reason, r.created_at, r.updated_at, "
                          "(SELECT COUNT(*) FROM trials t WHERE t.run_id = r.id) AS trials FROM runs r ORDER BY r.id DESC")
    return rows


def pick_run(store, tag: str | None) -> dict:
    """The run `tag`, else the most recent one; one line naming the runs when it is unknown."""
    from autoloop.review.queries import pick_run as pick

    return pick(store, tag, fix="pick one of them")


# ---------------------------------------------------------------------------- the run page


def _hours_between(start: str | None, end: str | None) -> float | None:
    if not start or not end:
        return None
    try:
        return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds() / 3600
    except ValueError:
        return None


def trials_per_hour(store, run: dict) -> float | None:
    """Finished trials per hour of the run's wall time: from its first trial's start to
    its latest finish (to now while trials are running)."""
    row = _select(store, "SELECT MIN(created_at) AS first, MAX(finished_at) AS last, COUNT(finished_at) AS done, "
                         "SUM(status = 'running') AS running FROM trials WHERE run_id = ?", (run["id"],))[0]
    end = row["last"]
    if row["running"] and run.get("status") == "active":
        from autoloop.store import utcnow

        end = utcnow()
    hours = _hours_between(row["first"], end)
    if not hours or hours <= 0 or not row["done"]:
        return None
    return row["done"] / hours


def shown_config(run: dict) -> dict:
    config = run.get("config") or {}
    return {k: config.get(k) for k in SHOWN_CONFIG if config.get(k) is not None}


def summary(store, run: dict, controller: dict | None = None) -> dict:
    """The run page's headline: baseline -> best as `autoloop best` reports it (with the
    best's interval against the incumbent it replaced), the counts, trials per hour, the
    measured noise, the status and pause reason."""
    from autoloop.decide.effects import comparison_text, format_estimate, trial_effect
    from autoloop.decide.figures import change_text, percent_text
    from autoloop.review.queries import best_summary, best_trial, headline, noise_info, outage_info
    from autoloop.review.text import describe_noise, format_best

    run = store.get_run(run["tag"]) or run  # the status and pause reason as they are now
    head = headline(store, run)
    best = None
    if head["trials"]:
        try:
            best = best_summary(store, run)
        except AutoloopError:
            best = None  # no successful trial yet
    noise = noise_info(store, run)
    best_row = best_trial(store, run) if best else None
    out = {
        "run": run["tag"], "status": run["status"], "pause_reason": run.get("pause_reason"),
        "stop_requested": bool(run.get("stop_requested")), "branch": run.get("branch"),
        "created_at": run.get("created_at"), "updated_at": run.get("updated_at"),
        "headline": head, "trials_per_hour": trials_per_hour(store, run),
        "noise": describe_noise(noise.get("noise")), "decision_rule": noise.get("decision_rule"),
        "best": best, "best_text": format_best(best) if best else None,
        "best_estimate": format_estimate(best["metric"], best.get("metric_sd"), best.get("n_runs")) if best else None,
        "best_comparison": comparison_text(trial_effect(best_row)) if best_row and best_row["kind"] != "baseline" else None,
        "config": shown_config(run), "controller": controller,
        "host": run.get("host"), "gpu": run.get("gpu"), "sandbox": run.get("sandbox"),
        # The baseline -> best pair in the words every command uses (autoloop.decide.figures).
        "change_percent": percent_text(head["change"]["relative"]) if head.get("change") else None,
        "change_text": change_text(head["change"]["delta"]).split(" (")[0] if head.get("change") else None,
        "change_source": head["change"]["source"] if head.get("change") else None,
        # a model or agent away right now: the banner that says why the night looks as it does
        "outages": [o["line"] for o in outage_info(store, run) if o["until"] is None],
        # the scale ladder (--ladder): each rung's best minus baseline and its tags, one line each
        "ladder": ladder_lines(best.get("ladder") or []) if best else [],
    }
    if best:
        out["best"] = {k: v for k, v in best.items() if k != "checkpoint_path"}
    return clean(out)


def ladder_lines(rungs: list[dict]) -> list[dict]:
    """{spec, headline, tags}: one rung of the scale ladder as the page's card shows it."""
    out = []
    for rung in rungs:
        h = rung.get("headline")
        out.append({"spec": rung["spec"],
                    "headline": f"{h['delta']:+.4f} best minus baseline ({h['n']} paired runs)" if h else "no pair",
                    "tags": " · ".join(f"trial {t['trial']} {t['tag']}" for t in rung["tags"])})
    return out


def progress(store, run: dict) -> dict:
    """The progress chart's data, columnar: number, metric, status and kind codes, the
    standard error of kept means; labels for the kept trials."""
    from autoloop.review.queries import progress_points

    points = progress_points(store, run)
    cut = max(0, len(points) - MAX_POINTS)
    points = points[cut:]
    statuses = sorted({p["status"] for p in points})
    kinds = sorted({p["kind"] for p in points})
    labels = {r["number"]: "baseline" if r["kind"] == "baseline" else _cut((r["description"] or "").replace("\n", " "), 40)
              for r in _select(
        store, "SELECT number, kind, substr(description, 1, 80) AS description FROM trials WHERE run_id = ? "
               "AND status = 'keep' ORDER BY number", (run["id"],))}
    return {  # not clean()ed: 10,000 numbers; the server's JSON writer nulls a rare infinity
        "number": [p["number"] for p in points], "metric": [p["metric"] for p in points],
        "se": [p["metric_sd"] if (p.get("n_runs") or 0) > 1 else None for p in points],
        "status": [statuses.index(p["status"]) for p in points], "kind": [kinds.index(p["kind"]) for p in points],
        "statuses": statuses, "kinds": kinds, "labels": {str(k): v for k, v in labels.items()},
        "left_out": cut,
    }


def trials_page(store, run: dict, *, offset: int = 0, limit: int = DEFAULT_PAGE, status: str | None = None,
                kind: str | None = None, parent: str | None = None) -> dict:
    """One page of the trial table, newest first: `autoloop log`'s fields (delta, minutes,
    mean ± se of several runs, distinguishable, near miss). `status`/`kind` take a value
    or a comma-separated list (checked as `autoloop log` checks them); `parent` a commit
    (the trials proposed from it: the tree's "+N" markers)."""
    from autoloop.decide.effects import format_estimate, trial_effect
    from autoloop.decide.figures import trial_seconds
    from autoloop.review.queries import parse_choices, trial_delta, trial_minutes
    from autoloop.store import Kind, Status

    limit = max(1, min(int(limit), MAX_PAGE))
    offset = max(0, int(offset))
    where, params = ["run_id = ?"], [run["id"]]
    for column, values in (("status", parse_choices(status, Status, "status")),
                           ("kind", parse_choices(kind, Kind, "kind"))):
        if values:
            where.append(f"{column} IN ({', '.join('?' for _ in values)})")
            params.extend(values)
    if parent:
        where.append("parent_commit = ?")
        params.append(parent)
    clause = " AND ".join(where)
    total = _select(store, f"SELECT COUNT(*) AS n FROM trials WHERE {clause}", params)[0]["n"]
    columns = ", ".join(c if c != "description" else f"substr(description, 1, {MAX_DESCRIPTION}) AS description"
                        for c in LOG_COLUMNS)
    rows = _select(store, f"SELECT {columns}, substr(reason, 1, {MAX_DESCRIPTION}) AS reason FROM trials "
                          f"WHERE {clause} ORDER BY number DESC LIMIT ? OFFSET ?", [*params, limit, offset],
                   table="trials")
    seconds = trial_seconds(store, run)  # every run a trial cost, as `autoloop log` counts it
    out = []
    for t in rows:
        effect = trial_effect(t)
        out.append({
            "number": t["number"], "kind": t["kind"], "status": t["status"], "description": t["description"],
            "reason": t["reason"], "metric": t["metric"],
            "estimate": format_estimate(t["metric"], t.get("metric_sd"), t.get("n_runs")) if t["metric"] is not None else None,
            "metric_source": t["metric_source"], "delta": trial_delta(t), "minutes": trial_minutes(t, seconds),
            "distinguishable": effect.distinguishable, "near_miss": effect.near_miss if effect.noise_aware else None,
            "lineage": t["lineage"], "worker": t["worker"], "proposer": t["proposer"],
            "parent_commit": t["parent_commit"], "trial_commit": t["trial_commit"], "heldout_metric": t["heldout_metric"],
            "flagged": bool(t["flags"]),
            # A keep's tier (adopted on the paired mean, or confirmed) and an early stop's
            # progress, as `autoloop log` marks them (keep ✓, stop@N%).
            "tier": t["tier"], "stopped_at": t["stopped_at"],
        })
    return clean({"total": total, "offset": offset, "limit": limit, "rows": out})


def events(store, run: dict, limit: int = EVENTS_SHOWN) -> list[dict]:
    """The latest events (pauses, drift, overfitting, a lost worker, ...), newest first."""
    quiet = ", ".join("?" for _ in QUIET_EVENTS)
    rows = _select(store, f"SELECT e.id, e.kind, substr(e.message, 1, {MAX_MESSAGE + 1}) AS message, e.created_at, "
                          f"t.number AS trial FROM events e LEFT JOIN trials t ON t.id = e.trial_id "
                          f"WHERE e.run_id = ? AND e.kind NOT IN ({quiet}) ORDER BY e.id DESC LIMIT ?",
                   (run["id"], *QUIET_EVENTS, limit))
    for row in rows:
        row["message"] = _cut(row["message"], MAX_MESSAGE)
    return clean(rows)


def ideas(store, run: dict) -> dict:
    """The idea queue in the order the loop takes it (priority, then oldest), and the
    latest ideas taken with what became of them."""
    queue = _select(store, "SELECT id, substr(text, 1, 300) AS text, sets, patch IS NOT NULL AS has_patch, priority, "
                           "run_id IS NULL AS any_run, created_at FROM ideas WHERE status = 'pending' "
                           "AND " + ideas_for_run() + " ORDER BY priority DESC, id LIMIT ?", (run["id"], IDEAS_SHOWN),
                    table="ideas")
    pending = _select(store, "SELECT COUNT(*) AS n FROM ideas WHERE status = 'pending' AND " + ideas_for_run(),
                      (run["id"],))[0]["n"]
    recent = _select(store, "SELECT i.id, substr(i.text, 1, 300) AS text, i.status, t.number AS trial, "
                            "t.status AS trial_status, t.delta AS trial_delta FROM ideas i JOIN trials t ON t.id = i.trial_id "
                            "WHERE t.run_id = ? ORDER BY i.id DESC LIMIT 10", (run["id"],))
    return clean({"queue": queue, "pending": pending, "recent": recent})


# ---------------------------------------------------------------------------- running trials


def _inside(path: Path, folder: Path) -> bool:
    try:
        return path.parent.resolve().is_relative_to(folder.resolve())
    except (OSError, ValueError):
        return False


def progress_path(trial_or_measurement: dict, repo: Path) -> Path | None:
    """The progress file next to a row's log, if it lies inside the project's .autoloop/."""
    log = trial_or_measurement.get("log_path")
    if not log:
        return None
    path = Path(log).with_name("progress.jsonl")
    return path if _inside(path, Path(repo) / ".autoloop") else None


def _curve(records: list[dict]) -> list[list]:
    points = [[r["step"], r["loss"]] for r in records if "step" in r and "loss" in r]
    return thin(points, CURVE_POINTS)


def _run_seed(store, run: dict, trial: dict) -> tuple[int | None, dict | None]:
    """(seed, owner) of the run in flight for `trial` (module docstring): owner is the
    trial whose code trains (the trial itself, or the incumbent re-measured for it)."""
    log = trial.get("log_path")
    if not log:
        return None, None
    parts = Path(log).parts
    try:
        k = int(parts[-2])
        owner_number = int(parts[-4])
    except (IndexError, ValueError):
        return None, None
    base = (run.get("config") or {}).get("seed")
    if owner_number == trial["number"]:
        return (base + k - 1 if isinstance(base, int) else None), trial
    owner = store.get_trial(run["id"], owner_number)
    if owner is None:
        return None, None
    mine = {m["seed"] for m in _select(store, "SELECT seed FROM measurements WHERE trial_id = ?", (trial["id"],))}
    theirs = {m["seed"] for m in _select(store, "SELECT seed FROM measurements WHERE trial_id = ?", (owner["id"],))}
    missing = sorted(s for s in mine - theirs if s is not None)
    return (missing[0] if missing else None), owner


def _incumbent(store, run: dict, trial: dict) -> dict | None:
    """The incumbent a running trial is compared with: the kept trial of its parent commit."""
    row = store.kept_trial_of(run["id"], trial["parent_commit"]) if trial.get("parent_commit") else None
    return row if row is not None and row["id"] != trial["id"] else None


def _reference_curve(store, incumbent: dict, seed: int | None, repo: Path) -> dict | None:
    """The incumbent's loss curve at `seed`: its run at that seed's progress file, else the
    curve stored for its last run (the curves table)."""
    if seed is not None:
        rows = _select(store, "SELECT seed, log_path FROM measurements WHERE trial_id = ? AND seed = ? "
                              "AND status = 'ok' ORDER BY id DESC LIMIT 1", (incumbent["id"], seed))
        path = progress_path(rows[0], repo) if rows else None
        if path is not None:
            points = _curve(files.progress_records(path))
            if points:
                return {"trial": incumbent["number"], "seed": seed, "points": points, "source": "progress"}
    stored = _select(store, "SELECT step, loss FROM curves WHERE trial_id = ? AND loss IS NOT NULL ORDER BY step, id",
                     (incumbent["id"],))
    points = thin([[p["step"], p["loss"]] for p in stored], CURVE_POINTS)
    if points:
        return {"trial": incumbent["number"], "seed": None, "points": points, "source": "curves"}
    return None


def live(store, run: dict, repo: Path) -> dict:
    """Each running trial (one per worker): its step, loss, time left and live loss curve,
    beside the incumbent's curve at the same seed."""
    from autoloop.store import Status

    config = run.get("config") or {}
    budget, max_steps = config.get("time_budget"), config.get("max_steps")
    out = []
    for t in store.trials(run["id"], status=Status.RUNNING):
        path = progress_path(t, repo)
        records = files.progress_records(path) if path is not None else []
        last = records[-1] if records else {}
        seed, owner = _run_seed(store, run, t)
        left = last.get("seconds_left")
        if left is None and budget and not max_steps and last.get("training_seconds") is not None:
            left = max(0.0, budget - last["training_seconds"])
        started = t.get("started_at") or t.get("created_at")
        elapsed = None
        if started:
            try:
                elapsed = time.time() - datetime.fromisoformat(started).timestamp()
            except ValueError:
                elapsed = None
        incumbent = _incumbent(store, run, t)
        remeasuring = owner is not None and owner["id"] != t["id"]
        reference = None
        if incumbent is not None and not remeasuring:
            reference = _reference_curve(store, incumbent, seed, repo)
        out.append({
            "number": t["number"], "kind": t["kind"], "description": _cut(t.get("description"), MAX_DESCRIPTION),
            "worker": t.get("worker"), "lineage": t.get("lineage"), "elapsed_seconds": elapsed,
            "step": last.get("step"), "loss": last.get("loss"), "progress": last.get("progress"),
            "steps_left": (max_steps - last["step"]) if max_steps and last.get("step") is not None else None,
            "seconds_left": left, "seed": seed, "curve": _curve(records),
            "measuring": (f"the incumbent (trial {owner['number']}) again, for this comparison" if remeasuring else None),
            "incumbent": incumbent["number"] if incumbent else None, "reference": reference,
            "runs_done": _select(store, "SELECT COUNT(*) AS n FROM measurements WHERE trial_id = ?", (t["id"],))[0]["n"],
        })
    again = None
    if not out:  # the final re-measurement trains a kept trial: no trial is running, but training is
        from autoloop.loop.lock import holder
        from autoloop.review.queries import remeasuring

        again = remeasuring(store, run, store.best_trial(run["id"])) if holder(repo) else None
    return clean({"running": out, "budget": budget, "max_steps": max_steps, "remeasuring": again})


def running_progress_files(store, run: dict, repo: Path) -> list[Path]:
    """The progress files of the run's running trials (what the change stamp watches)."""
    from autoloop.store import Status

    paths = []
    for t in _select(store, "SELECT log_path FROM trials WHERE run_id = ? AND status = ?", (run["id"], Status.RUNNING.value)):
        path = progress_path(t, repo)
        if path is not None:
            paths.append(path)
    return paths


# ---------------------------------------------------------------------------- tree and trial


def tree(store, run: dict) -> dict:
    return layout(tree_rows(store, run))  # numbers and text only (cleaned, if ever needed, when sent)


def trial_page(store, run: dict, number: int, repo: Path) -> dict:
    """One trial as `autoloop show` shows it (its text, from `autoloop.review.queries`), with the
    diff and the log's tail apart (the page highlights them) and its loss curve beside
    the incumbent's."""
    from autoloop.review.queries import no_diff_reason, trial_detail
    from autoloop.review.text import format_trial

    detail = trial_detail(store, run, number, repo, log_lines=LOG_LINES)
    log_file = detail.get("log_file")
    log_tail = detail.get("log_tail")
    if log_file and not _inside(Path(log_file), Path(repo) / ".autoloop"):
        log_tail = None  # a path outside the project's run files is not served
    text = format_trial({**detail, "log_tail": None, "log_path": None, "error_tail": None}, with_diff=False)
    diff = detail.get("diff") or ""
    diff_cut = len(diff) > MAX_DIFF_CHARS
    trial = store.get_trial(run["id"], number)
    curve = thin([[p["step"], p["loss"]] for p in store.curve(trial["id"]) if p.get("loss") is not None],
                       CURVE_POINTS)
    incumbent = _incumbent(store, run, trial)
    # The stored curve is of the trial's last run: the incumbent's at that run's seed beside it.
    last_run = _select(store, "SELECT seed FROM measurements WHERE trial_id = ? ORDER BY id DESC LIMIT 1", (trial["id"],))
    seed = last_run[0]["seed"] if last_run else trial.get("seed")
    reference = _reference_curve(store, incumbent, seed, repo) if incumbent else None
    if trial["status"] == "running":
        path = progress_path(trial, repo)
        curve = _curve(files.progress_records(path)) if path is not None else curve
    return clean({
        "number": number, "run": run["tag"], "status": detail["status"], "kind": detail["kind"],
        "tier": detail.get("tier"), "stopped_at": detail.get("stopped_at"),
        "description": _cut(detail.get("description"), 2000), "text": text,
        "diff": diff[:MAX_DIFF_CHARS], "diff_cut": diff_cut, "no_diff": None if diff else no_diff_reason(detail),
        "log_file": log_file, "log_tail": [_cut(line, 2000) for line in (log_tail or [])],
        "error_tail": _cut(detail.get("error_tail"), 20_000) if not log_tail else None,
        "curve": curve, "reference": reference, "incumbent": incumbent["number"] if incumbent else None,
    })
