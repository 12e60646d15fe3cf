"""What a trial's run looked like, beside its incumbent's: the telemetry in the brief and `show`.

A model that sees only the final val_bpb cannot tell a change that learned faster but
ran fewer steps from one that is simply worse. So for each trial the brief (and `autoloop
show N`) says, from what the worker already recorded (no new output from train.py):

* **the curve against the incumbent's at the same seed**: the trial's training loss minus
  the incumbent's, averaged over each quarter of the run (progress in (0, 25%], (25%,
  50%], ...; progress is step / max_steps in step mode, training seconds / time budget in
  time mode, as the early stop reads it: autoloop.decide.early_stop.partial_difference).
  Negative is ahead; a quarter the run never reached (stopped early) reads "?". The
  trial's run is its first candidate run with a recorded curve (`measurements.curve`; for
  a run stopped early, its progress lines up to the stop); the incumbent's is that trial's run at the same seed (the
  decision's `incumbent_id`, else the kept trial of the parent commit);
* **steps done and tokens/s**, each against the incumbent's run at that seed, MFU where
  the script reported it, peak memory (against the incumbent's);
* **where the wall time went**: start-up (the training process's wall time less its
  untimed warm-up, timed training and in-process evaluation: interpreter, imports, data,
  model build, checkpoint save), compile (the harness clock's untimed warm-up steps:
  compilation when torch.compile is on), training, evaluation (the harness's, in its own
  process, under external evaluation).

The figures of the trial row are its last run's (autoloop.loop.outcome.trial_fields);
steps and tokens/s come from the paired runs themselves, so both sides of a comparison
are one seed's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autoloop.decide.early_stop import partial_difference
from autoloop.decide.effects import decision_of

QUARTERS = (0.25, 0.5, 0.75, 1.0)
TELEMETRY_TRIALS = 8  # trials with a telemetry line in the brief (the most recent with a recorded run)
# The roles whose runs measure a trial's own code (autoloop.loop.noise.INCUMBENT_ROLES: the
# loop is a floor above, so the tuple is repeated here).
_OWN_ROLES = ("baseline", "candidate", "incumbent", None)

LEGEND = (
    "loss vs #N: the trial's training loss minus its incumbent's (trial N) at the same seed, averaged over each "
    "quarter of the run ending at 25/50/75/100% of the budget (negative: ahead at that point); a change that "
    "learns faster per step but runs fewer steps shows it here and in its steps and tokens/s. Time: where the "
    "trial's wall time went."
)


@dataclass
class Telemetry:
    number: int
    incumbent: int | None = None
    seed: int | None = None
    quarters: dict[float, float] = field(default_factory=dict)  # progress -> mean loss difference
    steps: int | None = None
    incumbent_steps: int | None = None
    tokens_per_second: float | None = None
    incumbent_tokens_per_second: float | None = None
    mfu_percent: float | None = None
    peak_memory_mb: float | None = None
    incumbent_peak_memory_mb: float | None = None
    time: dict[str, float] = field(default_factory=dict)  # start-up, compile, training, evaluation

    @property
    def empty(self) -> bool:
        return not (self.quarters or self.steps or self.tokens_per_second or self.time
                    or self.peak_memory_mb or self.mfu_percent)


def budget_of(config) -> dict:
    """The budget progress is measured against (a Config, or a run's stored config dict)."""
    get = config.get if isinstance(config, dict) else (lambda k: getattr(config, k, None))
    if get("max_steps"):
        return {"max_steps": int(get("max_steps"))}
    return {"time_budget": float(get("time_budget") or 300.0)}


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _own_runs(store, trial_id: int) -> list[dict]:
    return [m for m in store.measurements(trial_id)
            if m.get("role") in _OWN_ROLES and m.get("for_trial_id") in (None, trial_id)]


def _incumbent_of(store, trial: dict) -> dict | None:
    incumbent_id = decision_of(trial).get("incumbent_id")
    if isinstance(incumbent_id, int):
        row = store.trial_by_id(incumbent_id)
        if row is not None and row["id"] != trial["id"]:
            return row
    row = store.kept_trial_of(trial["run_id"], trial["parent_commit"]) if trial.get("parent_commit") else None
    return row if row is not None and row["id"] != trial["id"] else None


def time_split(trial: dict) -> dict[str, float]:
    """{start-up, compile, training, evaluation: seconds} of the trial row's run ({} if unknown)."""
    wall, training = _number(trial.get("wall_seconds")), _number(trial.get("training_seconds"))
    if wall is None or training is None:
        return {}
    compile_s = _number(trial.get("compile_seconds")) or 0.0
    evaluation = _number(trial.get("eval_seconds")) or 0.0
    # The script's own evaluation ran inside the training process (~0 under external
    # evaluation, where the harness's evaluation is the row's eval_seconds, after it).
    in_process = _number((trial.get("result") or {}).get("eval_seconds"))
    in_process = evaluation if in_process is None else in_process
    return {"start-up": max(0.0, wall - training - compile_s - in_process), "compile": compile_s,
            "training": training, "evaluation": evaluation}


def trial_telemetry(store, trial: dict, budget: dict) -> Telemetry:
    """The telemetry of one trial (module docstring); empty figures where nothing was recorded."""
    t = Telemetry(number=trial["number"], mfu_percent=_number(trial.get("mfu_percent")),
                  peak_memory_mb=_number(trial.get("peak_memory_mb")), time=time_split(trial))
    runs = [m for m in _own_runs(store, trial["id"]) if m.get("status") in ("ok", "stopped")]
    run = next((m for m in runs if m.get("curve")), runs[0] if runs else None)
    if run is not None:
        t.seed = run.get("seed")
        t.steps = run.get("num_steps") if run.get("num_steps") is not None else trial.get("num_steps")
        t.tokens_per_second = _number(run.get("tokens_per_second"))
    else:
        t.steps = trial.get("num_steps")
    if t.tokens_per_second is None:
        t.tokens_per_second = _number((trial.get("result") or {}).get("tokens_per_second"))
    incumbent = _incumbent_of(store, trial)
    if incumbent is None or trial.get("kind") == "baseline":
        return t
    t.incumbent = incumbent["number"]
    t.incumbent_peak_memory_mb = _number(incumbent.get("peak_memory_mb"))
    partner = None
    if t.seed is not None:
        partner = next((m for m in _own_runs(store, incumbent["id"])
                        if m.get("status") == "ok" and m.get("seed") == t.seed and m.get("curve")), None)
    if partner is None:
        return t
    t.incumbent_steps = partner.get("num_steps")
    t.incumbent_tokens_per_second = _number(partner.get("tokens_per_second"))
    curve = run.get("curve") if run is not None else None
    if not curve and run is not None and run.get("status") == "stopped":
        # A clear loser stopped early has no recorded run curve; the curves table holds its
        # progress lines up to the stop (autoloop.loop.outcome.progress_curve).
        curve = store.curve(trial["id"])
    for p in QUARTERS if curve else ():
        d = partial_difference(partner["curve"], curve, p, window=0.25, budget=budget)
        if d is not None:
            t.quarters[p] = d
    return t


def _versus(value, other, text) -> str:
    if other:
        return f"{text(value)} vs {text(other)} ({(value - other) / other:+.0%})"
    return text(value)


def _rate(value: float) -> str:
    return f"{value / 1000:.1f}k" if value >= 1000 else f"{value:.0f}"


def telemetry_line(t: Telemetry) -> str:
    """One line a model can read: '#12 vs #9 (seed 1): loss vs #9 +0.021/+0.004/-0.006/-0.011; ...'."""
    parts = []
    if t.quarters:
        shown = "/".join(f"{t.quarters[p]:+.4f}" if p in t.quarters else "?" for p in QUARTERS)
        parts.append(f"loss vs #{t.incumbent} at 25/50/75/100%: {shown}")
    if t.steps is not None:
        parts.append("steps " + _versus(t.steps, t.incumbent_steps, lambda v: f"{v:,}"))
    if t.tokens_per_second:
        parts.append("tok/s " + _versus(t.tokens_per_second, t.incumbent_tokens_per_second, _rate))
    if t.mfu_percent is not None:
        parts.append(f"MFU {t.mfu_percent:.1f}%")
    if t.peak_memory_mb:
        parts.append("peak mem " + _versus(t.peak_memory_mb, t.incumbent_peak_memory_mb, lambda v: f"{v:,.0f} MB"))
    if t.time:
        total = sum(t.time.values())
        spec = ".0f" if total >= 100 else ".1f"  # a CPU trial of 20 s still says where its seconds went
        parts.append(f"time {total:{spec}} s: " + ", ".join(f"{k} {v:{spec}}" for k, v in t.time.items()))
    seed = f" (seed {t.seed})" if t.seed is not None and t.quarters else ""
    return f"#{t.number}{seed}: " + "; ".join(parts)


def telemetry_section(store, trials: list[dict], config, limit: int = TELEMETRY_TRIALS) -> str:
    """The brief's telemetry: a legend and one line for each of the last `limit` finished
    trials with a recorded run ('' when none has one)."""
    budget = budget_of(config)
    lines = []
    for trial in reversed(trials):
        if len(lines) >= limit:
            break
        if trial.get("status") == "running":
            continue
        t = trial_telemetry(store, trial, budget)
        if not t.empty:
            lines.append("- " + telemetry_line(t))
    if not lines:
        return ""
    return LEGEND + "\n" + "\n".join(reversed(lines))
