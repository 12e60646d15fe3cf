"""The machine a run trains on, recorded with the run so results can be compared honestly.

A change of GPU, driver, torch or CUDA between trials can move val_bpb by more than a
proposal does; the controller compares this dict with the run's row to notice.
"""

from __future__ import annotations

import platform
import socket
import subprocess
from typing import Any


def nvidia_smi_query(*query: str) -> list[str]:
    """Non-empty output lines of `nvidia-smi <query> --format=csv,noheader`; empty when
    nvidia-smi is missing or fails (no GPU, no driver)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", *query, "--format=csv,noheader"], capture_output=True, text=True, timeout=15,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def _nvidia_driver() -> str | None:
    lines = nvidia_smi_query("--query-gpu=driver_version")
    return lines[0] if lines else None


def collect_environment() -> dict[str, Any]:
    """host, platform, python_version, torch_version, cuda_version, gpu, driver.

    Values that do not apply (no torch, no CUDA, no nvidia-smi) are None. torch is
    imported here, not at module import, because importing it takes seconds.
    """
    info: dict[str, Any] = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python_version": platform.python_version(),
        "torch_version": None,
        "cuda_version": None,
        "gpu": None,
        "driver": _nvidia_driver(),
    }
    try:
        import torch
    except ImportError:
        return info
    info["torch_version"] = torch.__version__
    info["cuda_version"] = torch.version.cuda
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info
