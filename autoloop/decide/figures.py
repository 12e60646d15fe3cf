"""The run's figures, each computed by one function here and written one way everywhere
(`log`, `show`, `best`, `status`, `report`, the live page, `finalize` and the end of
`autoloop run`).

**The sign convention** (docs/review.md, "Numbers"): every difference is *new minus
reference*, in val_bpb, so a negative difference is a lower val_bpb, and lower is
better. In words a difference is said with its direction, never with "better" after a
signed number (a "-0.0747 better" reads both ways): `-0.0747 bpb (2.19% lower)`,
`+0.0190 bpb (0.56% higher)`. A trial's delta (candidate minus incumbent), an
ablation's effect and the best against the baseline all follow it.

**Baseline -> best** (`baseline_to_best`): the one pair every headline shows. Once the
best has been re-measured at fresh seeds (the reserve, autoloop.loop.reserve) it is the
baseline's mean -> the best's re-measured mean, the difference `-gain` with the gain's
interval turned round; before that, the baseline's mean -> the best's selection mean,
marked as such. The relative change is the difference over the baseline's value.

**Time** (`run_seconds`, `trial_seconds`): the wall time of every training run, each
counted once: a run made for trial M's comparison (the incumbent measured again) is M's,
every other run its own trial's. So the baseline's minutes are all its seeds, the
reserve's runs are the best's, and the log's minutes add up to the report's hours.
`compute_kind` says whether those runs trained on a GPU or the CPU.
"""

from __future__ import annotations

from typing import Any



# ---------------------------------------------------------------------------- differences


def relative(delta: float | None, reference: float | None) -> float | None:
    """A difference over its reference value: -0.0219 for 2.19% lower."""
    if delta is None or not reference:
        return None
    return delta / reference


def change_text(delta: float | None, reference: float | None = None, *, digits: int = 4) -> str:
    """'-0.0747 bpb (2.19% lower)', '+0.0190 bpb (0.56% higher)', '+0.0000 bpb (level)';
    without a reference, the direction alone: '-0.0747 bpb (lower)'."""
    if delta is None:
        return "-"
    rounded = round(delta, digits)
    if rounded == 0:
        return f"{0:+.{digits}f} bpb (level)"
    word = "lower" if delta < 0 else "higher"
    rel = relative(delta, reference)
    share = f"{abs(rel) * 100:.2f}% {word}" if rel is not None else word
    return f"{delta:+.{digits}f} bpb ({share})"


def percent_text(rel: float | None) -> str:
    """A relative change as the page and report cards show it: '2.19% lower'."""
    if rel is None:
        return "–"
    if round(rel * 100, 2) == 0:
        return "level"
    return f"{abs(rel) * 100:.2f}% {'lower' if rel < 0 else 'higher'}"


def baseline_to_best(baseline_metric: float | None, best_metric: float | None,
                     reserve: dict | None = None) -> dict[str, Any] | None:
    """The headline pair (module docstring): {baseline, best, delta, relative, low, high,
    source ("reserve", "baseline": nothing was kept, or "selection": not re-measured),
    selection (the mean the decisions saw)}; None without both figures."""
    if reserve:
        base = reserve.get("baseline_metric")
        value = reserve.get("value")
        if base is not None and value is not None:
            delta = -float(reserve["gain"]) if reserve.get("gain") is not None else value - base
            low, high = reserve.get("interval") or (None, None)
            return {"baseline": base, "best": value, "delta": delta, "relative": relative(delta, base),
                    "low": -high if high is not None else None, "high": -low if low is not None else None,
                    "source": "baseline" if reserve.get("source") == "baseline" else "reserve",
                    "n": reserve.get("n"), "selection": reserve.get("selection_metric", best_metric)}
    if baseline_metric is None or best_metric is None:
        return None
    delta = best_metric - baseline_metric
    return {"baseline": baseline_metric, "best": best_metric, "delta": delta,
            "relative": relative(delta, baseline_metric), "low": None, "high": None, "source": "selection",
            "n": None, "selection": best_metric}


