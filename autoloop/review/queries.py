"""Reading a run back: the log, one trial in full, the best result, the run's headline
numbers, the status of a running loop, the ideas. The rows only: autoloop.review.text
formats them for the terminal.

Everything here only reads experiments.db (and the files a trial left under
`.autoloop/`), so it is safe to use from another terminal while the controller writes:
each query fetches all its rows at once (no read transaction outlives a call), and a
trial still `running` is shown as such rather than skipped.

Definitions shared by `autoloop log`, `best`, `report` and `export`:

* **delta**: the candidate minus the incumbent, paired by seed: the decision's mean
  difference (`decision.mean_diff`), the number its reason gives, as the controller
  stored it; negative is better. A trial without a paired decision (the strict rule's
  one run, a database from before noise-aware decisions, a crash): its metric minus the
  best metric before it (`best_before`). A kept trial's mean minus the baseline's is
  shown as "vs baseline" where it is shown at all.
* **kept changes**: trials with status `keep` whose kind changes the code (proposal,
  repair, ablation). The baseline is stored as `keep` (it is the first best) but is not
  a change; re-runs and drift checks never change the code.
* **keep rate**: kept changes / decided proposals, where decided = a proposal or repair
  whose status is final and not `interrupted` (keep, discard, crash, timeout, invalid).
  Ablation trials (`autoloop ablate`) measure kept changes; they are never proposals.
* **val_bpb of several runs**: a trial measured at several seeds shows the mean of its
  runs ± its standard error and the number of runs (`autoloop.decide.effects`).
* **discarded**: discarded proposals and repairs, the grey points of the report's chart;
  re-measurements of the incumbent (drift checks, re-runs), ablations and the scale
  ladder's commits are counted apart (`remeasured`, `ablations`, `ladder`), never as
  discarded ideas.
* **crashed**: `crash` + `timeout`. **GPU hours** (**CPU hours** on a run that trained on
  the CPU): the summed wall time of every training process (crashed ones included: they
  used the machine too), each run once (autoloop.decide.figures); a trial's **minutes** in
  the log are the runs it cost, so they add up to the hours.
* **the best trial**: the kept trial whose commit is the run's best commit (the commit
  the branch stands on), else the kept trial with the lowest metric.
* **tier** of a kept trial: `adopted` (the branch moved on the paired mean) or
  `confirmed` (the sequential test against the run's noise said so too); the baseline's
  is `baseline`. **stopped_at**: the progress at which a clear loser was stopped early.
* **the headline** (`best`, `report`, `status`): the best's val_bpb and gain re-measured at
  fresh seeds no decision used (autoloop.loop.reserve.headline_of), when it has been;
  otherwise the selection mean, marked as such (`"reserve": None`). **change**: the one
  baseline -> best pair every command shows (autoloop.decide.figures.baseline_to_best):
  best minus baseline, negative is lower (better), as every delta here.
"""

from __future__ import annotations

import os
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

from autoloop.measure.run_folder import RunFolder
from autoloop.decide.effects import ablation_effect, decision_of, trial_effect
from autoloop.errors import AutoloopError, NotFound
from autoloop.decide.figures import baseline_to_best, compute_kind, run_seconds, status_counts, trial_seconds
from autoloop.store import Kind, Status, ideas_for_run


def pick_run(store, tag: str | None, *, fix: str = "check --tag") -> dict:
    """The run named `tag` (else $AUTOLOOP_TAG), else the most recent one: the one way every
    command and the page name a run. An unknown tag is one line naming the runs there are."""
    runs = store.runs()
    tag = tag or os.environ.get("AUTOLOOP_TAG") or None
    if tag is not None:
        run = store.get_run(tag)
        if run is None:
            known = ", ".join(r["tag"] for r in runs) or "none"
            raise NotFound(f"no run tagged '{tag}' in {store.path} (runs: {known}): {fix}")
        return run
    if not runs:
        raise AutoloopError(f"{store.path} has no runs yet: start one with `autoloop run`")
    return runs[-1]


LOG_FIELDS = ("number", "kind", "status", "reason", "metric", "metric_source", "delta", "best_before",
              "description", "proposer", "minutes", "trial_commit", "heldout_metric", "flags", "tier", "stopped_at")
# Also in `log --json`, for scripts and agents.
LOG_JSON_EXTRA = ("lineage", "worker", "idea_id", "parent_commit", "started_at", "finished_at")
# The uncertainty of a trial's metric (autoloop.decide.effects); None for trials of one run
# without a noise-aware decision (older databases).
LOG_UNCERTAINTY = ("metric_sd", "n_runs", "distinguishable", "near_miss")
DEFAULT_LOG_LAST = 50
LOG_TAIL_LINES = 40

