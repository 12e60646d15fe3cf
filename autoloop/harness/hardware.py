"""Peak dense bf16 tensor-core throughput of known GPUs, for MFU.

Figures are the vendors' dense (not 2:4 sparse) bf16 numbers. Matching is by substring
of `torch.cuda.get_device_name()`, most specific first; unknown devices give None so MFU
is reported as unknown rather than guessed.
"""

from __future__ import annotations

# (substring of the device name, peak FLOP/s); order matters: more specific first.
GPU_PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("GH200", 989e12),  # before "H200": "NVIDIA GH200 480GB" contains it
    ("H200 NVL", 835e12),  # the PCIe card: lower clocks and power than the SXM H200
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),  # after every "H200...": those names contain "H20"
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("A6000", 155e12),
    ("RTX 6000 Ada", 364e12),
    ("RTX 5090", 209e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),  # fp16 tensor cores; V100 has no bf16
    ("T4", 65e12),  # fp16 tensor cores
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
)


def gpu_peak_flops(device_name: str | None) -> float | None:
    """Peak dense bf16 FLOP/s of a GPU by name, or None when unknown."""
    if not device_name:
        return None
    for key, flops in GPU_PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return flops
    return None


def peak_memory_mb(device) -> float:
    """The most memory this process has held on `device`, in MiB: CUDA's allocator peak,
    or on a CPU (roughly) the process's peak resident set."""
    import resource

    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports kilobytes
