"""The scorer's plan: which batches the model process gets, in which order, and the checks.

A split evaluation (autoloop.harness.evaluate) scores the fixed evaluation windows of each
split (metric.evaluation_windows, in batches of the harness's batch size: the same
batches as `evaluate_bpb`, so the number is the same) and, mixed in among them, causality
*probes*. A probe batch has the same shape as a scored batch and is made of the same
evaluation windows, each changed after a random cut: the tokens after position `cut` are
replaced by the same positions of another evaluation window (real text, not noise). The
model's outputs at positions 0..cut must not change, since its inputs there did not:

* a model that looks ahead (at the next token, or anywhere after the cut) changes them;
* so does one that mixes the sequences of a batch (a probe's companions differ from the
  scored batch's), or whose outputs are not a function of its inputs;
* a few windows of each probe batch are not changed at all: all their positions must match.

Everything happens in one random order drawn from the operating system's randomness, so
the model process, which never learns which batch is which, cannot behave differently for
the probes: it sees windows of the evaluation text, at the evaluation's batch shape, in an
order it cannot predict. (The seed is recorded in the verdict afterwards.)

What is compared, per position: the log-probabilities of a few *witness* tokens — the
window's own next token, the probe's next token, and a fixed random set — under each
output (logit minus log-sum-exp over the vocabulary), at the last LOOKBACK positions up
to the cut. A leak raises the probability of the token it peeked at, which is always a
witness; comparing witnesses instead of whole rows, near the cut, keeps the memory per
probe small at any vocabulary and context, so an evaluation can afford thousands.

How many: each changed row tests the cut's position for a next-token peek (the token
after the cut always differs from the window's) and the positions before it for longer
leaks; `probe_rows` asks for that many changed rows, which the scorer derives from the
run's noise (autoloop.harness.probe_power has the arithmetic and the power).

What this cannot see: a model that remembers the windows it was shown and replays its
earlier outputs when a window's prefix comes again (see docs/verification.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# Probe batches per evaluation: at least this many, more at GPU scale (a share of the
# scored batches), and at least one of every batch shape the scored batches have.
MIN_PROBE_BATCHES = 2
PROBE_SHARE = 0.02
UNCHANGED_PER_PROBE = 2  # windows of a probe batch left as they are (batch independence, determinism)
RANDOM_WITNESSES = 8
# Positions compared per probe row, ending at the cut: a next-token peek shows at the cut,
# a leak from further ahead at every position it reaches back to.
LOOKBACK = 64
# Donors tried for a token after the cut that differs from the window's own, before that
# one token is drawn at random instead.
DONOR_TRIES = 8


@dataclass
class ProbeRow:
    """One window of a probe batch: scored window `source` of `split`, changed after `cut`."""

    split: str
    source: int  # index of the evaluation window it was made from
    cut: int  # positions 0..cut must give the scored window's outputs (T-1: unchanged)
    lo: int  # the first position compared: positions lo..cut (LOOKBACK of them at most)
    witnesses: np.ndarray  # (cut + 1 - lo, k) token ids whose log-probabilities are compared
    base: np.ndarray | None = None  # (cut + 1 - lo, k) from the scored window
    probe: np.ndarray | None = None  # (cut + 1 - lo, k) from the probe
    length: int = 0  # the window's length T

    @property
    def changed(self) -> bool:
        """A changed row tests position `cut` for a next-token peek; an unchanged one, batch mixing."""
        return self.base is not None and self.witnesses.shape[0] > 0 and self.cut < self.length - 1


@dataclass
class Batch:
    kind: str  # "scored" | "probe"
    tokens: np.ndarray  # (B, T) model inputs
    split: str | None = None
    targets: np.ndarray | None = None  # scored: (B, T)
    first: int = 0  # scored: index of its first window in the split
    rows: list[ProbeRow] = field(default_factory=list)  # probe: one per window, in order


@dataclass
class Plan:
    batches: list[Batch]  # in the order they are sent
    probes: list[ProbeRow]
    by_source: dict[tuple[str, int], list[ProbeRow]]  # the probe rows each scored window serves
    seed: int


def _probe_batches(n_scored: int) -> int:
    return max(MIN_PROBE_BATCHES, math.ceil(PROBE_SHARE * n_scored))


def make_plan(windows: dict[str, np.ndarray], batch_size: int, vocab_size: int, seed: int, *,
              probe_batches: int | None = None, probe_rows: int | None = None) -> Plan:
    """The scored batches of every split and the probe batches, shuffled together.

    `windows[split]` is a (N, T + 1) array of token ids (metric.evaluation_windows).
    `probe_rows`: at least this many changed probe rows (tested positions); else
    `probe_batches` batches, else the default share."""
    rng = np.random.Generator(np.random.PCG64(seed))
    batches: list[Batch] = []
    shapes: dict[int, list[str]] = {}
    for split, w in windows.items():
        for first in range(0, len(w), batch_size):
            chunk = w[first : first + batch_size]
            batches.append(Batch("scored", chunk[:, :-1], split=split, targets=chunk[:, 1:], first=first))
            shapes.setdefault(len(chunk), []).append(split)
    n_scored = len(batches)
    if probe_rows is not None:
        per_batch = max(max(shapes) - UNCHANGED_PER_PROBE, 1)
        wanted = max(MIN_PROBE_BATCHES, math.ceil(probe_rows / per_batch))
    else:
        wanted = probe_batches if probe_batches is not None else _probe_batches(n_scored)
    sizes = [max(shapes)] * max(wanted - (len(shapes) - 1), 1) + [s for s in shapes if s != max(shapes)]
    fixed = rng.choice(vocab_size, size=min(RANDOM_WITNESSES, vocab_size), replace=False)
    probes: list[ProbeRow] = []
    by_source: dict[tuple[str, int], list[ProbeRow]] = {}
    splits = list(windows)
    for size in sizes:
        rows, tokens = [], []
        for k in range(size):
            split = splits[int(rng.integers(len(splits)))]
            w = windows[split]
            length = w.shape[1] - 1
            source = int(rng.integers(len(w)))
            x = w[source, :-1]
            y = w[source, 1:]
            if k < UNCHANGED_PER_PROBE or len(w) < 2 or length < 2:
                cut, probe_x = length - 1, x.copy()
            else:
                cut = int(rng.integers(0, length - 1))
                # The token after the cut must differ, or the cut's position tests nothing.
                for _ in range(DONOR_TRIES):
                    donor = int(rng.integers(len(w) - 1))
                    donor += donor >= source
                    if w[donor, cut + 1] != x[cut + 1]:
                        break
                probe_x = np.concatenate([x[: cut + 1], w[donor, cut + 1 : length]])
                if probe_x[cut + 1] == x[cut + 1]:
                    probe_x[cut + 1] = (x[cut + 1] + rng.integers(1, vocab_size)) % vocab_size
            lo = max(0, cut + 1 - LOOKBACK)
            # Witnesses at position p: the window's next token, the probe's next token, the fixed set.
            probe_next = np.append(probe_x[1:], y[-1])
            ids = np.concatenate([y[lo : cut + 1, None], probe_next[lo : cut + 1, None],
                                  np.broadcast_to(fixed, (cut + 1 - lo, len(fixed)))], axis=1)
            row = ProbeRow(split, source, cut, lo, ids.astype(np.int64), length=length)
            rows.append(row)
            tokens.append(probe_x)
            probes.append(row)
            by_source.setdefault((split, source), []).append(row)
        batches.append(Batch("probe", np.stack(tokens), rows=rows))
    order = rng.permutation(len(batches))
    return Plan([batches[i] for i in order], probes, by_source, seed)


@dataclass
class Causality:
    """What the probes found: the largest change where nothing may change."""

    tolerance: float
    compared: int = 0
    tested: int = 0  # changed rows compared: positions tested for a next-token peek
    max_leak: float = 0.0
    worst: dict | None = None
    cuts: list[int] = field(default_factory=list)

    def record(self, row: ProbeRow) -> None:
        if row.base is None or row.probe is None:
            return
        diff = float(np.max(np.abs(row.base - row.probe))) if row.base.size else 0.0
        if not math.isfinite(diff):
            diff = math.inf
        self.compared += 1
        self.tested += row.changed
        self.cuts.append(row.cut)
        if diff > self.max_leak:
            self.max_leak = diff
            position = row.lo + int(np.argmax(np.max(np.abs(row.base - row.probe), axis=1))) if row.base.size else 0
            self.worst = {"split": row.split, "window": row.source, "cut": row.cut, "position": position,
                          "change": diff}

    @property
    def ok(self) -> bool:
        return self.max_leak <= self.tolerance

    def reason(self, length: int) -> str | None:
        if self.ok:
            return None
        w = self.worst or {}
        if w.get("cut") == length - 1:
            return (f"the model's outputs for an unchanged window changed with the other windows of its batch (by up "
                    f"to {self.max_leak:.3g} at position {w.get('position')}, tolerance {self.tolerance:g}): it mixes "
                    "the sequences of a batch, or its outputs are not a function of its inputs")
        return (f"leaks future tokens: changing the tokens after position {w.get('cut')} of an evaluation window "
                f"changed the outputs at position {w.get('position')} by up to {self.max_leak:.3g} (tolerance "
                f"{self.tolerance:g})")

    def as_dict(self, seed: int, length: int) -> dict:
        return {"ok": self.ok, "reason": self.reason(length), "tolerance": self.tolerance, "probes": self.compared,
                "tested_positions": self.tested, "max_leak": self.max_leak, "worst": self.worst, "cuts": sorted(self.cuts)[:64],
                "schedule_seed": seed}