CHANGE_KINDS = (Kind.PROPOSAL.value, Kind.REPAIR.value, Kind.ABLATION.value)
PROPOSAL_KINDS = (Kind.PROPOSAL.value, Kind.REPAIR.value)
CRASHED = (Status.CRASH.value, Status.TIMEOUT.value)
DECIDED = (Status.KEEP.value, Status.DISCARD.value, Status.CRASH.value, Status.TIMEOUT.value, Status.INVALID.value)

# Columns never shown by `show` (process bookkeeping of a finished trial).
_PROCESS_FIELDS = ("pgid", "pid", "pid_start_time", "heartbeat_at")


# ---------------------------------------------------------------------------- queries


def select(store, sql: str, params: Iterable[Any] = (), *, table: str | None = None) -> list[dict[str, Any]]:
    """Run a read-only query on the store and fetch every row now (see the Store's
    concurrency rules: no read transaction may outlive the call). With `table`, that
    table's JSON columns come back decoded (`Store.rows`), as every write stored them."""
    return store.rows(table, sql, params) if table else store.query(sql, params)


def parse_choices(value: str | Iterable[str] | None, vocabulary, what: str) -> list[str] | None:
    """'crash,timeout' or ['crash', 'timeout'] -> checked values; None passes through."""
    if value is None:
        return None
    parts = value.split(",") if isinstance(value, str) else list(value)
    values = [str(getattr(p, "value", p)).strip().lower() for p in parts if str(getattr(p, "value", p)).strip()]
    allowed = [member.value for member in vocabulary]
    for v in values:
        if v not in allowed:
            raise AutoloopError(f"unknown {what} '{v}': use one of {', '.join(allowed)} (comma-separated for several)")
    return values or None


def trial_minutes(trial: dict, seconds: dict[int, float] | None = None) -> float | None:
    """The wall minutes of every training run the trial cost (`figures.trial_seconds`,
    passed as `seconds`), else its own last run's."""
    if seconds is not None and trial.get("number") in seconds:
        return round(seconds[trial["number"]] / 60, 2)
    if trial.get("wall_seconds") is not None:
        return round(trial["wall_seconds"] / 60, 2)
    return None


def trial_delta(trial: dict) -> float | None:
    """The delta `log`, `show` and the report give a trial (module docstring): the
    paired difference of its decision, else as stored."""
    paired = decision_of(trial).get("mean_diff")
    if isinstance(paired, (int, float)) and not isinstance(paired, bool) and trial.get("kind") != Kind.ABLATION.value:
        return float(paired)
    if trial.get("delta") is not None:
        return trial["delta"]
    if trial.get("metric") is not None and trial.get("best_before") is not None:
        return trial["metric"] - trial["best_before"]
    return None


def count_trials(store, run: dict) -> int:
    return select(store, "SELECT COUNT(*) AS n FROM trials WHERE run_id = ?", (run["id"],))[0]["n"]


def log_rows(store, run: dict, *, last: int | None = None, status=None, kind=None, extra: bool = False) -> list[dict]:
    """The rows of `autoloop log`, oldest first: LOG_FIELDS (plus LOG_JSON_EXTRA with
    `extra`). `status`/`kind` take one value, a comma-separated string or a list;
    `last=N` keeps the N highest-numbered matches. Only the needed columns are read, so
    a 10,000-trial log with full diffs stays fast."""
    if last is not None and last < 1:
        raise AutoloopError(f"--last {last} shows nothing: give a positive number of trials")
    statuses = parse_choices(status, Status, "status")
    kinds = parse_choices(kind, Kind, "kind")
    columns = [c for c in LOG_FIELDS if c != "minutes"] + ["wall_seconds", "metric_sd", "n_runs", "decision"] \
        + list(LOG_JSON_EXTRA)
    where, params = ["run_id = ?"], [run["id"]]
    for column, values in (("status", statuses), ("kind", kinds)):
        if values:
            where.append(f"{column} IN ({', '.join('?' for _ in values)})")
            params.extend(values)
    sql = f"SELECT {', '.join(columns)} FROM trials WHERE {' AND '.join(where)}"
    if last is not None:
        sql = f"SELECT * FROM ({sql} ORDER BY number DESC LIMIT ?)"
        params.append(last)
    rows = select(store, sql + " ORDER BY number", params, table="trials")
    fields = LOG_FIELDS + LOG_UNCERTAINTY + (LOG_JSON_EXTRA if extra else ())
    seconds = trial_seconds(store, run)
    scale = scale_tags(store, run)
    out = []
    for t in rows:
        row = {k: t.get(k) for k in fields if k in t}
        row["delta"] = trial_delta(t)
        row["minutes"] = trial_minutes(t, seconds)
        effect = trial_effect(t)
        row["distinguishable"] = effect.distinguishable
        row["near_miss"] = effect.near_miss if effect.noise_aware else None
        out.append({k: row[k] for k in fields})
        if t.get("number") in scale and t.get("status") == Status.KEEP.value:  # the ladder's tags (--ladder)
            out[-1]["scale"] = [{k: x[k] for k in ("spec", "tag", "effect", "low", "high")} for x in scale[t["number"]]]
    return out


