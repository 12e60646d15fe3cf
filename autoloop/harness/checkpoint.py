"""Checkpoints of trained models, and rebuilding a model from a trial's own train.py.

A checkpoint is `{"format", "config", "state_dict"}`; `config` is the plain dict that the
trial's `build_model(config, device=...)` turns back into the same architecture. The
verifier imports the trial's train.py as a module (not as `__main__`, so it does not
train) to get `build_model`, then loads the weights strictly.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

from autoloop.harness.errors import HarnessError

CHECKPOINT_FORMAT = "autoloop-checkpoint/1"
_COMPILED_PREFIX = "_orig_mod."


def save_checkpoint(path: Path | str, model: torch.nn.Module, config: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {key.removeprefix(_COMPILED_PREFIX): value.detach().cpu() for key, value in model.state_dict().items()}
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"format": CHECKPOINT_FORMAT, "config": dict(config), "state_dict": state}, tmp)
    os.replace(tmp, path)


def import_train_module(train_py: Path | str):
    """Import a train.py by path under a unique module name (its __main__ block does not run)."""
    train_py = Path(train_py).resolve()
    if not train_py.exists():
        raise HarnessError(f"training script {train_py} does not exist: check the path")
    name = "autoloop_trial_" + hashlib.sha256(str(train_py).encode() + train_py.read_bytes()).hexdigest()[:16]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, train_py)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def read_checkpoint(source, label: str | None = None) -> dict:
    """The checkpoint dict from a path or an open binary file (the evaluation's model process
    gets an inherited descriptor, never a path), checked for the format."""
    label = label or f"checkpoint {source}"
    try:
        checkpoint = torch.load(source, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise HarnessError(f"{label} does not exist: the trial did not save one") from None
    except Exception as exc:
        raise HarnessError(f"{label} is unreadable ({type(exc).__name__}): the trial must be run again") from None
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT \
            or not isinstance(checkpoint.get("config"), dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise HarnessError(f"{label} is not an autoloop checkpoint: save it with autoloop.harness.save_checkpoint")
    return checkpoint


def build_from_checkpoint(train_py: Path | str, checkpoint: dict, device="cpu") -> torch.nn.Module:
    """The trial's model (its own build_model) with the checkpoint's weights, in eval mode."""
    module = import_train_module(train_py)
    build_model = getattr(module, "build_model", None)
    if not callable(build_model):
        raise HarnessError(f"{train_py} does not define build_model(config, device): its results cannot be verified")
    model = build_model(checkpoint["config"], device=device)
    model.load_state_dict(checkpoint["state_dict"], strict=True)
    model.eval()
    return model


def load_trained_model(train_py: Path | str, checkpoint_path: Path | str, device="cpu") -> torch.nn.Module:
    """Rebuild the trained model from the trial's train.py and checkpoint, in eval mode."""
    checkpoint_path = Path(checkpoint_path)
    if not checkpoint_path.exists():
        raise HarnessError(f"checkpoint {checkpoint_path} does not exist: the trial did not save one")
    return build_from_checkpoint(train_py, read_checkpoint(checkpoint_path), device)
