"""Attention kernels: pinning SDPA to one, timing them side by side, choosing one, and
naming the one that ran.

Fixed code: train.py says which kernel it wants (ATTENTION_BACKEND) and the model pins it;
how kernels are timed and told apart is the harness's, so `autoloop check`, bench/ and
every trial read the same answer from the same ops.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# SDPA's kernels by the names ATTENTION_BACKEND uses.
SDPA_KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}

# Substrings of the aten ops each kernel dispatches, fused kernels first. Profiler events
# ("aten::_flash_attention_forward") and dispatched ops ("aten._scaled_dot_product_flash_attention.default")
# both contain them.
KERNEL_OPS = (("_flash_attention", "flash"), ("_cudnn_attention", "cudnn"), ("_efficient_attention", "efficient"),
              ("_scaled_dot_product_attention_math", "math"))


def check_kernel_name(name):
    """`name` if it is a kernel SDPA_KERNELS knows or None; a one-line ValueError otherwise."""
    if name is not None and name not in SDPA_KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}: use one of {', '.join(SDPA_KERNELS)} or auto")
    return name


def attention_kernel(name):
    """A context that pins SDPA to kernel `name`; None leaves the choice to SDPA.

    Pinned to one kernel, SDPA raises when that kernel cannot run the shapes instead of
    quietly falling back to the math kernel (several times slower, T x T memory).
    """
    if check_kernel_name(name) is None:
        return contextlib.nullcontext()
    return sdpa_kernel([SDPA_KERNELS[name]])


def time_attention_kernels(config, batch_size, device, dtype, kernels=tuple(SDPA_KERNELS), repeats=30):
    """Median seconds of one causal SDPA forward + backward, per kernel, as the model calls it.

    The model's layout: q and k contiguous (B, H, T, D) (rotary and norm write new tensors),
    v a transposed view of the (B, T, H_kv, D) projection, the incoming gradient a
    transposed view too, and enable_gqa when there are fewer kv heads. Three untimed calls
    first, then `repeats` timed ones; the median, not the mean, so one hiccup does not
    decide. A kernel that cannot run the shapes maps to its error text (a str).
    """
    head_dim = config["n_embd"] // config["n_head"]
    B, T, Hq, Hkv = batch_size, config["seq_len"], config["n_head"], config["n_kv_head"]
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q = rand(B, Hq, T, head_dim).requires_grad_()
    k = rand(B, Hkv, T, head_dim).requires_grad_()
    v = rand(B, T, Hkv, head_dim).requires_grad_()
    dy = rand(B, T, Hq, head_dim).transpose(1, 2)
    cuda = torch.device(device).type == "cuda"
    out = {}
    for name in kernels:
        try:
            seconds = []
            for i in range(3 + repeats):
                if cuda:
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                with attention_kernel(name):
                    y = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, enable_gqa=Hkv != Hq)
                y.backward(dy)
                if cuda:
                    torch.cuda.synchronize(device)
                if i >= 3:
                    seconds.append(time.perf_counter() - t0)
            out[name] = float(np.median(seconds))
        except RuntimeError as exc:
            out[name] = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        finally:
            q.grad = k.grad = v.grad = None
    return out


def choose_attention_kernel(config, batch_size, device, dtype, backend="auto", margin=0.05):
    """The SDPA kernel to pin: `backend` itself, or with "auto" on CUDA flash unless cuDNN or
    efficient is faster by more than `margin` at these shapes; None lets SDPA choose (a CPU).

    The margin keeps the pick steady: two kernels within a few percent of each other swap
    places from one timing to the next, and a trial's kernel should not depend on that.
    """
    if backend != "auto":
        return check_kernel_name(backend)
    if torch.device(device).type != "cuda":
        return None  # a CPU has one fused kernel and math; SDPA picks the fused one when it can
    times = time_attention_kernels(config, batch_size, device, dtype, kernels=("flash", "cudnn", "efficient"))
    return pick_attention_kernel(times, margin)


def pick_attention_kernel(times, margin, default="flash"):
    """`default` unless another usable kernel takes less than (1 - margin) of its time; the
    fastest when the default cannot run; "math" (said loudly) when none can."""
    usable = {name: t for name, t in times.items() if isinstance(t, float)}
    if not usable:
        # Said loudly: the math kernel is several times slower and needs T x T memory.
        print(f"WARNING: no fused attention kernel runs these shapes ({times}); using the math kernel", flush=True)
        return "math"
    fastest = min(usable, key=usable.get)
    if default in usable and usable[fastest] >= (1 - margin) * usable[default]:
        return default
    return fastest


def kernel_from_op_names(names, none_found="math"):
    """The SDPA kernel named by the aten ops that ran (flash, cudnn, efficient, math).

    The fused kernels show by name, eager or compiled (compiled code calls them as extern
    ops). The math kernel is composite: eagerly it dispatches as matmuls and a softmax;
    compiled, the compiler fuses those away. So without a fused op: "math" when a softmax
    ran, else `none_found` ("math" where attention is known to have run, compiled or not).
    """
    joined = " ".join(names)
    for op, kernel in KERNEL_OPS:
        if op in joined:
            return kernel
    return "math" if "softmax" in joined else none_found


def ops_run(fn):
    """The names of the ops `fn()` dispatched (the profiler's CPU side: it sees the extern
    kernels that compiled code calls), and fn's result.

    torch.autograd.profiler, which torch.profiler wraps, for the same events: torch.profiler's
    start asks `hasattr(torch, "_inductor")`, which imports inductor and dynamo, 1.6 s of
    CPU that an eager run pays nowhere else."""
    from torch.autograd.profiler import profile

    with profile() as prof:
        out = fn()
    return {event.name for event in prof.function_events}, out