# ---------------------------------------------------------------------------- one trial


def get_trial(store, run: dict, number: int) -> dict:
    """The trial `number` of `run`, or one line naming the trials that do exist."""
    trial = store.get_trial(run["id"], number)
    if trial is None:
        span = select(store, "SELECT MIN(number) AS lo, MAX(number) AS hi FROM trials WHERE run_id = ?", (run["id"],))[0]
        known = f"trials {span['lo']}-{span['hi']}" if span["lo"] is not None else "no trials yet"
        raise NotFound(f"run '{run['tag']}' has no trial {number} ({known}): check the number, or --tag for another run")
    return trial


def trial_file(trial: dict, run: dict, repo: Path | None, column: str, name: str) -> Path | None:
    """A file a trial left behind: the path in its row, else the same file under
    `<repo>/.autoloop/<tag>/trials/<n>/` (the repository may have moved since)."""
    recorded = trial.get(column)
    if recorded and Path(recorded).exists():
        return Path(recorded)
    if repo is not None:
        candidate = Path(repo) / ".autoloop" / run["tag"] / "trials" / str(trial["number"]) / name
        if candidate.exists():
            return candidate
    return None


def tail_lines(path: Path, count: int = LOG_TAIL_LINES, max_bytes: int = 65536) -> list[str]:
    """The last `count` lines of a text file, reading at most `max_bytes` from its end. A
    run folder is a place a trial could write: a link or a FIFO there reads as nothing
    (autoloop.trust.untrusted.tail_text)."""
    from autoloop.trust.untrusted import tail_text

    text = tail_text(path, max_bytes)
    return text.splitlines()[-count:] if text and count > 0 else []


def last_progress(path: Path | None) -> dict | None:
    """The last complete progress record of a progress file (cheap: reads only the tail),
    its known numeric fields only (autoloop.trust.untrusted)."""
    from autoloop.trust.untrusted import last_progress as read_last

    return read_last(path)


def archive_ref(run: dict, trial: dict) -> str | None:
    """Where the controller keeps a non-kept trial's commit reachable (an ablation's
    reverted commit: under ablations/, see autoloop.review.ablate)."""
    if trial.get("trial_commit") and trial["kind"] == Kind.ABLATION.value:
        return f"refs/autoloop/{run['tag']}/ablations/{trial['number']}"
    if trial.get("trial_commit") and trial["status"] not in (Status.KEEP.value, Status.RUNNING.value) \
            and trial["kind"] not in (Kind.BASELINE.value, Kind.RERUN.value):
        return f"refs/autoloop/{run['tag']}/trials/{trial['number']}"
    return None


def trial_detail(store, run: dict, number: int, repo: Path | None = None, *, log_lines: int = LOG_TAIL_LINES) -> dict:
    """Every field of a trial plus the evidence behind its decision: its measurements,
    events, idea, the keep margin in force, where its commit lives, and its log's tail."""
    trial = get_trial(store, run, number)
    detail = {k: v for k, v in trial.items() if k not in _PROCESS_FIELDS}
    detail["run"] = run["tag"]
    detail["delta"] = trial_delta(trial)
    detail["minutes"] = trial_minutes(trial, trial_seconds(store, run))
    detail["keep_margin"] = (run.get("config") or {}).get("keep_margin")
    detail["measurements"] = trial_measurements(store, trial)
    detail["ablations"] = ablations_of(store, run, trial)
    detail["scale"] = scale_tags(store, run).get(trial["number"]) if trial["status"] == Status.KEEP.value else None
    detail["events"] = select(store, "SELECT kind, message, created_at FROM events WHERE trial_id = ? ORDER BY id",
                              (trial["id"],))
    detail["curve_points"] = select(store, "SELECT COUNT(*) AS n FROM curves WHERE trial_id = ?", (trial["id"],))[0]["n"]
    detail["idea"] = None
    if trial.get("idea_id"):
        ideas = select(store, "SELECT id, text, sets, patch, status FROM ideas WHERE id = ?", (trial["idea_id"],),
                       table="ideas")
        if ideas:
            detail["idea"] = ideas[0]
    if trial["kind"] == Kind.ABLATION.value and trial.get("derived_from"):
        rows = select(store, "SELECT number FROM trials WHERE id = ?", (trial["derived_from"],))
        detail["ablated_trial"] = rows[0]["number"] if rows else None
    detail["archive_ref"] = archive_ref(run, trial)
    detail["row_run"] = row_run(trial, detail["measurements"])
    # The log of the trial's own last run: trials.log_path names the last run it waited on,
    # which may be the incumbent's re-measurement for it (another trial's code and log).
    own = [m for m in detail["measurements"] if m.get("trial_id") == trial["id"] and m.get("log_path")]
    log = Path(own[-1]["log_path"]) if own and Path(own[-1]["log_path"]).exists() else \
        trial_file(trial, run, repo, "log_path", "train.log")
    detail["log_file"] = str(log) if log else None
    detail["log_tail"] = tail_lines(log, log_lines) if log else None
    if trial["status"] == Status.RUNNING.value and log is not None:
        detail["progress"] = last_progress(RunFolder(log.parent).progress)
    from autoloop.proposers.telemetry import budget_of, telemetry_line, trial_telemetry

    # The line the proposers' brief shows for this trial: its run beside the incumbent's.
    telemetry = trial_telemetry(store, trial, budget_of(run.get("config") or {}))
    detail["telemetry"] = None if telemetry.empty else telemetry_line(telemetry)
    return detail


