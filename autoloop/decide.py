"""The keep/discard decision, in one replaceable function.

A later issue replaces this rule with a statistical one (re-runs, confidence); the
controller only needs `decide(candidate, best, margin) -> Decision`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    keep: bool
    reason: str


def decide_by_margin(metric: float, best: float | None, margin: float = 0.0) -> Decision:
    """Keep when the metric beats the best by more than `margin` (lower is better)."""
    if best is None:
        return Decision(True, f"first result: val_bpb {metric:.6f}")
    delta = metric - best
    if delta < -margin:
        return Decision(True, f"improved {best:.6f} -> {metric:.6f} ({delta:+.6f})")
    if margin:
        return Decision(False, f"{metric:.6f} does not beat the best {best:.6f} by more than {margin} ({delta:+.6f})")
    return Decision(False, f"{metric:.6f} is not better than the best {best:.6f} ({delta:+.6f})")
