"""What a night has cost in dollars, and the one cap on it (`max_cost`).

Two things are paid for, and one cap counts both:

* **Model tokens**: each proposal's `cost_usd` (its tokens at `llm_prices`, autoloop.proposers.llm;
  null where the model has no price: such calls count as free).
* **GPU time**: the wall time of every training run of the night (candidates, the incumbent's
  re-measurements, the baseline, drift checks, crashed runs: `decide.figures.run_seconds`, the
  hours `autoloop log` and the report show), at `gpu_hour_price` dollars per GPU-hour. Each run
  holds one GPU for its wall time, so a run's GPU-hours are its wall hours. 0 by default: your
  own machine's time costs nothing here.

`cap_reason` is asked before each trial starts, like `--hours`: the run stops when what is spent
plus what the next trial is expected to cost (its GPU time at the median wall time of recent
trials, the re-measurement of the best that follows the night, and the most one trial's model
calls have cost so far) would pass `max_cost`. So a night stops before the cap rather than
after it, unless a trial costs more than any before it (a longer run, more repairs); the model
proposer also refuses a call once tokens alone reach the cap.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoloop.decide.figures import run_seconds


def usd(x: float) -> str:
    """$2.30; a sum below a cent with its first figures ($4e-06), never a bare $0.00."""
    return f"${x:.2f}" if x == 0 or abs(x) >= 0.01 else f"${x:.2g}"


@dataclass(frozen=True)
class Spent:
    """A night's spending so far, in US dollars (gpu_hours: the hours priced)."""

    tokens_usd: float
    gpu_hours: float
    gpu_usd: float
    trial_tokens_usd: float = 0.0  # the most one trial's model calls have cost (its repairs included)

    @property
    def total(self) -> float:
        return self.tokens_usd + self.gpu_usd

    def words(self) -> str:
        return (f"{usd(self.total)} ({usd(self.tokens_usd)} model tokens, {usd(self.gpu_usd)} for "
                f"{self.gpu_hours:.2f} GPU-hours)")


def gpu_hour_price(config) -> float:
    """The price per GPU-hour of a Config or of a run's recorded config (a dict)."""
    value = config.get("gpu_hour_price") if isinstance(config, dict) else getattr(config, "gpu_hour_price", 0.0)
    return float(value or 0.0)


def spent(store, run: dict, config) -> Spent:
    """What `run` has spent so far, GPU time priced by `config` (see the module docstring)."""
    row = store.query("SELECT COALESCE(SUM(cost_usd), 0) AS usd FROM proposals WHERE run_id = ?", (run["id"],))
    tokens = float(row[0]["usd"] or 0.0) if row else 0.0
    most = store.query("SELECT MAX(usd) AS usd FROM (SELECT SUM(cost_usd) AS usd FROM proposals WHERE run_id = ? "
                       "AND cost_usd IS NOT NULL GROUP BY trial_id)", (run["id"],))
    hours = run_seconds(store, run) / 3600.0
    return Spent(tokens_usd=tokens, gpu_hours=hours, gpu_usd=hours * gpu_hour_price(config),
                 trial_tokens_usd=float(most[0]["usd"] or 0.0) if most else 0.0)


def next_trial_usd(so_far: Spent, config, trial_seconds: float, reserve_seconds: float = 0.0) -> float:
    """What the next trial is expected to add: its runs' GPU time (`trial_seconds`, and the
    `reserve_seconds` the end of the night still needs) and the most a trial's model calls
    have cost so far (not the mean: the baseline and the search's trials cost no tokens, and a
    cap is better kept than passed)."""
    gpu = (trial_seconds + reserve_seconds) / 3600.0 * gpu_hour_price(config)
    return gpu + so_far.trial_tokens_usd


def cap_reason(store, run: dict, config, trial_seconds: float, reserve_seconds: float = 0.0) -> str | None:
    """The stop reason when the next trial would take the night past `max_cost`; None otherwise."""
    cap = getattr(config, "max_cost", None)
    if cap is None:
        return None
    so_far = spent(store, run, config)
    upcoming = next_trial_usd(so_far, config, trial_seconds, reserve_seconds)
    if so_far.total + upcoming <= cap:
        return None
    return f"--max-cost {cap:g}: spent {so_far.words()}; the next trial (about {usd(upcoming)}) would pass it"


def per_bpb(total_usd: float, change: dict | None) -> float | None:
    """Dollars per bpb gained: the spending over the headline's gain (baseline minus best;
    `change` as `decide.figures.baseline_to_best` gives it); None without a gain."""
    if not change or change.get("delta") is None or change["delta"] >= 0:
        return None
    return total_usd / -float(change["delta"])


def cost_summary(store, run: dict, change: dict | None) -> dict:
    """{spent_usd, tokens_usd, gpu_usd, gpu_hours, gpu_hour_price, usd_per_bpb, max_cost} of a run,
    priced by its recorded config: what the report and the live page show."""
    config = run.get("config") or {}
    so_far = spent(store, run, config)
    return {"spent_usd": so_far.total, "tokens_usd": so_far.tokens_usd, "gpu_usd": so_far.gpu_usd,
            "gpu_hours": so_far.gpu_hours, "gpu_hour_price": gpu_hour_price(config),
            "usd_per_bpb": per_bpb(so_far.total, change), "max_cost": config.get("max_cost")}


def cost_note(cost: dict) -> str:
    """The line under the dollars: what they were spent on, and per bpb gained."""
    # The machine's hours, named as the headline names them (a CPU run never says GPU).
    device = cost.get("compute") or "GPU"
    parts = [f"{usd(cost['tokens_usd'])} model tokens",
             f"{usd(cost['gpu_usd'])} {device} time" + (f" at ${cost['gpu_hour_price']:g}/{device}-hour"
                                                       if cost.get("gpu_hour_price") else " (no gpu-hour-price set)")]
    if cost.get("usd_per_bpb") is not None:
        parts.append(f"{usd(cost['usd_per_bpb'])} per bpb gained")
    if cost.get("max_cost") is not None:
        parts.append(f"cap ${cost['max_cost']:g}")
    return "; ".join(parts)
