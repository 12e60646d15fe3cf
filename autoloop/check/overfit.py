"""(a) overfit: a fresh model trained on one fixed batch until the check's own loss is near zero;
a model that cannot memorise 512 tokens has a bug, not too little data."""

from __future__ import annotations

import itertools
import math
import time
from autoloop.check.training import autocast, first_line, fresh_model, model_seq_len, set_lr


OVERFIT_MESSAGE = (
    "the model cannot overfit a single batch: the code has a bug (a detached gradient, "
    "a wrong loss reduction, targets misaligned), not the data"
)
OVERFIT_BATCH = (4, 128)  # sequences x tokens: 512 targets, memorised in a few dozen steps
OVERFIT_STEPS = 200  # step limit
OVERFIT_TARGET = 0.1  # nats per token: "near zero" (real text sits at ~1.5-2 without memorising)


def overfit_one_batch(module, ds, device, *, steps: int = OVERFIT_STEPS, target: float = OVERFIT_TARGET,
                      batch: tuple[int, int] = OVERFIT_BATCH, seed: int = 0) -> dict:
    """Train on one fixed batch of real training text until the check's own loss < target."""
    import torch
    import torch.nn.functional as F

    from autoloop import harness as H

    rows, cols = batch[0], min(batch[1], model_seq_len(device))
    x, y = next(H.TokenLoader(ds, "train", rows, cols, device, seed=seed))
    start = time.perf_counter()
    losses: list[float] = []

    def true_loss(model) -> float:
        # The model's logits against the true next tokens: what the harness scores.
        with torch.no_grad(), autocast(module, device):
            logits = model(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1)).item()

    try:
        model, optimizers = fresh_model(module, ds, device, seed)
        first = true_loss(model)
        train_step = module.make_train_step(model, optimizers, itertools.repeat((x, y)))
        schedule = getattr(module, "lr_multiplier", None)
        for step in range(steps):
            set_lr(optimizers, schedule(step / steps) if callable(schedule) else 1.0)
            train_step()
            if (step + 1) % 10 == 0 or step == steps - 1:
                losses.append(true_loss(model))
                if losses[-1] < target or not math.isfinite(losses[-1]):
                    break
    except Exception as exc:  # the bug may be one that raises (a loss without a gradient)
        return {"status": "fail", "message": f"{OVERFIT_MESSAGE} (the training step raised {first_line(exc)})",
                "error": first_line(exc), "seconds": round(time.perf_counter() - start, 2)}
    figures = {"batch": [rows, cols], "initial_loss": round(first, 4), "final_loss": round(losses[-1], 4),
               "steps": min(step + 1, steps), "target": target, "losses_every_10": [round(v, 4) for v in losses],
               "seconds": round(time.perf_counter() - start, 2)}
    if math.isfinite(losses[-1]) and losses[-1] < target:
        return {"status": "ok", "message": f"overfits one batch: loss {first:.3f} -> {losses[-1]:.4f} in "
                                           f"{figures['steps']} steps", **figures}
    return {"status": "fail", "message": f"{OVERFIT_MESSAGE} (loss {first:.3f} -> {losses[-1]:.3f} after "
                                         f"{figures['steps']} steps; near zero is < {target})", **figures}

