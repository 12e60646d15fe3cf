"""A pair is a pair only on the same machine: which runs a paired comparison may use.

The paired test (autoloop.decide.rule) compares the candidate's run at seed s with the
incumbent's run at seed s, so that the seed's noise cancels. In time mode that holds only
if both runs had the same machine: a run measured while another process took half the
CPU trains half the steps, and its difference from the incumbent's run (measured hours
earlier on a quiet machine) is the load's, not the code's. Issue 22's night kept a trial
that trained 43 steps beside a baseline that got 5-8 in the same budget.

Each run records the machine's speed: a fixed probe in the worker's process before and
after training (autoloop.measure.probe, `measurements.machine_speed`). The rules here are
pure (no I/O):

* **Confounded pair.** Two runs at one seed are comparable when their speeds differ by at
  most SPEED_TOLERANCE in log terms (|log(a / b)| <= 0.25: about 28%). Among all the
  candidate's and the incumbent's runs at a seed, the pair with the closest speeds is
  the one used. A run without a speed (step mode, where speed cannot move the result;
  rows from before the probe) is comparable with anything, so step-mode runs and old
  databases pair exactly as before (the first run of each side at each seed).
* **Measure the incumbent again next to the candidate.** When a seed's closest pair is
  still confounded, that seed is left out of the incumbent's side, so the rule asks for
  the incumbent at that seed (`Verdict(measure, incumbent, s)`): a new run of the
  incumbent next to the candidate, on the machine as it is now. At most MAX_FRESH such
  runs per seed; a seed still confounded after them is given up (`dropped`): neither its
  candidate run nor its incumbent runs are used, and the rule is not offered that seed
  again (`usable`). So a machine whose speed keeps changing costs runs, never a keep on
  a confounded pair.
* **The drift check before the first keep.** Until the run has kept its first change (or
  run a drift check), a keep is not taken on incumbent runs that were all measured before
  this candidate: `guard_keep` turns it into a measurement of the incumbent at the first
  paired seed, next to the candidate; the keep is then decided on that fresh pair, and
  the fresh run against the incumbent's earlier run at the same seed is a drift check
  (`drift_check`: comparable speeds only, so load is not mistaken for drift).

These rules are the paired rule's (the default, the one whose false-keep rate is claimed).
`decision-rule = strict` stays autoresearch's rule: one run each, as they came.

The tolerance (bench/probe_noise.py prints the figures): two burners beside a run move
its speed by about log -1 (to a half or a third, the size of the effect to catch), while
a run's speed against the next run's spreads by about 0.1 (sd of the log ratio) on a
machine held busy by two burners and by about 0.2 when the load itself comes and goes
(other test suites starting and stopping on the 2-core development machine, at load ~9).
0.25 lies between: a steady machine, busy or quiet, seldom trips it, and a load that
comes or goes always does, which is right: those runs did not get the same machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from autoloop.decide.rule import DecisionConfig, Noise, Verdict, decide

SPEED_TOLERANCE = 0.25  # |log speed ratio| above which two runs were not on the same machine
MAX_FRESH = 2  # incumbent re-measurements at one seed for one candidate before the seed is given up
FIRST_KEEP_CHECK = "drift check before the first keep"

CANDIDATE_ROLES = ("candidate",)
INCUMBENT_ROLES = ("baseline", "candidate", "incumbent")


def speed_gap(a: float | None, b: float | None) -> float | None:
    """|log(a / b)| of two probe readings; None when either is unknown."""
    if not a or not b or a <= 0 or b <= 0:
        return None
    return abs(math.log(a / b))


def comparable(a: float | None, b: float | None, tolerance: float = SPEED_TOLERANCE) -> bool:
    gap = speed_gap(a, b)
    return gap is None or gap <= tolerance


@dataclass
class Pairing:
    """The runs a decision may use: {seed: metric} per side, and why others are left out."""

    candidate: dict[int, float] = field(default_factory=dict)
    incumbent: dict[int, float] = field(default_factory=dict)
    own: dict[int, float] = field(default_factory=dict)  # the candidate's first run at every seed, paired or not
    # Seeds whose pair differed in speed: waiting for the incumbent to be measured again
    # (resolved False), or paired with a fresh incumbent run instead (resolved True).
    confounded: list[dict] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)  # seeds given up after MAX_FRESH re-measurements
    fresh: list[int] = field(default_factory=list)  # seeds paired with an incumbent run measured for this candidate
    earlier: dict[int, tuple[float, float | None]] = field(default_factory=dict)  # seed: first incumbent run (metric, speed)
    chosen_speeds: dict[int, tuple[float | None, float | None]] = field(default_factory=dict)  # seed: (cand, inc)
    drifted: dict | None = None  # {seed, shift}: a fresh incumbent run found the machine changed since its first
    any_fresh: bool = False  # an incumbent run was measured for this candidate (at any seed)

    def usable(self, seeds: list[int]) -> list[int]:
        """The run's seed sequence without the seeds given up."""
        return [s for s in seeds if s not in self.dropped]

    def figures(self) -> dict:
        """What the decision record keeps of the pairing (JSON-able); {} when nothing was left out."""
        out: dict = {}
        if self.confounded:
            out["confounded"] = self.confounded
        if self.dropped:
            out["confounded_dropped"] = self.dropped
        if self.fresh:
            out["fresh_incumbent_seeds"] = self.fresh
        if self.drifted:
            out["incumbent_drifted"] = self.drifted
        return out