def row_run(trial: dict, measurements: list[dict]) -> dict | None:
    """The run whose steps and times the trial row holds (its last one, `trial_fields`):
    {seed, of} for a trial of several runs, so `show` labels those figures with their own
    seed, not the trial's first; None for a trial of one run (or none)."""
    # Its own runs: not the reserve's, nor its code's runs made for another trial's comparison.
    own = [m for m in measurements if m.get("trial_id") == trial["id"] and m.get("role") != "reserve"
           and m.get("for_trial_id") in (None, trial["id"])]
    if len(own) < 2:
        return None
    same = [m for m in own if m.get("wall_seconds") is not None and m.get("wall_seconds") == trial.get("wall_seconds")
            and m.get("training_seconds") == trial.get("training_seconds")]
    m = (same or own)[-1]
    return {"seed": m.get("seed"), "of": len(own)}


def trial_measurements(store, trial: dict) -> list[dict]:
    """Every training run behind the trial's decision: its own measurements (as a
    candidate, ablation, drift check, ...) and the incumbent's runs made for its
    comparison (rows of another trial with for_trial_id = this trial), oldest first.
    `owner` is the number of the trial whose code was trained."""
    rows = select(store, "SELECT m.*, t.number AS owner, f.number AS for_trial FROM measurements m "
                         "JOIN trials t ON t.id = m.trial_id LEFT JOIN trials f ON f.id = m.for_trial_id "
                         "WHERE m.trial_id = ? OR m.for_trial_id = ? ORDER BY m.id", (trial["id"], trial["id"]),
                  table="measurements")
    return rows


def ablations_of(store, run: dict, trial: dict) -> list[dict]:
    """The ablation trials that reverted this trial's change, oldest first, with their
    figures (autoloop.decide.effects.ablation_effect)."""
    if trial["kind"] == Kind.ABLATION.value:
        return []
    rows = select(store, "SELECT number, status, reason, parent_commit, decision FROM trials WHERE run_id = ? "
                         "AND kind = ? AND derived_from = ? ORDER BY number",
                  (run["id"], Kind.ABLATION.value, trial["id"]))
    for row in rows:
        row["decision"] = decision_of(row) or None
    return rows


def no_diff_reason(trial: dict) -> str:
    if trial["kind"] == Kind.BASELINE.value:
        return "the baseline trains the base commit unchanged"
    if trial["kind"] in (Kind.RERUN.value, Kind.DRIFT.value):
        return f"a {trial['kind']} trains the incumbent commit unchanged"
    if trial["status"] == Status.INVALID.value and not trial.get("trial_commit"):
        return "the proposal was rejected before it was committed; its edits are in `autoloop show --json`"
    return "no diff was recorded for this trial"


def trial_diff(store, run: dict, number: int, repo: Path | None = None) -> tuple[str, str | None]:
    """(diff, note): the trial's diff from its row, else recomputed from git; when there
    is none, an empty diff and a one-line note saying why."""
    trial = get_trial(store, run, number)
    if trial.get("diff"):
        return trial["diff"], None
    if repo is not None and trial.get("trial_commit") and trial.get("parent_commit") \
            and trial["trial_commit"] != trial["parent_commit"]:
        from autoloop.gitops import GitRepo

        git = GitRepo.open(repo)
        if git.commit_exists(trial["trial_commit"]) and git.commit_exists(trial["parent_commit"]):
            return git.diff(trial["parent_commit"], trial["trial_commit"]), None
    return "", f"trial {number} has no diff: {no_diff_reason(trial)}"


# ---------------------------------------------------------------------------- run summary


def require_trials(store, run: dict) -> int:
    total = count_trials(store, run)
    if total == 0 and run.get("status") in (None, "active"):
        raise AutoloopError(f"run '{run['tag']}' has no trials yet: wait for its baseline, or pick another run with --tag")
    if total == 0:  # it stopped before its baseline: nothing to wait for
        raise AutoloopError(f"run '{run['tag']}' has no trials: it stopped before its baseline; resume it with "
                            f"`autoloop run --tag {run['tag']}`, or pick another run with --tag")
    return total


