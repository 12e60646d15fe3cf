"""The reserve: the run's best re-measured at fresh seeds no decision used, and the
headline that comes from it.

A night's best is the candidate that looked best, so its selection mean is a lucky draw
(the winner's curse: in the simulation the strict rule's best looks 2 sigma better than
it is; docs/decisions.md). Runs at seeds no decision reached are not, so the reported
value and gain come from them (autoloop.decide.remeasure holds the statistics):

* **How many**: `reserve_size(night_runs, most=reserve_seeds)`: 4% of the night's
  training runs, at least 2, at most `reserve-seeds` (4); 0 turns the reserve off. The
  seeds are `seed + 1_000_000 + k`, far from every decision seed.
* **When**: at the end of a night that ended by its limit (`--max-trials`, `--hours`,
  nothing left to propose; not on Ctrl-C, `autoloop stop` or a pause: then the next
  `best`, `report` or `finalize` measures it), on `autoloop finalize`, and whenever
  `best` or `report` is asked for a run whose best has none (autoloop.review.remeasure
  opens the run's controller as `autoloop ablate` does, so it is refused while the run is going;
  the commands then show the selection mean, marked as not re-measured). `--hours`
  leaves room for it (autoloop.loop.run).
* **Shown**: a `reserve_start` event opens the re-measurement and `headline` (or a
  `reserve` failure) closes it, so `autoloop status` shows it as running while no trial is.
* **What**: measurements of the best trial with role `reserve`, verified where the run
  verifies (so held-out too). They are never paired, never in the noise and never in a
  decision (`INCUMBENT_ROLES` leaves them out). The baseline's own runs stand for the
  baseline: it was never the winner of a selection. So a best that is the baseline
  (nothing was kept) needs no reserve at all: its headline is its own runs, gain 0 exactly
  (`source` "baseline"; the simulation re-measures it anyway, a cost the loop skips).
* **The headline** (`headline_of`): the best's value ± se over its reserve runs, its gain
  over the baseline (positive: better) with its 95% interval, from the run's pooled
  noise as the run row holds it (unpaired: the reserve shares no seed with the baseline,
  se = run_sd sqrt(1/n + 1/n_baseline)); None while the best has no reserve run.

A reserve run in flight when the controller dies is killed at the next start
(autoloop.loop.recovery: the best trial's recorded process group, its pid and start time
checked).
"""

from __future__ import annotations

import statistics

from autoloop.decide.remeasure import headline, reserve_plan, reserve_size
from autoloop.decide.rule import Noise
from autoloop.loop.noise import INCUMBENT_ROLES, runs_of
from autoloop.store import Kind
from autoloop.loop.host import TrialHost

ROLE = "reserve"
START = "reserve_start"  # the event a re-measurement starts with; `headline` or `reserve` (a failure) ends it


def night_runs(store, run_id: int) -> int:
    """The training runs the night has spent on its decisions (every measurement but the reserve's)."""
    rows = store.query("SELECT COUNT(*) AS n FROM measurements m JOIN trials t ON t.id = m.trial_id "
                       "WHERE t.run_id = ? AND COALESCE(m.role, '') != ?", (run_id, ROLE))
    return int(rows[0]["n"]) if rows else 0


def size(store, run_id: int, most: int) -> int:
    """Fresh seeds the run's best is re-measured at (0: the reserve is off)."""
    if most <= 0:
        return 0
    return reserve_size(night_runs(store, run_id), most=most)


def baseline_of(store, run_id: int) -> dict | None:
    rows = store.trials(run_id, kind=Kind.BASELINE)
    return next((t for t in rows if t.get("metric") is not None), None)


def _same(best: dict, baseline: dict | None) -> bool:
    return baseline is not None and (best["id"] == baseline["id"] or bool(
        best.get("trial_commit") and best.get("trial_commit") == baseline.get("trial_commit")))


def missing(store, run: dict, most: int) -> list[int]:
    """The reserve seeds the run's best still lacks (none for a best that is the baseline)."""
    best = store.best_trial(run["id"])
    if best is None or best.get("metric") is None or _same(best, baseline_of(store, run["id"])):
        return []
    seed = int((run.get("config") or {}).get("seed", 1337))
    plan = reserve_plan(runs_of(store, best, (ROLE,)), {}, seed, size(store, run["id"], most), same_commit=True)
    return [s for _, s in plan]


