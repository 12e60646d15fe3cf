"""The overfitting watch: val keeps improving while the held-out split does not.

Every keep improves val_bpb by construction; the loop picks edits by their val score, so
over many keeps it can fit the validation set itself (and an edit can train on it). The
held-out split, which training never reads and no proposer sees, is evaluated for every
verified keep. The watch looks at the kept chain (verified keeps with a held-out value,
in trial order) and flags it when none of the last WINDOW keeps improved on the best
held-out value before them: val went down over those keeps, held-out stopped improving
or got worse.

It is a flag for a human, not a rule the loop acts on: held-out differences of a few
1e-4 are noise at small scale, so one flat keep proves nothing, and WINDOW keeps in a
row is the smallest pattern worth a look. The controller records an `overfitting` event
when the flag goes up (not again while it stays up); `autoloop status` recomputes it.
"""

from __future__ import annotations

WINDOW = 3


def overfitting_signal(kept: list[dict], window: int = WINDOW) -> dict | None:
    """The flag for a kept chain (trial rows in number order), or None when held-out still improves."""
    chain = [t for t in kept if t.get("heldout_metric") is not None and t.get("metric") is not None]
    if len(chain) < window + 1:
        return None
    earlier, recent = chain[:-window], chain[-window:]
    best_before = min(t["heldout_metric"] for t in earlier)
    if min(t["heldout_metric"] for t in recent) < best_before:
        return None
    start, end = earlier[-1], recent[-1]
    numbers = ", ".join(str(t["number"]) for t in recent)
    message = (
        f"overfitting watch: the last {window} keeps (trials {numbers}) improved val_bpb "
        f"{start['metric']:.6f} -> {end['metric']:.6f} but held-out bpb did not improve on {best_before:.6f} "
        f"(now {end['heldout_metric']:.6f}): the loop may be fitting the validation set; review those trials"
    )
    return {
        "trials": [t["number"] for t in recent], "val_from": start["metric"], "val_to": end["metric"],
        "heldout_best_before": best_before, "heldout_now": end["heldout_metric"], "message": message,
    }


def watch(kept: list[dict]) -> dict | None:
    """After a keep (the kept chain, the new keep last): the signal if it has just gone up
    (it was down one keep earlier), else None."""
    signal = overfitting_signal(kept)
    if signal is None or overfitting_signal(kept[:-1]) is not None:
        return None
    return signal