def baseline_trial(store, run: dict) -> dict | None:
    """The first baseline that produced a metric."""
    rows = select(store, "SELECT * FROM trials WHERE run_id = ? AND kind = ? AND metric IS NOT NULL "
                         "ORDER BY number LIMIT 1", (run["id"], Kind.BASELINE.value))
    return rows[0] if rows else None


def best_trial(store, run: dict) -> dict | None:
    """The run's incumbent (`Store.best_trial`, the one definition)."""
    return store.best_trial(run["id"])


def headline(store, run: dict) -> dict:
    """The run's numbers (see the module docstring for the definitions)."""
    counts = {s.value: 0 for s in Status}
    kept = decided = discarded = remeasured = ablations = ladder = 0
    total = 0
    for row in select(store, "SELECT status, kind, COUNT(*) AS n FROM trials WHERE run_id = ? GROUP BY status, kind",
                      (run["id"],)):
        counts[row["status"]] += row["n"]
        total += row["n"]
        if row["kind"] in CHANGE_KINDS and row["status"] == Status.KEEP.value and row["kind"] != Kind.ABLATION.value:
            kept += row["n"]
        if row["kind"] in PROPOSAL_KINDS and row["status"] in DECIDED:
            decided += row["n"]
        if row["kind"] == Kind.ABLATION.value:
            ablations += row["n"]
        elif row["kind"] == Kind.LADDER.value:  # a commit measured at a larger scale: no idea was discarded
            ladder += row["n"]
        elif row["kind"] in (Kind.DRIFT.value, Kind.RERUN.value) and row["status"] in (Status.KEEP.value, Status.DISCARD.value):
            remeasured += row["n"]
        elif row["status"] == Status.DISCARD.value:
            discarded += row["n"]
    seconds = run_seconds(store, run)
    base, best = baseline_trial(store, run), best_trial(store, run)
    base_metric = base["metric"] if base else None
    best_metric = best["metric"] if best else None
    from autoloop.loop.cost import cost_summary
    from autoloop.loop.reserve import headline_of

    confirmed = select(store, "SELECT COUNT(*) AS n FROM trials WHERE run_id = ? AND status = ? AND tier = ?",
                       (run["id"], Status.KEEP.value, "confirmed"))[0]["n"]
    stopped = select(store, "SELECT COUNT(*) AS n FROM trials WHERE run_id = ? AND stopped_at IS NOT NULL",
                     (run["id"],))[0]["n"]
    reserve = headline_of(store, run)
    change = baseline_to_best(base_metric, best_metric, reserve)
    return {
        "run": run["tag"], "run_status": run["status"], "trials": total, "kept": kept, "confirmed": confirmed,
        "stopped_early": stopped, "reserve": reserve, "change": change,
        "discarded": discarded, "remeasured": remeasured, "ablations": ablations, "ladder": ladder,
        "crashed": counts[Status.CRASH.value] + counts[Status.TIMEOUT.value],
        "timeouts": counts[Status.TIMEOUT.value], "invalid": counts[Status.INVALID.value],
        "interrupted": counts[Status.INTERRUPTED.value], "running": counts[Status.RUNNING.value],
        "decided": decided, "keep_rate": kept / decided if decided else None, "compute_hours": seconds / 3600,
        "gpu_hours": seconds / 3600,  # the name before CPU runs were told apart: compute_hours
        "compute": (compute := compute_kind(store, run)),
        "baseline_metric": base_metric, "baseline_trial": base["number"] if base else None,
        "best_metric": best_metric, "best_trial": best["number"] if best else None,
        "best_commit": best["trial_commit"] if best else run.get("best_commit"),
        # relative_gain: lower is a positive gain (the name older readers know); `change` is the convention.
        "relative_gain": -change["relative"] if change and change["relative"] is not None else None,
        "statuses": counts,
        # dollars spent (model tokens, GPU time at the run's gpu-hour-price) and per bpb gained
        "cost": {**cost_summary(store, run, change), "compute": compute},
    }


