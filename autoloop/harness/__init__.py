"""The fixed harness: data, tokenizer, loader, metric, budget, checkpoints, and the
infrastructure train.py leans on (attention kernels, FLOPs and MFU, the compile fallback).

Nothing here may be changed by a proposal; its fingerprint is stored with every trial.
Only torch, numpy and the standard library are imported, so train.py runs on a bare
GPU image.
"""

from autoloop.harness.causality import CausalityReport, check_causality
from autoloop.harness.checkpoint import import_train_module, load_trained_model, save_checkpoint
from autoloop.harness.clock import TrainingClock
from autoloop.harness.compile import (
    COMPILER_FAILURES,
    compile_or_eager,
    compile_result,
    compiled_graphs,
    first_line,
    is_compile_error,
    warm_up,
)
from autoloop.harness.constants import (
    DEFAULT_SEED,
    DEFAULT_TIME_BUDGET,
    UNTIMED_WARMUP_STEPS,
    eval_tokens,
    seq_len,
)
from autoloop.harness.contract import RunSpec, cache_root, configure_compile_cache, default_data_dir
from autoloop.harness.data import (
    Dataset,
    WindowSampler,
    load_dataset,
    make_meta_only_view,
    prepare_embedded,
    verify_dataset,
    write_dataset,
)
from autoloop.harness.errors import HarnessError
from autoloop.harness.feed import FeedServer
from autoloop.harness.loader import TokenLoader
from autoloop.harness.fingerprint import compute_harness_fingerprint, harness_fingerprint
from autoloop.harness.flops import (
    MFU_CONVENTIONS,
    Utilisation,
    executed_flops_per_token,
    flops_per_token,
    flops_per_token_palm,
    mfu_figures,
    peak_flops,
)
from autoloop.harness.hardware import gpu_peak_flops, peak_memory_mb
from autoloop.harness.kernels import (
    SDPA_KERNELS,
    attention_kernel,
    check_kernel_name,
    choose_attention_kernel,
    kernel_from_op_names,
    ops_run,
    pick_attention_kernel,
    time_attention_kernels,
)
from autoloop.harness.metric import bpb_on_batches, evaluate_bpb
from autoloop.harness.results import LossCurve, ProgressWriter, finish, parse_summary, summary_block
from autoloop.harness.tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "ByteTokenizer", "COMPILER_FAILURES", "CausalityReport", "DEFAULT_SEED", "DEFAULT_TIME_BUDGET", "Dataset",
    "FeedServer", "HarnessError", "LossCurve", "MFU_CONVENTIONS", "ProgressWriter", "RunSpec", "SDPA_KERNELS", "TokenLoader",
    "Tokenizer", "TrainingClock", "UNTIMED_WARMUP_STEPS", "Utilisation", "WindowSampler", "attention_kernel", "bpb_on_batches",
    "cache_root", "check_causality", "check_kernel_name", "choose_attention_kernel", "compile_or_eager", "compile_result",
    "compiled_graphs", "compute_harness_fingerprint", "configure_compile_cache", "default_data_dir", "eval_tokens",
    "evaluate_bpb", "executed_flops_per_token", "finish", "first_line", "flops_per_token", "flops_per_token_palm",
    "gpu_peak_flops", "harness_fingerprint", "import_train_module", "is_compile_error", "kernel_from_op_names",
    "load_dataset", "load_trained_model", "make_meta_only_view", "mfu_figures", "ops_run", "parse_summary",
    "peak_flops", "peak_memory_mb", "pick_attention_kernel", "prepare_embedded", "save_checkpoint", "seq_len",
    "summary_block", "time_attention_kernels", "verify_dataset", "warm_up", "write_dataset",
]