def headline_of(store, run: dict) -> dict | None:
    """The run's reported figures from its best's reserve runs (see the module docstring),
    as JSON: value, value_se, gain, gain_se, interval, level, n, paired, df, seeds, plus
    best_trial, baseline_trial, baseline_metric, relative_gain, heldout (the reserve
    runs' mean held-out bpb, where verified), selection_metric (what the decisions saw),
    source ("reserve"; "baseline" for a best that is the baseline: its own runs)."""
    best = store.best_trial(run["id"])
    baseline = baseline_of(store, run["id"])
    if best is None or baseline is None:
        return None
    same = _same(best, baseline)
    fresh = runs_of(store, baseline, INCUMBENT_ROLES) if same else runs_of(store, best, (ROLE,))
    if not fresh:
        return None
    base_runs = fresh if same else runs_of(store, baseline, INCUMBENT_ROLES)
    if not base_runs:
        base_runs = {0: float(baseline["metric"])}
    row = store.query("SELECT noise_sd, noise_pair_sd, noise_df FROM runs WHERE id = ?", (run["id"],))[0]
    noise = None
    if row.get("noise_sd") is not None and row.get("noise_pair_sd") is not None and row.get("noise_df"):
        noise = Noise(float(row["noise_sd"]), float(row["noise_pair_sd"]), int(row["noise_df"]))
    h = headline(fresh, base_runs, noise, same_commit=bool(same)).to_json()
    base_mean = sum(base_runs.values()) / len(base_runs)
    roles = INCUMBENT_ROLES if same else (ROLE,)
    heldouts = [float(m["heldout_metric"]) for m in store.measurements(best["id"])
                if (m.get("role") or "candidate") in roles and m.get("status") == "ok"
                and m.get("heldout_metric") is not None]
    h.update(best_trial=best["number"], best_commit=best.get("trial_commit"), baseline_trial=baseline["number"],
             baseline_metric=base_mean, relative_gain=h["gain"] / base_mean if base_mean else None,
             heldout=sum(heldouts) / len(heldouts) if heldouts else None, selection_metric=best.get("metric"),
             source="baseline" if same else ROLE)
    return h


def describe(h: dict) -> str:
    """One line: 'val_bpb 1.0123 ± 0.0021 re-measured at 4 fresh seeds no decision used: -0.0531 bpb
    (4.98% lower; 95% interval ...) than the baseline 1.0654', signed as every figure is
    (autoloop.decide.figures: best minus baseline, negative is lower)."""
    from autoloop.decide.figures import baseline_to_best, change_text

    se = f" ± {h['value_se']:.4f}" if h.get("value_se") is not None else ""
    if h.get("source") == "baseline":
        return f"val_bpb {h['value']:.4f}{se}: the baseline's own {h['n']} runs (nothing was kept)"
    pair = baseline_to_best(h.get("baseline_metric"), h.get("selection_metric"), h)
    text = change_text(pair["delta"], pair["baseline"])
    if pair.get("low") is not None and pair.get("high") is not None:
        text = text[:-1] + f"; 95% interval {pair['low']:+.4f} to {pair['high']:+.4f})"
    return (f"val_bpb {h['value']:.4f}{se} re-measured at {h['n']} fresh seed{'s' if h['n'] != 1 else ''} "
            f"no decision used: {text} against the baseline {pair['baseline']:.4f}")


def at_the_end(c: TrialHost, summary) -> bool:
    """Whether the night ended by its limit (not a Ctrl-C, `autoloop stop` or a pause), so
    its reserve is measured now."""
    if summary.paused or summary.stopped or c.abort_requested:
        return False
    return c.config.reserve_seeds > 0 and bool(missing(c.store, c.run_row, c.config.reserve_seeds))


