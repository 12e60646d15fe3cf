"""What the check trains with: train.py's importable interface (found by reading its source,
never by importing a script that lacks it), a fresh seeded model, its optimizers and batch."""

from __future__ import annotations

import ast
from pathlib import Path

from autoloop import pyast
from autoloop.errors import AutoloopError

REQUIRED = ("model_config", "build_model", "build_optimizers", "make_train_step")


def missing_interface(train_py: Path) -> list[str]:
    """The required function names train.py does not define at top level (read, not imported)."""
    try:
        tree = pyast.parse(Path(train_py).read_text())
    except (OSError, SyntaxError, ValueError) as exc:
        raise AutoloopError(f"cannot read {train_py} ({exc}): fix the script") from None
    defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    defined |= {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)}
    return [name for name in REQUIRED if name not in defined]


def unsupported(missing: list[str]) -> dict:
    return {"status": "unsupported",
            "message": f"not supported by this script: train.py does not define {', '.join(missing)}"}


def model_seq_len(device) -> int:
    from autoloop import harness as H

    return H.seq_len(device.type)


def fresh_model(module, ds, device, seed: int):
    """A new model and optimizers from train.py, seeded."""
    import torch

    torch.manual_seed(seed)
    config = module.model_config(vocab_size=ds.vocab_size, seq_len=model_seq_len(device))
    model = module.build_model(config, device=device)
    return model, module.build_optimizers(model)


def device_key(device) -> str:
    return "cuda" if device.type == "cuda" else "cpu"


def training_setup(module, ds, device, *, seed: int, batch_size: int) -> tuple:
    """(model, optimizers, train_model, info) as train.py trains: through its
    `prepare_training` when it has one (compiled and warmed up where train.py compiles,
    the attention kernel it would pin), else eager from build_model/build_optimizers.
    info: compiled, compile_error, kernel, warmup_seconds."""

    if not hasattr(module, "prepare_training"):
        model, optimizers = fresh_model(module, ds, device, seed)
        return model, optimizers, model, {"compiled": False, "compile_error": None, "kernel": None, "warmup_seconds": 0.0}
    config = module.model_config(vocab_size=ds.vocab_size, seq_len=model_seq_len(device))
    kernel = choose_kernel(module, config, batch_size, device)
    t = module.prepare_training(config, device, seed=seed, batch_size=batch_size, kernel=kernel, log=lambda line: None)
    info = {"compiled": bool(t["compiled"]), "compile_error": t.get("compile_error"), "kernel": kernel or "sdpa default",
            "kernel_ran": t.get("kernel_ran"), "warmup_seconds": round(float(t.get("warmup_seconds") or 0.0), 2)}
    return t["model"], t["optimizers"], t["train_model"], info


def kernel_dtype(module):
    import torch

    return getattr(module, "EMBEDDING_DTYPE", None) or getattr(module, "AUTOCAST_DTYPE", None) or torch.float32


def choose_kernel(module, config, batch_size: int, device):
    """The SDPA kernel train.py would pin: its ATTENTION_BACKEND (and ATTENTION_AUTO_MARGIN)
    through the harness's choice, as train.py's main() asks; None for a script that names none."""
    from autoloop import harness as H

    if not hasattr(module, "ATTENTION_BACKEND"):
        return None
    return H.choose_attention_kernel(config, batch_size, device, kernel_dtype(module), module.ATTENTION_BACKEND,
                                     getattr(module, "ATTENTION_AUTO_MARGIN", 0.05))


def set_lr(optimizers, multiplier: float) -> None:
    """Every group's LR = its peak ("initial_lr") x multiplier: all groups scaled together."""
    for opt in optimizers:
        for group in opt.param_groups:
            group.setdefault("initial_lr", group["lr"])
            group["lr"] = group["initial_lr"] * multiplier


def group_lrs(optimizers) -> dict[str, float]:
    """{group name: peak LR}; unnamed groups are "<Optimizer>[i]"."""
    out = {}
    for opt in optimizers:
        for i, group in enumerate(opt.param_groups):
            name = group.get("name") or f"{type(opt).__name__}[{i}]"
            out[name] = group.get("initial_lr", group["lr"])
    return out


def lr_constants(module) -> dict[str, float]:
    """train.py's UPPER_CASE learning-rate constants (names ending in _LR) and their values."""
    return {name: float(value) for name, value in vars(module).items()
            if name.isupper() and name.endswith("_LR") and isinstance(value, (int, float)) and not isinstance(value, bool)}


def batch_shape(module, seq_len: int) -> tuple[int, int]:
    """(micro-batch sequences, gradient-accumulation steps) of a training step."""
    batch = int(getattr(module, "DEVICE_BATCH_SIZE", 8))
    total = int(getattr(module, "TOTAL_BATCH_TOKENS", batch * seq_len))
    return batch, max(1, total // (batch * seq_len))


def autocast(module, device):
    import torch

    dtype = getattr(module, "AUTOCAST_DTYPE", None)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__

