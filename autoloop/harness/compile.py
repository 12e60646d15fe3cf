"""torch.compile or eager: the warm-up that finds out, before the first real batch.

torch.compile compiles on the first call, so the first training step used to find out
whether the compiler works: after the first batch was drawn, and an eager restart drew
it again. Here a warm-up on random tokens compiles everything (forward, backward, the
optimizers' compiled steps) and is undone before the loader opens; the decision is made
before any batch exists. A compiler that fails (no C compiler, no Triton, an inductor
bug) means an eager run, said in one WARNING line; an error of the code itself (a shape
bug, a pinned attention kernel that cannot run these shapes) is raised as itself.

Fixed code: train.py hands in how to build its model and optimizers (`setup`) and how to
take one step (`make_step`, its make_train_step); what counts as a compiler failure is not
a proposal's to decide.
"""

from __future__ import annotations

import itertools
import sys
import time

import torch

from autoloop.harness.kernels import kernel_from_op_names, ops_run

# Exception types of torch's compiler stack that mean "the compiler failed", not "the
# code is wrong": no working C/C++ compiler, no Triton, a failed C++ or Triton build, an
# internal error of inductor or dynamo, or code dynamo cannot trace (fullgraph).
COMPILER_FAILURES = ("InductorError", "BackendCompilerFailed", "InvalidCxxCompiler", "CppCompileError",
                     "TritonMissing", "InternalTorchDynamoError", "Unsupported")


def _exception_chain(exc):
    seen, todo = [], [exc]
    while todo and len(seen) < 20:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [getattr(e, "inner_exception", None), e.__cause__, e.__context__]
    return seen


def is_compile_error(exc):
    """Whether `exc` is a failure of torch's compiler (missing C compiler or Triton, inductor
    internal error, untraceable code), not an error of the code it compiled.

    Dynamo runs the code on fake tensors while tracing: a shape bug, or a pinned SDPA
    kernel that cannot run these shapes, surfaces there as a TorchRuntimeError (wrapping an
    Unsupported, wrapping the real RuntimeError). That is the code's error: False.
    """
    from torch._dynamo.exc import TorchRuntimeError

    chain = _exception_chain(exc)
    if any(isinstance(e, TorchRuntimeError) for e in chain):
        return False
    return any(type(e).__name__ in COMPILER_FAILURES and type(e).__module__.startswith(("torch._dynamo", "torch._inductor"))
               for e in chain)


def first_line(exc):
    """An exception's first line of text (its type's name when it has none), at most 300 characters."""
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


def compiled_graphs():
    """How many graphs torch.compile has compiled in this process so far."""
    if "torch._dynamo" not in sys.modules:
        # Nothing compiled: and importing dynamo to count to zero costs an eager run 1.6 CPU s.
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def warm_up(model, optimizers, make_step, train_model=None, *, batch_size, steps=1, seed=0):
    """`steps` training steps on random tokens, then model and optimizers put back as they were.

    make_step(model, optimizers, batches, train_model=...) -> step() is train.py's
    make_train_step. Compiles whatever train_model and the optimizers compile, before any
    real batch is drawn. The last step runs under the profiler to see which attention
    kernel ran. Returns (seconds, kernel that ran). Model weights are restored from a copy
    and the optimizer state is cleared, so training after it is training without it.
    """
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    cfg = model.config
    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(seed)  # its own generator: the global RNG is untouched
    tokens = torch.randint(0, cfg["vocab_size"], (batch_size, cfg["seq_len"] + 1), generator=gen).to(device)
    step = make_step(model, optimizers, itertools.repeat((tokens[:, :-1], tokens[:, 1:])), train_model=train_model)
    names = set()
    for i in range(steps):
        if i == steps - 1:
            names, _ = ops_run(step)
        else:
            step()
    with torch.no_grad():
        for key, value in model.state_dict().items():
            value.copy_(snapshot[key])
    for opt in optimizers:
        opt.state.clear()
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, kernel_from_op_names(names)


def compile_or_eager(setup, make_step, *, compile_model, batch_size, log=print):
    """Model, optimizers and the module to train through, warmed up: a dict.

    setup(compiled) -> (model, optimizers, train_model) builds them, seeded, compiled or not.
    The warm-up (2 steps compiled, 1 eager) runs on random tokens. When it fails compiled:
    a compiler failure (is_compile_error) is one WARNING line and an eager setup, so the
    run is exactly the eager run; any other error is the code's own, and the same warm-up
    run eagerly raises it with its real traceback. Keys: model, optimizers, train_model,
    compiled, warmup_seconds, kernel_ran, compile_error (the one-line reason or None),
    graphs_compiled (torch.compile's graph count after the warm-up).
    """
    model, optimizers, train_model = setup(compile_model)
    reason = None
    try:
        seconds, ran = warm_up(model, optimizers, make_step, train_model, batch_size=batch_size,
                               steps=2 if compile_model else 1)
    except Exception as exc:
        if not compile_model:
            raise
        reason = f"{type(exc).__name__}: {first_line(exc)}"
        if not is_compile_error(exc):
            # The code's own error, most likely: eagerly it raises with its real cause and
            # a traceback into the code. If eager runs, the compiler could not handle it.
            model, optimizers, train_model = setup(False)
            warm_up(model, optimizers, make_step, train_model, batch_size=batch_size)
        log(f"WARNING: torch.compile does not work here ({reason}): training eager")
        model, optimizers, train_model = setup(False)
        seconds, ran = warm_up(model, optimizers, make_step, train_model, batch_size=batch_size)
    return {"model": model, "optimizers": optimizers, "train_model": train_model, "compiled": reason is None and compile_model,
            "warmup_seconds": seconds, "kernel_ran": ran, "compile_error": reason, "graphs_compiled": compiled_graphs()}


def compile_result(training):
    """The result JSON's compile keys from compile_or_eager's dict, read at the end of training:
    a graph compiled after the warm-up is a recompile (it should stay 0)."""
    return {"warmup_seconds": training["warmup_seconds"],  # random-token warm-up before the first batch (compiles)
            "attention_kernel_ran": training["kernel_ran"],  # seen running (profiler, in the warm-up)
            "compiled": training["compiled"],  # False after a failed torch.compile (the run went on eager)
            "compile_error": training["compile_error"],
            "graphs_compiled_in_training": compiled_graphs() - training["graphs_compiled"]}