def pair_text(pair: dict | None, *, digits: int = 4) -> str:
    """'baseline 3.4060 -> best 3.4807 re-measured at 4 fresh seeds: +0.0747 bpb (2.19% higher;
    95% interval +0.0300 to +0.1194)': one line for the end of a run, `finalize` and `status`."""
    if pair is None:
        return "no baseline -> best yet"
    f = f".{digits}f"
    head = f"baseline {pair['baseline']:{f}} -> best {pair['best']:{f}}"
    if pair["source"] == "baseline":
        return f"{head}: nothing was kept (the baseline's own runs)"
    where = (f" re-measured at {pair['n']} fresh seed{'s' if pair['n'] != 1 else ''}" if pair["source"] == "reserve"
             else " (the selection mean, not re-measured at fresh seeds)")
    text = change_text(pair["delta"], pair["baseline"], digits=digits)
    if pair.get("low") is not None and pair.get("high") is not None:
        text = text[:-1] + f"; 95% interval {pair['low']:+{f}} to {pair['high']:+{f}})"
    return f"{head}{where}: {text}"


# ---------------------------------------------------------------------------- time


def _owner_seconds(store, run_id: int) -> dict[int, float]:
    """{trial id: wall seconds of the training runs it is charged with} (module docstring)."""
    rows = store.query(
        "SELECT COALESCE(m.for_trial_id, m.trial_id) AS owner, SUM(m.wall_seconds) AS s FROM measurements m "
        "JOIN trials t ON t.id = m.trial_id WHERE t.run_id = ? AND m.wall_seconds IS NOT NULL "
        "GROUP BY COALESCE(m.for_trial_id, m.trial_id)", (run_id,))
    return {int(r["owner"]): float(r["s"] or 0.0) for r in rows}


def trial_seconds(store, run: dict) -> dict[int, float]:
    """{trial number: wall seconds of every training run it cost}; a trial without timed
    runs (a database from before measurement rows had times) keeps its own `wall_seconds`."""
    charged = _owner_seconds(store, run["id"])
    out = {}
    for t in store.query("SELECT id, number, wall_seconds FROM trials WHERE run_id = ?", (run["id"],)):
        if t["id"] in charged:
            out[t["number"]] = charged[t["id"]]
        elif t.get("wall_seconds") is not None:
            out[t["number"]] = float(t["wall_seconds"])
    return out


def run_seconds(store, run: dict) -> float:
    """The wall time of every training run of the run, crashed ones included."""
    return sum(trial_seconds(store, run).values())


def compute_kind(store, run: dict) -> str:
    """'GPU' when the run's training ran on a GPU, else 'CPU': the devices its runs
    recorded (`measurements.device`), or the run's recorded GPU for older rows."""
    devices = {str(r["device"]).strip().lower() for r in store.query(
        "SELECT DISTINCT m.device FROM measurements m JOIN trials t ON t.id = m.trial_id "
        "WHERE t.run_id = ? AND m.device IS NOT NULL", (run["id"],))}
    if devices:
        return "GPU" if devices - {"cpu", "", "none"} else "CPU"
    gpu = (run.get("gpu") or "").strip().lower()
    return "GPU" if gpu and gpu not in ("cpu", "none", "-") else "CPU"


# ---------------------------------------------------------------------------- counts


def status_counts(trials: list[dict]) -> dict[str, int]:
    """Trials by status, the baseline counted as `baseline` (it is stored as `keep`, the
    first best, but it is not a kept change)."""
    counts: dict[str, int] = {}
    for t in trials:
        key = "baseline" if t.get("kind") == "baseline" and t.get("status") == "keep" \
            else t["status"]
        counts[key] = counts.get(key, 0) + 1
    return counts


def counts_text(counts: dict[str, int]) -> str:
    """'1 baseline, 2 discard, 1 keep': the baseline first, then by status."""
    order = sorted(counts.items(), key=lambda kv: (kv[0] != "baseline", kv[0]))
    return ", ".join(f"{n} {s}" for s, n in order) or "no trials"
