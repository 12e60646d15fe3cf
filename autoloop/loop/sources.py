"""The proposal scheduler over the sources (`schedule = "yield"`, docs/search.md).

The fixed chain (`schedule = "chain"`) asks the proposers in order and takes the first
answer, so a configured model answers every turn and the search only fills its gaps. With
`schedule = "yield"` each turn is ordered instead:

1. **Seeded ideas first**, always: the human's queue is never overtaken.
2. **A re-tune after a structural keep**: when the incumbent is a model's or agent's kept
   edit that is not only constants, the search re-tunes what the change most likely moved
   on it (every learning rate together, half a step down, then up), before anything else
   (`SearchProposer.retune`).
3. **The bandit**: the other sources in the order of how far each is behind its share,
   the share following its recent yield per GPU-minute with a floor for each source
   (`shares`, `turn_order`). A source with nothing to offer this turn falls through to the
   next, as in the chain.

A model's answer that only changes constants the search covers is routed to the search:
tried as a search point (proposer `search`, its description saying whose point it is),
so its yield counts for the search and the model's share is earned by structural edits.

The allocation is a pure function of the recorded trials (`outcomes`, `yields`, `shares`,
`turn_order`): nothing is kept outside the db, so a resumed run schedules as an
uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoloop.loop.host import TrialHost
from autoloop.loop.prefetch import Prefetcher
from autoloop.proposers.search import POINT_PREFIX

# The recent trials of each source its yield is read from: long enough to hold a keep or
# two, short enough that a source gone dry loses its share within a few hours.
WINDOW = 12
# Pseudo-trials at the pooled yield added to each source's own (see `yields`).
PRIOR_TRIALS = 2.0


@dataclass(frozen=True)
class Outcome:
    """One finished proposal: its source, the val_bpb it won (0 unless kept) and the
    training minutes it cost (every run of it, the incumbent's pairs included)."""

    source: str
    gain: float
    minutes: float


def yields(history: list[Outcome], sources: list[str], window: int = WINDOW,
           prior: float = PRIOR_TRIALS) -> dict[str, float | None]:
    """Each source's bpb won per GPU-minute over its last `window` outcomes, shrunk towards
    the pooled yield of all of them by `prior` pseudo-trials of average length; None for a
    source with no outcome yet.

    Why the shrinkage: a yield read from one or two trials is mostly luck, and read alone a
    model whose first edit failed would fall to the floor at once and never be heard again."""
    recent = {source: [o for o in history if o.source == source][-window:] for source in sources}
    pooled = [o for outs in recent.values() for o in outs]
    pooled_minutes = sum(max(0.0, o.minutes) for o in pooled)
    pooled_rate = sum(max(0.0, o.gain) for o in pooled) / pooled_minutes if pooled_minutes > 0 else 0.0
    pseudo = prior * pooled_minutes / len(pooled) if pooled else 0.0
    out: dict[str, float | None] = {}
    for source, outs in recent.items():
        minutes = sum(max(0.0, o.minutes) for o in outs) + pseudo
        gain = sum(max(0.0, o.gain) for o in outs) + pooled_rate * pseudo
        out[source] = None if not outs else (gain / minutes if minutes > 0 else 0.0)
    return out


def shares(rates: dict[str, float | None], floor: float) -> dict[str, float]:
    """The share of proposals per source: `floor` each, the rest in proportion to yield.

    A source not yet tried counts as the best known one (optimism: it must be tried to be
    judged); when nothing has yielded, the shares are equal. A floor too large for the
    number of sources (k x floor > 1) gives equal shares."""
    names = list(rates)
    if not names:
        return {}
    k = len(names)
    known = [r for r in rates.values() if r is not None]
    best = max(known, default=0.0)
    filled = {n: (best if r is None else r) for n, r in rates.items()}
    total = sum(filled.values())
    floor = max(0.0, floor)
    if total <= 0 or k * floor >= 1:
        return {n: 1.0 / k for n in names}
    return {n: floor + (1 - k * floor) * filled[n] / total for n in names}


def turn_order(share: dict[str, float], counts: dict[str, int]) -> list[str]:
    """The sources ordered for this turn, the one furthest behind its share first.

    `counts`: each source's proposals in the same window. Behind = share x (turns + 1) -
    proposals so far (deficit round-robin): every source stays within one proposal of its
    share, so a fixed share of 0.7 gives exactly 7 turns of 10. Ties keep `share`'s order."""
    turns = sum(counts.get(n, 0) for n in share) + 1
    rank = {n: i for i, n in enumerate(share)}
    return sorted(share, key=lambda n: (-(share[n] * turns - counts.get(n, 0)), rank[n]))


def outcomes(trials: list[dict], minutes_of) -> list[Outcome]:
    """The finished proposals among `trials` (db rows, oldest first) as outcomes;
    `minutes_of(trial)` gives a trial's training minutes."""
    out = []
    for t in trials:
        if t.get("kind") not in ("proposal", "repair") or t.get("status") in ("running", "interrupted"):
            continue
        gain = 0.0
        if t.get("status") == "keep" and t.get("metric") is not None and t.get("best_before") is not None:
            gain = max(0.0, t["best_before"] - t["metric"])
        out.append(Outcome(t.get("proposer") or "unknown", gain, max(0.0, minutes_of(t))))
    return out


class SourceSchedule:
    """`schedule = "yield"` over a controller's chain: the turn's order, the re-tune, the
    routing of a model's constant-only answer to the search. Reads the db each turn."""

    def __init__(self, controller: TrialHost, prefetcher: Prefetcher):
        self.controller = controller
        self.prefetcher = prefetcher

    def minutes(self, trial: dict) -> float:
        """A trial's training minutes: all its runs (and the incumbent's runs it asked for)."""
        walls = [m.get("wall_seconds") or 0.0 for m in self.controller.store.measurements_for(trial["id"])]
        seconds = sum(walls) if walls else (trial.get("wall_seconds") or trial.get("total_seconds") or 0.0)
        return seconds / 60.0

    def allocation(self, names: list[str]) -> tuple[dict[str, float], list[str]]:
        """The bandit's shares over `names` and this turn's order, from the recorded trials."""
        store, run_id = self.controller.store, self.controller.run_row["id"]
        history = outcomes(store.trials(run_id, last=WINDOW * 4 * max(1, len(names))), self.minutes)
        share = shares(yields(history, names), self.controller.config.schedule_floor)
        recent = [o.source for o in history if o.source in share][-WINDOW * len(names):]
        counts = {n: recent.count(n) for n in names}
        return share, turn_order(share, counts)

    def next_proposal(self, parent: str):
        from autoloop.proposers.base import ProposerChain

        proposers = self.controller.chain().proposers
        ctx = self.controller.proposal_context(parent)
        for ideas in (p for p in proposers if p.name == "ideas"):
            proposal = ProposerChain([ideas]).propose(ctx)
            if proposal is not None:
                return proposal
        search = next((p for p in proposers if hasattr(p, "retune")), None)
        if search is not None:
            proposal = search.retune(ctx)
            if proposal is not None:
                return proposal
        others = [p for p in proposers if p.name != "ideas"]
        _, order = self.allocation([p.name for p in others])
        by_name = {p.name: p for p in others}
        proposal = self.prefetcher.next_proposal(parent, [by_name[n] for n in order])
        return self.route(proposal, parent, ctx) if proposal is not None else None

    def route(self, proposal, parent: str, ctx):
        """A model's or agent's answer that only sets constants the search covers, as the
        search's point; any other proposal unchanged."""
        from autoloop.proposers.proposal import Edit, InvalidProposal, Proposal, materialize

        search = next((p for p in self.controller.chain().proposers if hasattr(p, "retune")), None)
        if search is None or proposal.source not in ("llm", "agent") or proposal.meta.get("invalid"):
            return proposal
        try:
            files = materialize(proposal, str(self.controller.project_dir), parent, ctx.read_parent_file)
        except InvalidProposal:
            return proposal  # recorded invalid, as in the chain
        old = ctx.read_parent_file(search.path)
        changed = {path: text for path, text in files.items() if text != ctx.read_parent_file(path)}
        if set(changed) != {search.path} or old is None or changed[search.path] is None:
            return proposal
        sets = search.covered_sets(ctx, old, changed[search.path])
        if not sets:
            return proposal
        from autoloop.pyconst import read_constants

        before = read_constants(old)
        moves = ", ".join(f"{name} {before[name].source} -> {value}" for name, value in sets.items())
        return Proposal(
            description=f"{POINT_PREFIX} {proposal.source}: {moves} ({proposal.description})",
            edits=[Edit(path=search.path, sets=sets)], source=search.name, idea_id=proposal.idea_id,
            model=proposal.model, meta={**proposal.meta, "routed_from": proposal.source},
        )