def best_summary(store, run: dict) -> dict:
    """`autoloop best`: the best commit, its metric against the baseline, held-out metrics
    where the verifier measured them."""
    require_trials(store, run)
    best = best_trial(store, run)
    if best is None:
        raise AutoloopError(f"run '{run['tag']}' has no successful trial yet (its baseline has not finished): "
                            "check `autoloop log`")
    base = baseline_trial(store, run)
    info = headline(store, run)
    return {
        "run": run["tag"], "branch": run.get("branch"), "best_trial": best["number"], "best_commit": best["trial_commit"],
        "description": best.get("description"), "metric": best["metric"], "metric_source": best.get("metric_source"),
        "tier": best.get("tier"), "reserve": info["reserve"], "confirmed": info["confirmed"],
        "metric_sd": best.get("metric_sd"), "n_runs": best.get("n_runs"),
        "heldout_metric": best.get("heldout_metric"),
        "baseline_trial": base["number"] if base else None, "baseline_metric": base["metric"] if base else None,
        "baseline_heldout_metric": base.get("heldout_metric") if base else None,
        # The reported pair (figures.baseline_to_best): the re-measured best where there is one.
        "change": info["change"], "delta": info["change"]["delta"] if info["change"] else None,
        "relative": info["change"]["relative"] if info["change"] else None, "relative_gain": info["relative_gain"],
        "kept": info["kept"], "trials": info["trials"], "checkpoint_path": best.get("checkpoint_path"),
        "ladder": ladder_summary(store, run),
    }


def kept_trials(store, run: dict) -> list[dict]:
    """Every trial with status keep (the baseline first), in trial order."""
    return select(store, "SELECT id, number, kind, description, proposer, metric, metric_sd, n_runs, metric_source, "
                         "heldout_metric, best_before, delta, trial_commit, parent_commit, diff, checkpoint_path, "
                         "finished_at, tier, decision FROM trials WHERE run_id = ? AND status = ? ORDER BY number",
                  (run["id"], Status.KEEP.value))


def progress_points(store, run: dict) -> list[dict]:
    """(number, kind, status, metric, metric_sd, n_runs, description, reason) of every
    trial, for the progress chart (texts cut to 200 characters: they are its tooltips)."""
    return select(store, "SELECT number, kind, status, metric, metric_sd, n_runs, substr(description, 1, 200) AS "
                         "description, substr(reason, 1, 200) AS reason FROM trials WHERE run_id = ? AND kind != ? "
                         "ORDER BY number", (run["id"], Kind.LADDER.value))  # a ladder's bpb is of another scale


def discarded_trials(store, run: dict, limit: int) -> tuple[list[dict], int]:
    """The discarded proposals and repairs (the chart's grey points), in trial order, with
    what each tried (description, edits, diff) and why it was discarded (reason, the
    decision's figures): (the first `limit`, how many there are)."""
    where = ("run_id = ? AND status = ? AND kind NOT IN (?, ?, ?, ?)",
             (run["id"], Status.DISCARD.value, Kind.DRIFT.value, Kind.RERUN.value, Kind.ABLATION.value,
              Kind.LADDER.value))
    total = select(store, f"SELECT COUNT(*) AS n FROM trials WHERE {where[0]}", where[1])[0]["n"]
    rows = select(store, f"SELECT number, kind, description, proposer, reason, metric, metric_sd, n_runs, delta, "
                         f"best_before, decision, edits, diff FROM trials WHERE {where[0]} ORDER BY number LIMIT ?",
                  (*where[1], limit), table="trials")
    for row in rows:
        row["delta"] = trial_delta(row)
        row["effect"] = trial_effect(row)
    return rows, total


def latest_ablations(store, run: dict) -> list[dict]:
    """For each kept change that was ablated, its latest ablation trial: {trial (the kept
    trial's number), description, ablation (the ablation trial's number), status,
    reason, parent_commit (the best commit it was measured against), figures
    (autoloop.decide.effects.AblationEffect or None)}, in the kept trials' order."""
    rows = select(store, "SELECT a.number AS ablation, a.status, a.reason, a.parent_commit, a.trial_commit, a.decision, "
                         "k.number AS trial, k.description, k.id AS kept_id FROM trials a JOIN trials k "
                         "ON k.id = a.derived_from WHERE a.run_id = ? AND a.kind = ? ORDER BY a.number",
                  (run["id"], Kind.ABLATION.value))
    latest: dict[int, dict] = {}
    for row in rows:
        if row["status"] == Status.RUNNING.value:
            continue
        row["figures"] = ablation_effect(row)
        latest[row["trial"]] = row
    return [latest[k] for k in sorted(latest)]


_NUMBERS = re.compile(r"0x[0-9a-f]+|\d+(?:\.\d+)?")


def reason_key(reason: str | None) -> str:
    """Group reasons that differ only in numbers (sizes, times, line numbers)."""
    return _NUMBERS.sub("#", (reason or "(no reason recorded)").strip().lower())


def common_reasons(store, run: dict, statuses: Iterable[str], limit: int = 10) -> list[dict]:
    """The most common reasons among trials with these statuses: [{reason (the latest
    example), count, trials (numbers), statuses}], most common first."""
    statuses = list(statuses)
    rows = select(store, f"SELECT number, status, reason FROM trials WHERE run_id = ? AND status IN "
                         f"({', '.join('?' for _ in statuses)}) ORDER BY number", (run["id"], *statuses))
    groups: dict[str, dict] = {}
    for row in rows:
        group = groups.setdefault(reason_key(row["reason"]), {"count": 0, "trials": [], "statuses": set()})
        group["count"] += 1
        group["trials"].append(row["number"])
        group["statuses"].add(row["status"])
        group["reason"] = row["reason"] or "(no reason recorded)"
    ordered = sorted(groups.values(), key=lambda g: (-g["count"], g["trials"][0]))
    return [{**g, "statuses": sorted(g["statuses"])} for g in ordered[:limit]]


