"""The fixed harness: data, tokenizer, loader, metric, budget, checkpoints.

Nothing here may be changed by a proposal; its fingerprint is stored with every trial.
Only torch, numpy and the standard library are imported, so train.py runs on a bare
GPU image.
"""

from autoloop.harness.causality import CausalityReport, check_causality
from autoloop.harness.checkpoint import import_train_module, load_trained_model, save_checkpoint
from autoloop.harness.clock import TrainingClock
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
from autoloop.harness.hardware import gpu_peak_flops
from autoloop.harness.metric import bpb_on_batches, evaluate_bpb
from autoloop.harness.results import ProgressWriter, finish, parse_summary, summary_block
from autoloop.harness.tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "ByteTokenizer", "CausalityReport", "DEFAULT_SEED", "DEFAULT_TIME_BUDGET", "Dataset", "FeedServer", "HarnessError",
    "ProgressWriter", "RunSpec", "TokenLoader", "Tokenizer", "TrainingClock", "UNTIMED_WARMUP_STEPS", "WindowSampler",
    "bpb_on_batches", "cache_root", "check_causality", "compute_harness_fingerprint", "configure_compile_cache",
    "default_data_dir", "eval_tokens", "evaluate_bpb", "finish", "gpu_peak_flops", "harness_fingerprint",
    "import_train_module", "load_dataset", "load_trained_model", "make_meta_only_view", "parse_summary",
    "prepare_embedded", "save_checkpoint", "seq_len", "summary_block", "verify_dataset", "write_dataset",
]