def seconds_needed(c: TrialHost) -> float:
    """What the reserve will cost at the end of the night: its runs at the median wall
    time of the night's recent runs (for `--hours`)."""
    n = size(c.store, c.run_row["id"], c.config.reserve_seeds)
    if n == 0:
        return 0.0
    rows = c.store.query("SELECT m.wall_seconds FROM measurements m JOIN trials t ON t.id = m.trial_id "
                         "WHERE t.run_id = ? AND m.status = 'ok' AND m.wall_seconds IS NOT NULL "
                         "ORDER BY m.id DESC LIMIT 20", (c.run_row["id"],))
    walls = [float(r["wall_seconds"]) for r in rows]
    return n * (statistics.median(walls) if walls else c.config.time_budget + 30.0)


def ladder_seconds_needed(c: TrialHost, *, workers: int = 1) -> float:
    """What the end-of-night ladder (`--ladder`, autoloop.review.ladder) will cost: its runs
    (autoloop.decide.ladder) at the median wall time of the night's recent runs, times the
    budget factor and the larger model's slowdown where an earlier rung of the run measured
    it (1 until then). `workers`: the night's, whose rung runs that many at a time (for
    `--hours`); 1 gives every run's time (the GPU time `--max-cost` counts)."""
    from autoloop.decide.ladder import parse_spec, seconds_needed as ladder_seconds

    spec = parse_spec(getattr(c.config, "ladder", None))
    if spec is None:
        return 0.0
    run_id = c.run_row["id"]
    kept = len([t for t in c.store.trials(run_id, status="keep")
                if t["kind"] in (Kind.PROPOSAL.value, Kind.REPAIR.value)])
    rows = c.store.query("SELECT m.wall_seconds FROM measurements m JOIN trials t ON t.id = m.trial_id "
                         "WHERE t.run_id = ? AND m.status = 'ok' AND m.wall_seconds IS NOT NULL "
                         "AND COALESCE(m.role, '') != 'ladder' ORDER BY m.id DESC LIMIT 20", (run_id,))
    walls = [float(r["wall_seconds"]) for r in rows]
    per_run = statistics.median(walls) if walls else c.config.time_budget + 30.0
    slowdowns = [(r.get("plan") or {}).get("slowdown") for r in c.store.rungs(run_id) if r["spec"] == spec.text]
    slowdown = next((s for s in reversed(slowdowns) if s), 1.0)
    return ladder_seconds(kept, c.config.ladder_seeds, run_seconds=per_run, budget_factor=spec.budget_factor,
                          slowdown=slowdown, workers=workers)


def measure(c: TrialHost, *, slot=None) -> dict | None:
    """Measure the reserve runs the run's best lacks on `slot` (default: the serial slot);
    returns the headline (None without a best, or with the reserve off)."""
    import dataclasses

    from autoloop.measure.run_folder import RunFolder

    seeds = missing(c.store, c.run_row, c.config.reserve_seeds)
    best = c.store.best_trial(c.run_row["id"])
    if seeds:
        words = (f"re-measuring the best (trial {best['number']}) at {len(seeds)} fresh seed"
                 f"{'s' if len(seeds) != 1 else ''} no decision used, for the reported figures")
        c.say(words)
        # No trial is `running` meanwhile: the event is what `status` shows as running (START).
        c.event(START, words, trial_id=best["id"])
        ctx = dataclasses.replace(c.context(slot or c.serial_slot()), incumbent=best)
        log_path = best.get("log_path")
        try:
            for seed in seeds:
                if c.abort_requested:
                    break
                m = c.measure_commit(best["trial_commit"] or c.best_commit(), seed, owner=best, role=ROLE, ctx=ctx,
                                     verify=c.measurer.external_eval)
                RunFolder(m.run_dir).checkpoint.unlink(missing_ok=True)
                if not m.ok:
                    c.event("reserve", f"the best (trial {best['number']}) failed when re-measured at the fresh seed "
                            f"{seed}: {m.reason}", trial_id=best["id"])
                    break
        finally:
            c.store.update_trial(best["id"], log_path=log_path)  # the trial's own log stays its log
            c.converge_git()
    h = headline_of(c.store, c.run_row)
    if h is not None and seeds:
        c.event("headline", describe(h), trial_id=best["id"])
        c.say(describe(h), "green")
    return h