def idea_outcomes(store, run: dict) -> list[dict]:
    """The ideas this run could take (its own and global ones) and what became of them:
    the trial that tried each, its status and delta (a global idea another run took
    names that run)."""
    return select(
        store,
        "SELECT i.id, i.text, i.sets, i.patch IS NOT NULL AS has_patch, i.priority, i.status, i.source, "
        "t.number AS trial, t.status AS trial_status, t.metric AS trial_metric, t.delta AS trial_delta, "
        "r.tag AS trial_run FROM ideas i LEFT JOIN trials t ON t.id = i.trial_id LEFT JOIN runs r ON r.id = t.run_id "
        "WHERE " + ideas_for_run("i.") + " ORDER BY i.id",
        (run["id"],),
        table="ideas",
    )


# ---------------------------------------------------------------------------- status and ideas


def run_status(store, run: dict, repo: Path) -> dict:
    trials = store.trials(run["id"])
    best = store.best_trial(run["id"])
    counts = status_counts(trials)  # the baseline apart: it is not a kept change
    info = {
        "tag": run["tag"], "status": run["status"], "pause_reason": run.get("pause_reason"),
        "branch": run["branch"], "best_commit": run.get("best_commit"),
        "best_metric": best["metric"] if best else None, "best_trial": best["number"] if best else None,
        "trials": len(trials), "counts": counts, "running": None,
    }
    # verification (autoloop.trust.watch, autoloop.decide.overfit): is the best checked, and is held-out still improving?
    from autoloop.decide.overfit import overfitting_signal

    info["best_metric_source"] = best.get("metric_source") if best else None
    info["best_tier"] = best.get("tier") if best else None
    from autoloop.loop.reserve import headline_of

    info["reserve"] = headline_of(store, run)
    base = baseline_trial(store, run)
    info["change"] = baseline_to_best(base["metric"] if base else None, best["metric"] if best else None,
                                      info["reserve"])
    info["best_metric_sd"] = best.get("metric_sd") if best else None
    info["best_n_runs"] = best.get("n_runs") if best else None
    info.update(noise_info(store, run))
    # Which controller holds this working tree's run lock (autoloop.loop.lock), whatever its tag.
    from autoloop.loop.lock import holder

    info["controller"] = holder(repo)
    info["remeasuring"] = remeasuring(store, run, best) if info["controller"] else None
    info["overfitting"] = (overfitting_signal(store.trials(run["id"], status=Status.KEEP)) or {}).get("message")
    running = [t for t in trials if t["status"] == "running"]
    budget = (run.get("config") or {}).get("time_budget")
    max_steps = (run.get("config") or {}).get("max_steps")
    info["running_all"] = [_running_info(t, budget, max_steps) for t in running]  # one per worker
    info["running"] = info["running_all"][-1] if running else None
    workers: dict[str, dict[str, int]] = {}
    for t in trials:
        if t.get("worker"):
            counts_of = workers.setdefault(t["worker"], {})
            counts_of[t["status"]] = counts_of.get(t["status"], 0) + 1
    info["workers"] = workers
    info["outages"] = outage_info(store, run)[-SHOWN_OUTAGES:]
    return info


def remeasuring(store, run: dict, best: dict | None) -> dict | None:
    """{trial, done, of} while the run's best is being re-measured at fresh seeds
    (autoloop.loop.reserve: a `reserve_start` event not yet followed by its `headline` or a
    `reserve` failure), else None. The caller checks that a controller holds the run."""
    from autoloop.loop.reserve import ROLE, START, size

    if best is None:
        return None
    rows = select(store, "SELECT id, kind FROM events WHERE run_id = ? AND kind IN (?, 'headline', 'reserve') "
                         "ORDER BY id DESC LIMIT 1", (run["id"], START))
    if not rows or rows[0]["kind"] != START:
        return None
    done = select(store, "SELECT COUNT(*) AS n FROM measurements WHERE trial_id = ? AND role = ?",
                  (best["id"], ROLE))[0]["n"]
    most = (run.get("config") or {}).get("reserve_seeds")
    return {"trial": best["number"], "done": done, "of": size(store, run["id"], 4 if most is None else int(most))}


SHOWN_OUTAGES = 3