def _ok(row: dict, roles: tuple[str, ...], device: str | None) -> bool:
    if row.get("status") not in (None, "ok") or row.get("metric") is None or row.get("seed") is None:
        return False
    if device is not None and row.get("device") not in (None, device):
        return False
    return (row.get("role") or "candidate") in roles


def pair_runs(candidate_rows: list[dict], incumbent_rows: list[dict], *, for_trial: int | None,
              device: str | None = None, drift_limit: float | None = None, tolerance: float = SPEED_TOLERANCE,
              max_fresh: int = MAX_FRESH) -> Pairing:
    """Pair a candidate's runs with the incumbent's, seed by seed (module docstring).

    Rows are measurements rows (seed, metric, status, role, device, machine_speed,
    for_trial_id), oldest first: `candidate_rows` the trial's own, `incumbent_rows` the
    incumbent trial's (its baseline or candidate runs, and re-measurements of it).
    `for_trial`: the candidate trial's id (its re-measurements of the incumbent say so).
    `drift_limit`: a fresh incumbent run further than this from the incumbent's first run
    at the same seed and speed means the machine drifted since: then none of the
    incumbent's earlier runs is paired with this candidate (each seed is measured again)."""
    cand_by_seed: dict[int, list[dict]] = {}
    for row in candidate_rows:
        if _ok(row, CANDIDATE_ROLES, device):
            cand_by_seed.setdefault(int(row["seed"]), []).append(row)
    inc_by_seed: dict[int, list[dict]] = {}
    for row in incumbent_rows:
        if _ok(row, INCUMBENT_ROLES, device):
            inc_by_seed.setdefault(int(row["seed"]), []).append(row)

    def is_fresh(row: dict) -> bool:
        return for_trial is not None and row.get("for_trial_id") == for_trial

    out = Pairing()
    for seed, runs in inc_by_seed.items():
        first = runs[0]
        out.earlier[seed] = (float(first["metric"]), first.get("machine_speed"))
        if drift_limit is None or is_fresh(first):
            continue
        for r in runs[1:]:
            if is_fresh(r) and comparable(first.get("machine_speed"), r.get("machine_speed"), tolerance) \
                    and abs(float(r["metric"]) - float(first["metric"])) > drift_limit:
                out.drifted = {"seed": seed, "shift": float(r["metric"]) - float(first["metric"])}
    out.any_fresh = any(is_fresh(r) for runs in inc_by_seed.values() for r in runs)
    if out.drifted:  # the incumbent's earlier runs were another machine's: only fresh ones pair with this candidate
        inc_by_seed = {seed: [r for r in runs if is_fresh(r)] for seed, runs in inc_by_seed.items()}
    for seed, runs in inc_by_seed.items():
        if runs and seed not in cand_by_seed:
            out.incumbent[seed] = float(runs[0]["metric"])  # unpaired: the rule may pair a new candidate run with it
    for seed, cands in cand_by_seed.items():
        out.own[seed] = float(cands[0]["metric"])
        incs = inc_by_seed.get(seed, [])
        if not incs:
            out.candidate[seed] = float(cands[0]["metric"])  # the rule measures the incumbent here first
            continue
        fresh = [r for r in incs if is_fresh(r)]
        best = None
        for c in cands:
            for i in incs:
                gap = speed_gap(c.get("machine_speed"), i.get("machine_speed"))
                # A comparable pair first (an unknown speed is comparable), of those one with an
                # incumbent run measured next to this candidate, then the closest speeds; ties:
                # the first run of each side (as before speeds were recorded).
                key = (0 if gap is None or gap <= tolerance else 1, 0 if is_fresh(i) else 1, gap or 0.0)
                if best is None or key < best[0]:
                    best = (key, c, i, gap)
        _, c, i, gap = best
        if gap is not None and gap > tolerance:
            if len(fresh) < max_fresh:
                out.candidate[seed] = float(c["metric"])  # the incumbent is measured here again
                out.confounded.append(_gap_record(seed, c, i, resolved=False))
            else:
                out.dropped.append(seed)
            continue
        out.candidate[seed] = float(c["metric"])
        out.incumbent[seed] = float(i["metric"])
        out.chosen_speeds[seed] = (c.get("machine_speed"), i.get("machine_speed"))
        if is_fresh(i):
            out.fresh.append(seed)
            # The pair it replaced, if the incumbent's earlier run at this seed was at another speed.
            old = [r for r in inc_by_seed.get(seed, []) if not is_fresh(r)
                   and not comparable(c.get("machine_speed"), r.get("machine_speed"), tolerance)]
            if old:
                out.confounded.append(_gap_record(seed, c, old[0], resolved=True))
    out.dropped.sort()
    out.fresh.sort()
    return out


