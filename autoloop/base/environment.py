"""Every child's environment: an allow-list of the controller's variables, never a secret.

A trial, the evaluator, a check's training run, a coding agent's tools: each child starts
from the names below (what torch, CUDA, the BLAS libraries and the harness need to behave
the same sandboxed and unsandboxed), plus what the caller sets on purpose. An API key in
the controller's environment reaches no child that did not ask for it by name.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from autoloop.base.openmp import openmp_defaults

# Names passed through from the controller's environment. Nothing here holds a secret;
# everything torch, CUDA, the BLAS libraries and the harness need to behave the same
# sandboxed and unsandboxed is here.
ALLOWED_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR",
    "LD_LIBRARY_PATH",  # CUDA libraries on module-based clusters and conda installs
    "CC", "CXX",  # the compilers inductor and triton build kernels with
    "VIRTUAL_ENV", "CONDA_PREFIX", "XDG_CACHE_HOME",
    "PYTHONPATH", "PYTHONHASHSEED", "PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE",
    "PYTHONNOUSERSITE", "PYTHONWARNINGS", "PYTHONFAULTHANDLER", "PYTHONIOENCODING", "PYTHONUTF8",
    # Harness settings a user may set for the controller and its children alike
    # (autoloop/harness/contract.py); the per-trial contract variables come in `extra`.
    "AUTOLOOP_CACHE_DIR", "AUTOLOOP_COMPILE_CACHE", "AUTOLOOP_DEVICE_TYPE",
})
# Families of tuning variables (thread counts, OPENBLAS_CORETYPE, which GPUs, allocator
# and compile settings). A name in them that still looks like a secret is dropped.
ALLOWED_PREFIXES = (
    "LC_", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "CUDA_", "CUBLAS_", "CUDNN_", "NCCL_",
    "NVIDIA_", "TORCH_", "TORCHINDUCTOR_", "PYTORCH_", "TRITON_",
)
SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")


def allowed_environment(extra: Mapping[str, Any], *, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A child's environment: the allow-listed part of `environ` (default: ours),
    PYTHONUNBUFFERED=1 (the log is written line by line), then `extra`, which the
    controller sets on purpose (the AUTOLOOP_* contract; a None value unsets a name)."""
    environ = os.environ if environ is None else environ
    env = {name: value for name, value in environ.items() if is_allowed(name)}
    env.update(openmp_defaults(env))  # a busy machine's steps are not stretched by spinning threads
    env["PYTHONUNBUFFERED"] = "1"
    for name, value in extra.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = str(value)
    return env


def is_allowed(name: str) -> bool:
    """Whether a child process may inherit the variable `name` (the allow-list above)."""
    if name in ALLOWED_NAMES:
        return True
    upper = name.upper()
    return name.startswith(ALLOWED_PREFIXES) and not any(marker in upper for marker in SECRET_MARKERS)
