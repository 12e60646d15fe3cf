"""The fixed harness: data, tokenizer, loader, metric, budget, checkpoints, and the
infrastructure train.py leans on (attention kernels, FLOPs and MFU, the compile fallback).

Nothing here may be changed by a proposal; its fingerprint is stored with every trial.
Only torch, numpy and the standard library are imported, so train.py runs on a bare
GPU image.

The names below are imported on first use (`H.evaluate_bpb`, `from autoloop.harness
import TokenLoader`), not when the package is: the scorer of a CPU evaluation
(autoloop.harness.evaluate) and the controller's data and contract helpers need numpy
only, and importing torch costs them 2.6 s of CPU and 190 MB of memory each time (issue 32).
"""

from __future__ import annotations

import importlib

# name -> the module of this package that defines it
_HOME = {name: module for module, names in {
    "causality": ("CausalityReport", "check_causality"),
    "checkpoint": ("import_train_module", "load_trained_model", "save_checkpoint"),
    "clock": ("TrainingClock",),
    "compile": (
        "COMPILER_FAILURES", "compile_or_eager", "compile_result", "compiled_graphs", "first_line",
        "is_compile_error", "warm_up",
    ),
    "constants": ("DEFAULT_SEED", "DEFAULT_TIME_BUDGET", "UNTIMED_WARMUP_STEPS", "eval_tokens", "seq_len"),
    "contract": ("RunSpec", "cache_root", "configure_compile_cache", "default_data_dir"),
    "data": (
        "Dataset", "WindowSampler", "load_dataset", "make_meta_only_view", "prepare_embedded",
        "verify_dataset", "write_dataset",
    ),
    "errors": ("HarnessError",),
    "feed": ("FeedServer",),
    "fingerprint": ("compute_harness_fingerprint", "harness_fingerprint"),
    "flops": (
        "MFU_CONVENTIONS", "Utilisation", "executed_flops_per_token", "flops_per_token",
        "flops_per_token_palm", "mfu_figures", "peak_flops",
    ),
    "hardware": ("gpu_peak_flops", "peak_memory_mb"),
    "kernels": (
        "SDPA_KERNELS", "attention_kernel", "check_kernel_name", "choose_attention_kernel",
        "kernel_from_op_names", "ops_run", "pick_attention_kernel", "time_attention_kernels",
    ),
    "loader": ("TokenLoader",),
    "metric": ("bpb_on_batches", "evaluate_bpb"),
    "results": ("LossCurve", "ProgressWriter", "finish", "parse_summary", "summary_block"),
    "tokenizer": ("ByteTokenizer", "Tokenizer"),
}.items() for name in names}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    module = _HOME.get(name)
    if module is None:
        try:  # a submodule by attribute (`H.metric`), as an eager package had it
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