def outage_info(store, run: dict) -> list[dict]:
    """The run's outages of a model or agent, oldest first, each with its one `line`
    (autoloop.proposers.outage): what `status`, the report and the page say of them."""
    from autoloop.proposers.outage import BACK, UNAVAILABLE, describe_outage, outages

    rows = select(store, "SELECT kind, message, created_at FROM events WHERE run_id = ? AND kind IN (?, ?) ORDER BY id",
                  (run["id"], UNAVAILABLE, BACK))
    return [{**o, "line": describe_outage(o)} for o in outages(rows)]


def _running_info(t: dict, budget, max_steps=None) -> dict:
    """A running trial's step, loss and what is left of its budget: steps in step mode
    (`max_steps`: its seconds are only reported, never a limit), else seconds, as the
    live page says it."""
    progress = None
    if t.get("log_path"):
        progress = last_progress(RunFolder(Path(t["log_path"]).parent).progress)
    started = t.get("started_at") or t.get("created_at")
    elapsed = None
    if started:
        elapsed = time.time() - datetime.fromisoformat(started).timestamp()
    step = (progress or {}).get("step")
    seconds_left = None
    if not max_steps:
        seconds_left = (progress or {}).get("seconds_left")
        if seconds_left is None and progress and budget and progress.get("training_seconds") is not None:
            seconds_left = budget - progress["training_seconds"]
    return {
        "number": t["number"], "kind": t["kind"], "description": t.get("description"), "worker": t.get("worker"),
        "elapsed_seconds": elapsed, "step": step, "loss": (progress or {}).get("loss"),
        "training_seconds": (progress or {}).get("training_seconds"), "seconds_left": seconds_left,
        "steps_left": max(int(max_steps) - int(step), 0) if max_steps and step is not None else None,
        "max_steps": int(max_steps) if max_steps else None,
    }


NOISE_EVENT_KINDS = ("drift", "noise")
SHOWN_NOISE_EVENTS = 3


def noise_info(store, run: dict) -> dict:
    """The run's measured noise and its latest drift and noise events:
    {"noise": {run_sd, pair_sd, df} or None, "decision_rule", "drift": [events],
    "noise_events": [events]} (events newest last). The run row is read again: the
    controller updates the estimate as the run goes."""
    rows = select(store, "SELECT noise_sd, noise_pair_sd, noise_df, decision_rule FROM runs WHERE id = ?", (run["id"],))
    row = rows[0] if rows else {}
    noise = None
    if row.get("noise_sd") is not None or row.get("noise_pair_sd") is not None:
        noise = {"run_sd": row.get("noise_sd"), "pair_sd": row.get("noise_pair_sd"), "df": row.get("noise_df")}
    events = {kind: select(store, "SELECT * FROM (SELECT e.id, e.kind, e.message, e.created_at, t.number AS trial "
                                  "FROM events e LEFT JOIN trials t ON t.id = e.trial_id WHERE e.run_id = ? "
                                  "AND e.kind = ? ORDER BY e.id DESC LIMIT ?) ORDER BY id",
                           (run["id"], kind, SHOWN_NOISE_EVENTS))
              for kind in NOISE_EVENT_KINDS}
    return {"noise": noise, "decision_rule": row.get("decision_rule"), "drift": events["drift"],
            "noise_events": events["noise"]}




# ---------------------------------------------------------------------------- the scale ladder


def ladder_summary(store, run: dict) -> list[dict]:
    """The run's latest finished rung of each spec (autoloop.review.ladder), oldest first:
    {spec, seeds, plan, headline, tags: [{trial, description, tag, effect, low, high, n,
    level, small_effect, ladder_trial}]}; [] without a ladder."""
    latest: dict[str, dict] = {}
    for row in store.rungs(run["id"]):
        if row["status"] == "done":
            latest[row["spec"]] = row
    numbers = {t["id"]: t for t in select(store, "SELECT id, number, description FROM trials WHERE run_id = ?",
                                          (run["id"],))}
    out = []
    for row in latest.values():
        tags = []
        for t in store.ladder_tags(row["id"]):
            kept = numbers.get(t["kept_trial_id"]) or {}
            tags.append({"trial": kept.get("number"), "description": kept.get("description"), "tag": t["tag"],
                         "effect": t["effect"], "low": t["low"], "high": t["high"], "n": t["n"], "level": t["level"],
                         "small_effect": t["small_effect"],
                         "ladder_trial": (numbers.get(t["ladder_trial_id"]) or {}).get("number")})
        out.append({"spec": row["spec"], "seeds": row.get("seeds"), "plan": row.get("plan"),
                    "headline": (row.get("result") or {}).get("headline"), "tags": tags})
    return out


def scale_tags(store, run: dict) -> dict[int, list[dict]]:
    """{kept trial number: [its tag row at each rung, with the rung's spec]}."""
    out: dict[int, list[dict]] = {}
    for rung in ladder_summary(store, run):
        for t in rung["tags"]:
            out.setdefault(t["trial"], []).append({**t, "spec": rung["spec"]})
    return out