def _gap_record(seed: int, cand: dict, inc: dict, *, resolved: bool) -> dict:
    """A confounded pair as the decision records it: the seed, both speeds, their log
    ratio, and whether a fresh incumbent run has replaced the old one."""
    a, b = cand["machine_speed"], inc["machine_speed"]
    return {"seed": seed, "candidate_speed": round(a, 3), "incumbent_speed": round(b, 3),
            "log_ratio": round(math.log(a / b), 3), "resolved": resolved}


def needs_first_keep_check(trials: list[dict]) -> bool:
    """True until the run has kept a change (a proposal or repair) or run a drift check."""
    for t in trials:
        if t.get("kind") == "drift" and t.get("status") in ("keep", "discard"):
            return False
        if t.get("status") == "keep" and t.get("kind") in ("proposal", "repair"):
            return False
    return True


def decide_pairs(pairing: Pairing, noise: Noise | None, cfg: DecisionConfig, seeds: list[int], *,
                 first_keep: bool) -> Verdict:
    """autoloop.decide.rule.decide on the pairs `pairing` allows, for a candidate that has an
    incumbent: seeds given up are not offered again, a keep before the run's first keep
    waits for a fresh incumbent run (`guard_keep`), and when every incumbent run is left
    out the incumbent is measured next to the candidate (rule.decide would read an empty
    incumbent as "this is the baseline")."""
    usable = pairing.usable(seeds)
    if not pairing.incumbent:
        mine = [s for s in usable + sorted(set(pairing.candidate) - set(usable)) if s in pairing.candidate]
        if mine:
            return Verdict("measure", "incumbent", mine[0],
                           f"measure the incumbent at seed {mine[0]}, next to the candidate: no pair at one machine "
                           "speed yet", {"rule": cfg.rule, "n": 0, "stopped": "pairing"})
        left = [s for s in usable if s not in pairing.candidate]
        if left:
            return Verdict("measure", "candidate", left[0], f"measure the candidate at seed {left[0]}",
                           {"rule": cfg.rule, "n": 0, "stopped": "continue"})
        return Verdict("discard", None, None,
                       "discard: the machine's speed changed between every pair of runs, so no pair could be compared",
                       {"rule": cfg.rule, "n": 0, "stopped": "no comparable pair", "near_miss": False})
    verdict = decide(pairing.candidate, pairing.incumbent, noise, cfg, usable)
    return guard_keep(verdict, pairing, first_keep=first_keep and cfg.rule != "strict")


def guard_keep(verdict: Verdict, pairing: Pairing, *, first_keep: bool) -> Verdict:
    """A keep before the run's first keep, on incumbent runs all measured before this
    candidate, becomes a measurement of the incumbent next to it (module docstring)."""
    if verdict.action != "keep" or not first_keep or pairing.fresh or pairing.any_fresh:
        return verdict  # (a fresh run that was not comparable is the confound rule's: it is not asked for again)
    shared = sorted(s for s in pairing.candidate if s in pairing.incumbent)
    if not shared:
        return verdict
    seed = shared[0]
    return Verdict("measure", "incumbent", seed,
                   f"{FIRST_KEEP_CHECK}: measure the incumbent again at seed {seed}, next to the candidate "
                   f"(it would be kept: {verdict.reason})",
                   {**verdict.figures, "stopped": FIRST_KEEP_CHECK})


def drift_check(pairing: Pairing, seed: int, metric: float, speed: float | None,
                tolerance: float = SPEED_TOLERANCE) -> float | None:
    """The incumbent's earlier value at `seed` to judge a fresh run of it against (a
    drift check), or None when there is none or the machine's speed differs between the
    two runs (then the difference is load, which the pairing has already dealt with)."""
    before = pairing.earlier.get(seed)
    if before is None or not comparable(before[1], speed, tolerance):
        return None
    return before[0]


def waiting(pairing: Pairing) -> list[int]:
    """Seeds whose incumbent is to be measured again because their pair was confounded."""
    return [c["seed"] for c in pairing.confounded if not c["resolved"]]


def describe(confounded: list[dict]) -> str:
    """One line about the confounded pairs, for the run's events and `show`."""
    parts = []
    for c in (c for c in confounded if not c["resolved"]):
        ratio = math.exp(c["log_ratio"])
        parts.append(f"seed {c['seed']}: the machine ran at {ratio:.2f}x the speed for the candidate's run "
                     f"({c['candidate_speed']:.2f} vs {c['incumbent_speed']:.2f})")
    return "; ".join(parts) + ": not a pair; the incumbent is measured again next to the candidate"
