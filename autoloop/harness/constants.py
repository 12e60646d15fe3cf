"""Fixed constants of the harness. No proposal may change them: they make trials comparable.

Sizes that depend on the device are keyed by torch device type ("cuda", "cpu", ...);
anything that is not CUDA gets the CPU value, so an MPS or XPU machine behaves like a CPU
one rather than pretending to be a datacenter GPU.
"""

DEFAULT_TIME_BUDGET = 300.0  # seconds of timed training per trial (autoresearch's 5 minutes)
DEFAULT_SEED = 1337

# Steps whose time is not counted: on CUDA they pay for torch.compile and autotuning.
# They are a harness constant, not train.py's choice, so no proposal trains for free
# by declaring more of them.
UNTIMED_WARMUP_STEPS = 3

# Context length the model is trained and evaluated at.
SEQ_LEN = {"cuda": 2048, "cpu": 256}

# Size of the fixed evaluation sets, in target tokens (capped by the split's length).
# On CUDA this is ~8M tokens (a few seconds on an H100); on a CPU a small slice so a
# 30-second run still has time to evaluate.
EVAL_TOKENS = {"cuda": 2**23, "cpu": 2**15}

# The embedded default corpus (autoloop/harness/synthetic.py): documents per split, about
# 2.3 KB each, so about 10 MB in all, 5% val and 5% held-out as a prepared dataset's buckets.
EMBEDDED_DOCUMENTS = {"train": 4032, "val": 224, "heldout": 224}
# Split assignment of a prepared dataset's document, by a hash of its text: buckets out of 100.
VAL_BUCKETS = range(90, 95)
HELDOUT_BUCKETS = range(95, 100)
SPLITS = ("train", "val", "heldout")


def device_key(device_type: str) -> str:
    return "cuda" if device_type == "cuda" else "cpu"


def seq_len(device_type: str) -> int:
    """The harness's fixed context length for this device type."""
    return SEQ_LEN[device_key(device_type)]


def eval_tokens(device_type: str) -> int:
    """How many target tokens the fixed validation / held-out evaluation covers."""
    return EVAL_TOKENS[device_key(device_type)]


# Largest allowed change of a log-probability at a position that must not change (the
# causality checks: autoloop.harness.causality in one process, the scorer's probes).
FP32_TOLERANCE = 1e-4
LOW_PRECISION_TOLERANCE = 2e-2  # bf16 autocast, as on a GPU
