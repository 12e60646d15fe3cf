"""How many causality probes an evaluation needs, and the chance they catch a sparse peek.

The threat: a model that looks at the next token at only a fraction f of positions
(chosen by a hash of the context, so the same positions every time) and predicts the
token it saw there. Its outputs elsewhere are an honest model's.

* **What one probe tests.** A probe row is an evaluation window whose tokens after a cut c
  are replaced (autoloop.harness.scoring). Positions 0..c see the same tokens as in the
  scored window, so their outputs must not change: a leak from any position after c into
  one at or before it shows. For a *next-token* peek only position c qualifies (at p < c
  the next token p + 1 <= c did not change). That is not a weakness of this design but a
  limit of any test that compares outputs: a test of position p needs two inputs with the
  same tokens 0..p and a different token p + 1, and N rows sharing prefixes form a tree
  with at most N - 1 branch points, so each row beyond the scored window tests at most
  one new position. Every changed probe row therefore tests exactly one position (the
  token after the cut is made to differ), at a place drawn uniformly and unseen by the
  model, and also tests the positions before it for longer-range leaks.

* **Detection.** The cut is a scored window's position drawn uniformly, with the window's
  own prefix and next token: it is peeked with probability f (whatever rule picks the
  peeked positions, since it cannot tell a probe from a scored batch). n probes miss every
  peek with probability (1 - f)^n, so catching it with probability >= 1 - miss needs

      n >= ln(miss) / ln(1 - f)        (about 3 / f for miss = 5%)

* **The smallest f that matters.** A peek at position p gains at most what the model
  would lose there honestly, bounded by `bits_per_peek` (log2 of the vocabulary: what a
  uniform guess costs). Over N scored targets of B bytes a peek at f N positions gains at
  most f N bits_per_peek / B bpb. A gain below the run's paired noise `noise` decides
  nothing, so the peeks that matter have

      f >= f_min = noise * (B / N) / bits_per_peek     (B / N: bytes per token)

  and n = ln(miss) / ln(1 - f_min) probes catch every peek worth the noise with
  probability >= 1 - miss. After scoring, the model's own losses give a sharper worst case
  (`peek_fraction_from_losses`: the adversary peeks where the loss is highest, so the
  fewest positions that could gain `noise`), reported next to the planned figure.

`probe_plan` caps n at a multiple of the scored rows (the cost: MAX_PROBE_FACTOR unless
the run's `probe-factor` setting says otherwise), and says the power the cap leaves;
`power_record` is what a verdict stores.
"""

from __future__ import annotations

import math

import numpy as np

MISS = 0.05  # the largest chance a peek worth the noise escapes one evaluation's probes
# Probe rows at most this many times the scored rows: the cost of a keep's verification.
MAX_PROBE_FACTOR = 16


def bits_per_peek(vocab_size: int) -> float:
    """The most a peek gains at one position, in bits: what a uniform guess would lose."""
    return math.log2(max(int(vocab_size), 2))


def peek_fraction_floor(noise_bpb: float, bytes_per_token: float, bits: float) -> float:
    """f_min: the fewest peeked positions (a share of the scored ones) that can gain `noise_bpb`."""
    if not (noise_bpb > 0 and bytes_per_token > 0 and bits > 0):
        raise ValueError(f"the peek floor needs a positive noise, bytes per token and bits per peek, got "
                         f"{noise_bpb!r}, {bytes_per_token!r}, {bits!r}")
    return min(1.0, noise_bpb * bytes_per_token / bits)


def probes_needed(f: float, miss: float = MISS) -> int:
    """Probed positions so that a peek at a fraction f escapes all of them with probability <= miss."""
    if not 0 < f <= 1 or not 0 < miss < 1:
        raise ValueError(f"probes_needed takes 0 < f <= 1 and 0 < miss < 1, got f={f!r}, miss={miss!r}")
    if f == 1:
        return 1
    return max(1, math.ceil(math.log(miss) / math.log1p(-f)))


def detection_power(f: float, n: int) -> float:
    """The chance that n uniformly placed probes hit at least one of a fraction f of peeked positions."""
    if f <= 0 or n <= 0:
        return 0.0
    return 1.0 - math.exp(n * math.log1p(-min(f, 1.0))) if f < 1 else 1.0


def peek_fraction_from_losses(bits: np.ndarray, total_bytes: int, gain_bpb: float) -> float:
    """The smallest share of positions whose honest losses (`bits` per scored target) add up
    to `gain_bpb` over `total_bytes`: a peek that gains that much peeks at least there."""
    needed = gain_bpb * total_bytes
    if len(bits) == 0 or needed <= 0:
        return 1.0
    ordered = np.cumsum(np.sort(np.asarray(bits, dtype=np.float64))[::-1])
    k = int(np.searchsorted(ordered, needed)) + 1
    return min(1.0, k / len(bits))


def probe_plan(noise_bpb: float | None, bytes_per_token: float, vocab_size: int, scored_rows: int,
               miss: float = MISS, factor: int = MAX_PROBE_FACTOR) -> tuple[int, float | None]:
    """(changed probe rows to send, f_min) for an evaluation of `scored_rows` windows, at
    most `factor` x `scored_rows` (the run's `probe-factor` setting).

    No noise known (None, or 0 as in deterministic step mode): every gain matters, so the cap."""
    if factor < 1:
        raise ValueError(f"the probe factor is a whole number >= 1, got {factor!r}")
    cap = max(1, int(factor) * scored_rows)
    if noise_bpb is None or not math.isfinite(noise_bpb) or noise_bpb <= 0:
        return cap, None
    f_min = peek_fraction_floor(noise_bpb, bytes_per_token, bits_per_peek(vocab_size))
    return min(cap, probes_needed(f_min, miss)), f_min


def power_record(*, noise_bpb: float | None, bytes_per_token: float, vocab_size: int, tested: int,
                 f_min: float | None, f_losses: float | None = None, miss: float = MISS) -> dict:
    """What a verdict stores about its probes' power (docs/verification.md has the arithmetic)."""
    record = {"noise_bpb": noise_bpb, "bytes_per_token": bytes_per_token, "bits_per_peek": bits_per_peek(vocab_size),
              "tested_positions": int(tested), "miss": miss, "f_min": f_min,
              "power": detection_power(f_min, tested) if f_min else None,
              "f_caught": 1.0 - miss ** (1.0 / tested) if tested > 0 else None}
    if f_losses is not None:
        record["f_min_losses"] = f_losses
        record["power_losses"] = detection_power(f_losses, tested)
    return record


def describe(record: dict | None) -> str:
    """One line for the log: what the probes tested and what they would have caught."""
    if not record:
        return "probes: no power figure"
    tested = record.get("tested_positions", 0)
    caught = record.get("f_caught")
    text = f"probes tested {tested} positions: a next-token peek at {caught:.2%} of positions is caught with " \
           f"probability {1 - record.get('miss', MISS):.0%}" if caught is not None else f"probes tested {tested} positions"
    if record.get("power") is not None:
        text += (f"; one worth the noise ({record['noise_bpb']:.4f} bpb, at least {record['f_min']:.3%} of positions) "
                 f"with probability {record['power']:.1%}")
    return text
