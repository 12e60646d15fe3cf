"""(c) the budget plan: what a trial's budget buys (steps, tokens, tokens per parameter against the
compute-optimal ~20), and how many trials fit the night."""

from __future__ import annotations

import math


COMPUTE_OPTIMAL_TOKENS_PER_PARAM = 20.0  # Hoffmann et al. 2022


def budget_plan(*, tokens_per_second: float | None, tokens_per_step: int | None, matmul_params: int | None,
                time_budget: float | None, max_steps: int | None = None, hours: float | None = None,
                overhead_seconds: float = 0.0, warmup_steps: int = 0, mfu_percent: float | None = None,
                peak_memory_mb: float | None = None, memory_total_mb: float | None = None) -> dict:
    """What the budget buys, against compute-optimal training; pure arithmetic on measured figures."""
    if not tokens_per_second or not tokens_per_step:
        return {"status": "skipped", "message": "no throughput measured: no budget plan"}
    if max_steps:
        steps = max_steps
        seconds = max_steps * tokens_per_step / tokens_per_second
    else:
        seconds = time_budget
        steps = int(tokens_per_second * time_budget / tokens_per_step)
    tokens = steps * tokens_per_step
    plan = {"tokens_per_second": round(tokens_per_second, 1), "tokens_per_step": tokens_per_step,
            "training_seconds": round(seconds, 1), "steps": steps, "tokens": tokens,
            "mfu_percent": mfu_percent, "peak_memory_mb": peak_memory_mb, "memory_total_mb": memory_total_mb}
    warnings = []
    if matmul_params:
        per_param = tokens / matmul_params
        flops = 6 * matmul_params * tokens
        # Compute-optimal at this compute: C = 6 N D with D = 20 N.
        n_opt = math.sqrt(flops / (6 * COMPUTE_OPTIMAL_TOKENS_PER_PARAM))
        plan.update(params=matmul_params, tokens_per_param=round(per_param, 2), flops=flops,
                    compute_optimal_params=int(n_opt), compute_optimal_tokens=int(n_opt * COMPUTE_OPTIMAL_TOKENS_PER_PARAM))
        if per_param < 1:
            warnings.append(f"{per_param:.2g} tokens per parameter (compute-optimal ~20): the model is far too big "
                            "for the budget; shrink it or raise the budget")
    if steps < max(warmup_steps, 20):
        warnings.append(f"the budget buys {steps} steps, too few to get past warm-up ({warmup_steps} steps): raise it")
    if peak_memory_mb and memory_total_mb:
        plan["memory_headroom_percent"] = round(100 * (1 - peak_memory_mb / memory_total_mb), 1)
        if peak_memory_mb > 0.95 * memory_total_mb:
            warnings.append(f"peak memory {peak_memory_mb:,.0f} MB of {memory_total_mb:,.0f} MB: an edit that adds "
                            "memory will run out; lower DEVICE_BATCH_SIZE")
    per_run = seconds + overhead_seconds
    plan["seconds_per_run"] = round(per_run, 1)
    if hours:
        plan["hours"] = hours
        plan["runs_in_hours"] = int(hours * 3600 // per_run) if per_run > 0 else None
    parts = [f"{tokens_per_second:,.0f} tokens/s", f"{steps:,} steps and {tokens / 1e6:.3g}M tokens per run"]
    if matmul_params:
        parts.append(f"{plan['tokens_per_param']:g} tokens/parameter (compute-optimal ~20)")
    if mfu_percent is not None:
        parts.append(f"MFU {mfu_percent:.1f}%")
    if hours:
        parts.append(f"~{plan['runs_in_hours']} training runs in {hours:g} h ({per_run:.0f} s each)")
    plan["warnings"] = warnings
    plan["status"] = "warn" if warnings else "ok"
    plan["message"] = "; ".join(parts) + ("" if not warnings else " | WARNING: " + "; ".join(warnings))
    return plan

