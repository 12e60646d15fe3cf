"""
autoloop train.py: single-file, single-device, fixed-budget GPT pretraining.

This file is the experiment. The research loop edits it (the constants below, or any
code), trains it for a fixed budget, and keeps the edit only if val_bpb improves.

    python train.py                                  # harness default budget (300 s)
    AUTOLOOP_TIME_BUDGET=30 python train.py          # a 30-second run
    AUTOLOOP_MAX_STEPS=50 AUTOLOOP_SEED=1 python train.py   # step mode: deterministic

Every AUTOLOOP_* variable is optional (docs/architecture.md, "Contracts"):
the result JSON, checkpoint and progress file are written only when their paths are set.
Data, tokenizer, evaluation (val_bpb) and the clock come from the fixed harness
(autoloop.harness) so no edit here can change how a trial is scored.

On CUDA it trains a ~25M-parameter model (the scale of autoresearch's baseline; the byte
vocabulary makes the embeddings small) with torch.compile and bf16 autocast; on a CPU it
trains a tiny one in fp32, eager, so a 30-second run on a laptop still learns visibly.
The scale switch is one block ("Device and scale") below the hyperparameters.

Importable names (the harness, `autoloop check` and tests rely on them): build_model,
model_config, GPT, muon_orthogonalize, Muon, build_optimizers, make_train_step,
attention_kernel, lr_multiplier, weight_decay_at, muon_momentum_at, flops_per_token,
executed_flops_per_token. Training runs only under __main__.
"""

import contextlib
import gc
import math
import resource
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from autoloop import harness as H

# ---------------------------------------------------------------------------
# ---- Hyperparameters ----
# Edit these directly: there are no command-line flags. Values are the CUDA scale; the
# "Device and scale" block below replaces a few of them on a CPU.
# ---------------------------------------------------------------------------

# Model shape
DEPTH = 8  # transformer blocks
MODEL_DIM = 512  # residual stream width (d_model)
N_HEAD = 4  # query heads (head_dim = MODEL_DIM // N_HEAD = 128); range 1..16 pow2
N_KV_HEAD = 4  # key/value heads; < N_HEAD gives grouped-query attention; range 1..16 pow2
MLP_RATIO = 4  # MLP hidden width = MLP_RATIO * MODEL_DIM; range 1..8 int
ROPE_BASE = 10000.0  # rotary embedding base frequency
LOGIT_SOFTCAP = 15.0  # logits = cap * tanh(logits / cap): keeps early training stable
# SDPA kernel: "flash" | "cudnn" | "efficient" | "math" | "auto". A named kernel that cannot
# run these shapes is an error, never a silent fall back to math; "auto" times the usable
# ones for the model's shapes on CUDA and takes the fastest (on a CPU: SDPA's own choice).
ATTENTION_BACKEND = "auto"

# Batch
TOTAL_BATCH_TOKENS = 2**19  # tokens per optimizer step (all micro-steps together)
DEVICE_BATCH_SIZE = 64  # sequences per forward/backward (micro-step); lower it on OOM
EVAL_BATCH_SIZE = 32  # sequences per forward in the final evaluation

# Optimizer: Muon for the 2-D matrices of the blocks, AdamW for everything else
MATRIX_LR = 0.04  # Muon learning rate; range 0.001..0.5 log
EMBEDDING_LR = 0.6  # AdamW, token embedding (scaled by (MODEL_DIM/768)**-0.5); range 0.01..10 log
UNEMBEDDING_LR = 0.004  # AdamW, lm_head (scaled by (MODEL_DIM/768)**-0.5); range 0.0001..0.1 log
SCALAR_LR = 0.5  # AdamW, any other parameter (gains, scalars; none in the baseline)
ADAM_BETAS = (0.8, 0.95)  # AdamW betas: short memory suits the short runs
ADAM_EPS = 1e-10  # AdamW epsilon
WEIGHT_DECAY = 0.2  # Muon decoupled weight decay at the start; decays linearly to 0
MUON_MOMENTUM = 0.95  # Muon Nesterov momentum after warm-up
MUON_MOMENTUM_START = 0.85  # ... and at step 0
MUON_MOMENTUM_WARMUP_STEPS = 300  # steps to ramp the Muon momentum up
MUON_NS_STEPS = 5  # Polar Express iterations (the coefficient table has 5); range 1..5 int

# Schedule, as fractions of the budget (progress from the harness clock: time or steps)
WARMUP_RATIO = 0.0  # linear LR warm-up; range 0..0.5 linear
WARMDOWN_RATIO = 0.5  # linear LR decay at the end
FINAL_LR_FRAC = 0.0  # LR at the end, as a fraction of the peak; range 0..0.5 linear

# Logging
LOG_EVERY = 10  # print / write progress every this many steps
CURVE_POINTS = 256  # the result's loss curve is thinned to at most about this many points

# ---------------------------------------------------------------------------
# ---- Device and scale ----
# The one place where the device changes the run. On CUDA: the full model, compiled,
# bf16 autocast, bf16 Muon, weights materialised straight on the GPU from the meta
# device. On a CPU: a tiny model in fp32, eager, so a 30 s run learns visibly (a 2-core
# CPU does roughly 25k tokens/s at this size). Each derived switch is one line of the
# form `NAME = <expression>`, so a test can force the CUDA code path on a CPU by
# replacing the expression (tests/test_train.py does exactly that).
# ---------------------------------------------------------------------------

DEVICE_TYPE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE_TYPE == "cpu":
    # Shallow wins at this budget: in 30 s on 2 cores, 2 layers reached val_bpb ~2.45,
    # 3 layers ~2.60 and 4 layers ~2.74 (same width and batch, equal wall time).
    DEPTH = 2
    MODEL_DIM = 128
    N_HEAD = 2  # head_dim 64
    N_KV_HEAD = 2
    TOTAL_BATCH_TOKENS = 16 * 256  # 16 sequences of the harness's CPU context (256)
    DEVICE_BATCH_SIZE = 8  # 2 micro-steps per optimizer step
    EVAL_BATCH_SIZE = 16
    MUON_MOMENTUM_WARMUP_STEPS = 50  # a CPU run has only a few hundred steps

COMPILE = DEVICE_TYPE == "cuda"  # torch.compile the model (and Muon's orthogonalisation)
AUTOCAST_DTYPE = torch.bfloat16 if DEVICE_TYPE == "cuda" else None  # None: plain fp32
INIT_ON_META = DEVICE_TYPE == "cuda"  # build on the meta device, then allocate on the target
MUON_DTYPE = torch.bfloat16 if DEVICE_TYPE == "cuda" else torch.float32  # Polar Express dtype

# ---------------------------------------------------------------------------
# ---- Model ----
# GPT: token embedding -> RMSNorm -> DEPTH x [attention, MLP] (pre-norm, parameter-free
# RMSNorm) -> RMSNorm -> untied lm_head -> soft-capped logits. Attention uses rotary
# position embeddings and RMSNorm on queries and keys (QK-norm); the MLP is ReLU^2.
# Output projections start at zero, so every block starts as the identity.
# ---------------------------------------------------------------------------


def model_config(vocab_size=None, seq_len=None):
    """The architecture as a plain dict (stored in the checkpoint; build_model reads it)."""
    return {
        "vocab_size": int(vocab_size or H.ByteTokenizer.vocab_size),
        "seq_len": int(seq_len or H.seq_len(DEVICE_TYPE)),
        "n_layer": DEPTH,
        "n_embd": MODEL_DIM,
        "n_head": N_HEAD,
        "n_kv_head": N_KV_HEAD,
        "mlp_ratio": MLP_RATIO,
        "rope_base": ROPE_BASE,
        "logit_softcap": LOGIT_SOFTCAP,
    }


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def apply_rotary(x, cos, sin):
    # x: (B, H, T, D); rotate the two halves of each head as complex pairs.
    d = x.size(-1) // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head = cfg["n_head"], cfg["n_kv_head"]
        self.head_dim = cfg["n_embd"] // cfg["n_head"]
        assert cfg["n_embd"] % cfg["n_head"] == 0 and cfg["n_head"] % cfg["n_kv_head"] == 0
        self.c_q = nn.Linear(cfg["n_embd"], self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(cfg["n_embd"], self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(cfg["n_embd"], self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(self.n_head * self.head_dim, cfg["n_embd"], bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = norm(apply_rotary(q, cos, sin)), norm(apply_rotary(k, cos, sin))
        # Under autocast q and k can come out of the norm in fp32; SDPA wants one dtype.
        q, k = q.to(v.dtype), k.to(v.dtype)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hidden = cfg["mlp_ratio"] * cfg["n_embd"]
        self.c_fc = nn.Linear(cfg["n_embd"], hidden, bias=False)
        self.c_proj = nn.Linear(hidden, cfg["n_embd"], bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn = CausalSelfAttention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(norm(x), cos, sin)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = dict(cfg)
        self.wte = nn.Embedding(cfg["vocab_size"], cfg["n_embd"])
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg["n_layer"])])
        self.lm_head = nn.Linear(cfg["n_embd"], cfg["vocab_size"], bias=False)
        # Rotary tables are derived, not learned: not in the state dict (persistent=False),
        # recomputed by init_weights on the real device.
        cos, sin = self._rotary_tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _rotary_tables(self, device=None):
        head_dim = self.config["n_embd"] // self.config["n_head"]
        inv_freq = self.config["rope_base"] ** -(torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
        t = torch.arange(self.config["seq_len"], dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)  # (T, head_dim/2)
        return freqs.cos()[None, None], freqs.sin()[None, None]  # (1, 1, T, head_dim/2)

    @torch.no_grad()
    def init_weights(self):
        """Explicit initialisation (needed after to_empty from the meta device)."""
        n_embd = self.config["n_embd"]
        bound = 3**0.5 * n_embd**-0.5  # uniform with std n_embd**-0.5
        nn.init.normal_(self.wte.weight, mean=0.0, std=1.0)
        nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.001)
        for block in self.blocks:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                nn.init.uniform_(lin.weight, -bound, bound)
            # Zero output projections: each block starts as the identity on the residual.
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)
        cos, sin = self._rotary_tables(device=self.wte.weight.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(self, idx, targets=None):
        """Logits (B, T, vocab) in fp32; with targets, the mean cross-entropy instead."""
        T = idx.size(1)
        assert T <= self.cos.size(2), f"sequence of {T} tokens is longer than the rotary table ({self.cos.size(2)})"
        cos, sin = self.cos[:, :, :T], self.sin[:, :, :T]
        x = norm(self.wte(idx))
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(norm(x)).float()
        cap = self.config["logit_softcap"]
        logits = cap * torch.tanh(logits / cap)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def build_model(config=None, device="cpu"):
    """The model for `config` (None: model_config() from the constants), initialised, on `device`.

    The harness calls this to rebuild a trained model from a checkpoint (the config is
    stored in it), then loads the weights over the fresh initialisation.
    """
    config = dict(config) if config is not None else model_config()
    device = torch.device(device)
    if INIT_ON_META:
        # No memory and no init kernels are spent on weights that init_weights overwrites.
        with torch.device("meta"):
            model = GPT(config)
        model.to_empty(device=device)
    else:
        with torch.device(device):
            model = GPT(config)
    model.init_weights()
    return model


# SDPA's kernels by the names ATTENTION_BACKEND uses (torch.nn.attention.SDPBackend members).
SDPA_KERNELS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


def attention_kernel(name):
    """A context that pins SDPA to kernel `name`; None leaves the choice to SDPA.

    Pinned to one kernel, SDPA raises when that kernel cannot run the shapes instead of
    quietly falling back to the math kernel (several times slower, T x T memory).
    """
    if name is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name not in SDPA_KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}: use one of {', '.join(SDPA_KERNELS)} or auto")
    return sdpa_kernel([getattr(SDPBackend, SDPA_KERNELS[name])])


def time_attention_kernels(config, batch_size, device, dtype, kernels=tuple(SDPA_KERNELS), repeats=10):
    """Seconds per causal SDPA forward + backward at the model's shapes, per kernel.

    A kernel that cannot run the shapes maps to its error text (a str) instead of a time.
    """
    head_dim = config["n_embd"] // config["n_head"]
    shape_q = (batch_size, config["n_head"], config["seq_len"], head_dim)
    shape_kv = (batch_size, config["n_kv_head"], config["seq_len"], head_dim)
    q = torch.randn(shape_q, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(shape_kv, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    gqa = config["n_kv_head"] != config["n_head"]
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    times = {}
    for name in kernels:
        try:
            with attention_kernel(name):
                for i in range(repeats + 2):  # two untimed calls: kernel selection, allocator warm-up
                    if i == 2:
                        sync()
                        t0 = time.perf_counter()
                    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
                    y.sum().backward()
                sync()
            times[name] = (time.perf_counter() - t0) / repeats
        except RuntimeError as exc:
            times[name] = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        q.grad = k.grad = v.grad = None
    return times


def choose_attention_kernel(config, batch_size, device, dtype, backend=None):
    """The SDPA kernel to pin: `backend` (ATTENTION_BACKEND by default), or with "auto" on
    CUDA the fastest of flash, cuDNN and efficient at these shapes; None lets SDPA choose.
    """
    backend = backend or ATTENTION_BACKEND
    if backend != "auto":
        return backend
    if torch.device(device).type != "cuda":
        return None  # a CPU has one fused kernel and math; SDPA picks the fused one when it can
    times = time_attention_kernels(config, batch_size, device, dtype, kernels=("flash", "cudnn", "efficient"))
    usable = {name: t for name, t in times.items() if isinstance(t, float)}
    if not usable:
        # Said loudly: the math kernel is several times slower and needs T x T memory.
        print(f"WARNING: no fused attention kernel runs these shapes ({times}); using the math kernel", flush=True)
        return "math"
    return min(usable, key=usable.get)


def _matmul_params(model):
    """Parameters used as matmul weights: all but embedding tables (a lookup is no FLOPs)."""
    lookups = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in lookups)


def _attention_pairs(seq_len, causal=True):
    """Mean query-key pairs scored per token: (T + 1) / 2 for causal attention, T if all are."""
    return (seq_len + 1) / 2 if causal else seq_len


def flops_per_token(model):
    """Model FLOPs per trained token (forward + backward): what MFU counts.

    6 per matmul weight (2 forward, 4 backward) for every parameter except embedding
    lookups, plus attention scores and the weighted sum over the query-key pairs a causal
    model needs: 2 matmuls x 2 FLOPs x 3 (fwd + bwd) = 12 per pair per head dimension, with
    (T + 1) / 2 pairs per query on average, not T (the masked half is not model work).
    """
    cfg = model.config
    head_dim = cfg["n_embd"] // cfg["n_head"]
    return int(6 * _matmul_params(model) + 12 * cfg["n_layer"] * cfg["n_head"] * head_dim * _attention_pairs(cfg["seq_len"]))


def executed_flops_per_token(model, optimizers=None, tokens_per_step=None, kernel=None):
    """FLOPs per token the hardware executes: the model FLOPs plus the work that is not model work.

    The math SDPA kernel scores all T x T pairs and masks afterwards (flash, cuDNN and
    efficient kernels skip the masked tiles); Muon's Polar Express iterations run once per
    optimizer step, so their FLOPs are spread over the step's tokens.
    """
    cfg = model.config
    head_dim = cfg["n_embd"] // cfg["n_head"]
    flops = flops_per_token(model)
    if kernel == "math":
        wasted = _attention_pairs(cfg["seq_len"], causal=False) - _attention_pairs(cfg["seq_len"])
        flops += 12 * cfg["n_layer"] * cfg["n_head"] * head_dim * wasted
    if optimizers and tokens_per_step:
        for opt in optimizers:
            if not isinstance(opt, Muon):
                continue
            for group in opt.param_groups:
                rows, cols = group["params"][0].shape
                small, big = min(rows, cols), max(rows, cols)
                # Per iteration: A = X X^T (2 s^2 b), A @ A (2 s^3), B @ X (2 s^2 b).
                per_matrix = MUON_NS_STEPS * (4 * small * small * big + 2 * small**3)
                flops += len(group["params"]) * per_matrix / tokens_per_step
    return int(flops)


# ---------------------------------------------------------------------------
# ---- Optimizer ----
# Muon (MomentUm Orthogonalized by Newton-Schulz; here the Polar Express iteration) for
# the 2-D weights of the blocks: the Nesterov-momentum update is replaced by the nearest
# semi-orthogonal matrix, so every direction moves at the same rate. AdamW for the
# embedding, the lm_head and any other parameter.
# ---------------------------------------------------------------------------

# Polar Express (Amsel et al. 2025, arXiv:2505.16932) coefficients for 5 iterations of
# X <- a X + (b A + c A^2) X with A = X X^T, as in modded-nanogpt and nanochat. Each
# step is the optimal odd polynomial for the current singular value interval, so five
# steps bring all singular values close to 1 (plain Newton-Schulz needs more).
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def muon_orthogonalize(G, steps=MUON_NS_STEPS, dtype=None):
    """Approximate U V^T of G = U S V^T (singular values pushed to ~1); batched over leading dims.

    Computed in `dtype` (MUON_DTYPE by default: bf16 on CUDA, fp32 on a CPU whose bf16
    matmuls are slow) and returned in that dtype.
    """
    assert G.ndim >= 2 and steps <= len(POLAR_EXPRESS_COEFFS)
    X = G.to(dtype or MUON_DTYPE)
    tall = G.size(-2) > G.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        X = X.mT
    # Scale so the largest singular value is below 1 (the Frobenius norm bounds it); the
    # 2% margin is Polar Express's safety factor for low-precision arithmetic.
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
    for a, b, c in POLAR_EXPRESS_COEFFS[:steps]:
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X.mT if tall else X


class Muon(torch.optim.Optimizer):
    """Muon with Nesterov momentum and Polar Express, for groups of same-shape 2-D parameters.

    Parameters of one shape are stacked and orthogonalised in one batched call. The LR is
    scaled by max(1, rows/cols)**0.5 so tall matrices (the MLP up-projection) get updates
    of the same RMS per element as square ones. Weight decay is decoupled (p *= 1 - lr*wd).
    """

    def __init__(self, params, lr, momentum=MUON_MOMENTUM, weight_decay=0.0, orthogonalize=muon_orthogonalize):
        params = list(params)
        groups = []
        for shape in sorted({tuple(p.shape) for p in params}):
            groups.append({"params": [p for p in params if tuple(p.shape) == shape], "name": "matrix {}x{}".format(*shape)})
        super().__init__(groups, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})
        self.orthogonalize = orthogonalize

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            params = group["params"]
            if all(p.grad is None for p in params):
                continue
            grads = torch.stack([torch.zeros_like(p) if p.grad is None else p.grad for p in params])  # (K, rows, cols)
            state = self.state[params[0]]  # one stacked buffer per group, kept on its first parameter
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grads)
            buf = state["momentum_buffer"]
            momentum = group["momentum"]
            buf.lerp_(grads, 1 - momentum)
            update = grads.lerp_(buf, momentum)  # Nesterov: look ahead along the momentum
            update = self.orthogonalize(update)
            rows, cols = params[0].shape
            lr = group["lr"] * max(1.0, rows / cols) ** 0.5
            decay = 1 - group["lr"] * group["weight_decay"]
            for p, u in zip(params, update.unbind(0)):
                p.mul_(decay).add_(u.to(p.dtype), alpha=-lr)


def build_optimizers(model, orthogonalize=muon_orthogonalize):
    """[Muon, AdamW] for `model`; every group records its peak LR as "initial_lr" and has a "name"."""
    matrices = [p for p in model.blocks.parameters() if p.ndim == 2]
    matrix_ids = {id(p) for p in matrices}
    embedding, head = [model.wte.weight], [model.lm_head.weight]
    special = matrix_ids | {id(model.wte.weight), id(model.lm_head.weight)}
    scalars = [p for p in model.parameters() if id(p) not in special]
    # AdamW LRs were tuned at width 768 (nanochat); a wider model takes smaller steps.
    width_scale = (model.config["n_embd"] / 768) ** -0.5
    adam_groups = [
        {"params": embedding, "lr": EMBEDDING_LR * width_scale, "name": "embedding"},
        {"params": head, "lr": UNEMBEDDING_LR * width_scale, "name": "lm_head"},
    ]
    if scalars:
        adam_groups.append({"params": scalars, "lr": SCALAR_LR, "name": "scalars"})
    use_fused = next(model.parameters()).device.type == "cuda"
    adamw = torch.optim.AdamW(adam_groups, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=0.0, fused=use_fused)
    muon = Muon(matrices, lr=MATRIX_LR, momentum=MUON_MOMENTUM_START, weight_decay=WEIGHT_DECAY,
                orthogonalize=orthogonalize)
    optimizers = [muon, adamw]
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers


def make_train_step(model, optimizers, batches, *, grad_accum=1, train_model=None, kernel=None):
    """One optimizer step as a function: `train_step() -> (mean loss, grad norm)`, floats.

    `batches` yields (inputs, targets); the first batch is drawn here and each next one
    right after a backward, so on CUDA its copy overlaps the GPU's work. The forward runs
    through `train_model` (the compiled module; `model` by default) under bf16 autocast
    where AUTOCAST_DTYPE says so and with SDPA pinned to `kernel`; gradients land on
    `model`'s parameters. The caller sets learning rates and schedules before each call.
    """
    train_model = model if train_model is None else train_model
    device = next(model.parameters()).device
    autocast = torch.autocast(device.type, dtype=AUTOCAST_DTYPE, enabled=AUTOCAST_DTYPE is not None)
    x, y = next(batches)

    def train_step():
        nonlocal x, y
        loss_sum = torch.zeros((), device=device)
        for _ in range(grad_accum):
            with autocast, attention_kernel(kernel):
                loss = train_model(x, y)
            loss_sum += loss.detach()
            (loss / grad_accum).backward()  # mean over micro-steps
            x, y = next(batches)  # fetch the next batch while the GPU works
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        return loss_sum.item() / grad_accum, grad_norm.item()  # .item() waits for the step to finish

    return train_step


# ---------------------------------------------------------------------------
# ---- Schedules ----
# Functions of progress in [0, 1] (the harness clock: timed seconds / budget, or step /
# max steps), so a schedule means the same thing at any budget.
# ---------------------------------------------------------------------------


def lr_multiplier(progress):
    if progress < WARMUP_RATIO:
        return (progress + 1e-8) / WARMUP_RATIO
    if progress < 1.0 - WARMDOWN_RATIO:
        return 1.0
    decay = (1.0 - progress) / WARMDOWN_RATIO
    return decay + (1 - decay) * FINAL_LR_FRAC


def weight_decay_at(progress):
    return WEIGHT_DECAY * (1.0 - progress)


def muon_momentum_at(step):
    frac = min(step / MUON_MOMENTUM_WARMUP_STEPS, 1.0) if MUON_MOMENTUM_WARMUP_STEPS > 0 else 1.0
    return (1 - frac) * MUON_MOMENTUM_START + frac * MUON_MOMENTUM


# ---------------------------------------------------------------------------
# ---- Training ----
# ---------------------------------------------------------------------------


def fail(reason):
    print(f"FAIL: {reason}", flush=True)
    sys.exit(1)


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # Rough on a CPU: the process's peak resident set (Linux reports kilobytes).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    t_start = time.perf_counter()
    spec = H.RunSpec.from_env()
    device = torch.device(DEVICE_TYPE)
    torch.manual_seed(spec.seed)
    np.random.seed(spec.seed % 2**32)
    if device.type == "cuda":
        torch.cuda.manual_seed(spec.seed)
        torch.set_float32_matmul_precision("high")  # fp32 matmuls outside autocast may use TF32
    if COMPILE:
        H.configure_compile_cache(spec)

    ds = H.load_dataset(spec.data_dir)
    seq_len = H.seq_len(device.type)
    tokens_per_micro = DEVICE_BATCH_SIZE * seq_len
    if TOTAL_BATCH_TOKENS % tokens_per_micro:
        raise H.HarnessError(
            f"TOTAL_BATCH_TOKENS={TOTAL_BATCH_TOKENS} is not a multiple of DEVICE_BATCH_SIZE*seq_len={tokens_per_micro}: "
            "edit the constants so it is"
        )
    grad_accum = TOTAL_BATCH_TOKENS // tokens_per_micro

    config = model_config(vocab_size=ds.vocab_size, seq_len=seq_len)
    kernel = choose_attention_kernel(config, DEVICE_BATCH_SIZE, device, AUTOCAST_DTYPE or torch.float32)
    tokens_per_step = tokens_per_micro * grad_accum

    def setup(compiled):
        """Model, optimizers, step function; seeded, so starting over eager repeats an eager run exactly."""
        torch.manual_seed(spec.seed)
        model = build_model(config, device=device)
        train_model, orthogonalize = model, muon_orthogonalize
        if compiled:
            # dynamic=False: shapes never change in training, and static shapes compile to
            # the fastest kernels. The uncompiled `model` is kept for evaluation and saving.
            train_model = torch.compile(model, dynamic=False)
            orthogonalize = torch.compile(muon_orthogonalize, dynamic=False)
        optimizers = build_optimizers(model, orthogonalize=orthogonalize)
        loader = H.TokenLoader(ds, "train", DEVICE_BATCH_SIZE, seq_len, device, seed=spec.seed)
        step_fn = make_train_step(model, optimizers, loader, grad_accum=grad_accum, train_model=train_model, kernel=kernel)
        return model, optimizers, step_fn

    compiled = COMPILE
    model, optimizers, train_step = setup(compiled)
    muon = optimizers[0]
    num_params = sum(p.numel() for p in model.parameters())
    flops_tok = flops_per_token(model)
    executed_tok = executed_flops_per_token(model, optimizers, tokens_per_step, kernel)
    clock = H.TrainingClock(spec)
    progress_log = H.ProgressWriter(spec.progress_path)

    budget = f"{spec.max_steps} steps" if spec.max_steps else f"{spec.time_budget:g} s"
    print(f"device: {device.type} | params: {num_params:,} | layers {DEPTH} x width {MODEL_DIM} | seq_len {seq_len}")
    print(f"batch: {TOTAL_BATCH_TOKENS:,} tokens/step = {grad_accum} x {DEVICE_BATCH_SIZE} x {seq_len} | "
          f"budget: {budget} | compile: {compiled} | autocast: {AUTOCAST_DTYPE} | attention: {kernel or 'sdpa default'} | "
          f"seed {spec.seed}", flush=True)

    curve, curve_stride = [], 1
    while not clock.done:
        step = clock.steps
        progress = clock.progress
        lr_mult = lr_multiplier(progress)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * lr_mult
        for group in muon.param_groups:
            group["momentum"] = muon_momentum_at(step)
            group["weight_decay"] = weight_decay_at(progress)

        t0 = time.perf_counter()
        try:
            train_loss, grad_norm = train_step()
        except Exception as exc:  # compilation happens in the first step
            if not (compiled and step == 0 and is_compile_error(exc)):
                raise
            # No Triton, no C compiler, an inductor bug: one line, then the same run eager
            # rather than a crash that costs the trial (and, every trial, the night).
            print(f"WARNING: torch.compile does not work here ({_first_line(exc)}): training eager", flush=True)
            compiled = False
            model, optimizers, train_step = setup(compiled)
            muon = optimizers[0]
            continue
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        clock.step_finished(dt)

        if math.isnan(train_loss):
            fail("loss is nan")
        if train_loss > 100:
            fail(f"loss exploded ({train_loss:.4g} > 100)")

        if step == 0:
            # Python's cyclic GC scans every live object (torch.compile makes a great many)
            # and its pauses cost hundreds of ms at random steps. Everything long-lived
            # exists after step 0, and the loop makes no reference cycles, so freeze what
            # exists and turn the collector off.
            gc.collect()
            gc.freeze()
            gc.disable()

        last = clock.done
        if step % curve_stride == 0 or last:
            # lr: the schedule's multiplier of every group's peak LR (1 = peak).
            curve.append({"step": step + 1, "seconds": round(clock.training_seconds, 4), "loss": round(train_loss, 5),
                          "lr": lr_mult, "grad_norm": round(grad_norm, 5)})
            if len(curve) > CURVE_POINTS:  # thin to every other point and record half as often
                curve, curve_stride = curve[::2], curve_stride * 2
        if step % LOG_EVERY == 0 or last:
            tok_per_s = tokens_per_micro * grad_accum / dt
            mfu = _mfu(flops_tok * tok_per_s, device)
            record = {"step": step + 1, "progress": round(progress, 4), "loss": round(train_loss, 5), "lr": lr_mult,
                      "grad_norm": round(grad_norm, 5), "tokens_per_second": round(tok_per_s, 1),
                      "training_seconds": round(clock.training_seconds, 3), "mfu_percent": mfu}
            progress_log.log(record)
            print(f"step {step + 1:05d} ({100 * progress:5.1f}%) | loss {train_loss:.4f} | lr x{lr_mult:.3f} | "
                  f"grad norm {record['grad_norm']:.3f} | {1000 * dt:.0f} ms | {tok_per_s:,.0f} tok/s"
                  + (f" | mfu {mfu:.1f}%" if mfu is not None else ""), flush=True)
    gc.enable()

    # ---- Evaluation and results ----
    # The uncompiled model: it is what the verifier rebuilds from the checkpoint, so its
    # re-evaluated val_bpb matches this one, and no recompile for another batch size.
    # Under the controller (AUTOLOOP_EVAL=external) a separate harness process evaluates the
    # checkpoint, so val_bpb stays null here and training never reads the val split.
    t_eval = time.perf_counter()
    val_bpb = None if spec.external_eval else H.evaluate_bpb(model, ds, "val", device=device, batch_size=EVAL_BATCH_SIZE)
    eval_seconds = time.perf_counter() - t_eval
    if spec.external_eval:
        print("val_bpb: n/a (evaluated by the harness from the checkpoint)", flush=True)
    if spec.checkpoint_path is not None:
        H.save_checkpoint(spec.checkpoint_path, model, config)

    timed_steps = max(0, clock.steps - clock.warmup_steps)
    tokens_per_step = tokens_per_micro * grad_accum
    tok_per_s = timed_steps * tokens_per_step / clock.training_seconds if clock.training_seconds > 0 else None
    mfu = _mfu(flops_tok * tok_per_s, device) if tok_per_s else None
    result = {
        "val_bpb": val_bpb,
        "training_seconds": clock.training_seconds,
        "total_seconds": time.perf_counter() - t_start,
        "compile_seconds": clock.compile_seconds,
        "eval_seconds": eval_seconds,
        "peak_memory_mb": peak_memory_mb(device),
        "mfu_percent": mfu,
        "total_tokens": clock.steps * tokens_per_step,
        "num_steps": clock.steps,
        "num_params": num_params,
        "tokens_per_second": tok_per_s,
        "ms_per_step": 1000 * clock.training_seconds / timed_steps if timed_steps else None,
        "flops_per_token": flops_tok,  # model FLOPs: causal attention, no embedding lookups
        "executed_flops_per_token": executed_tok,  # + masked attention the kernel computes, + Muon
        "model_tflops": flops_tok * tok_per_s / 1e12 if tok_per_s else None,  # achieved, per second
        "executed_tflops": executed_tok * tok_per_s / 1e12 if tok_per_s else None,
        "hfu_percent": _mfu(executed_tok * tok_per_s, device) if tok_per_s else None,  # executed / peak
        "attention_kernel": kernel or "sdpa default",
        "compiled": compiled,  # False after a failed torch.compile (the run went on eager)
        "depth": DEPTH,
        "model_dim": MODEL_DIM,
        "batch_tokens": tokens_per_step,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "data_fingerprint": ds.fingerprint,
        "harness_fingerprint": H.harness_fingerprint(),
        "seed": spec.seed,
        "curve": curve,
    }
    H.finish(spec, result)


def is_compile_error(exc):
    """Whether `exc` comes from torch.compile (dynamo, inductor, a missing compiler or Triton)."""
    from torch._dynamo.exc import TorchDynamoException

    return isinstance(exc, TorchDynamoException) or type(exc).__module__.startswith(("torch._dynamo", "torch._inductor"))


def _first_line(exc):
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


def _mfu(flops_per_second, device):
    """FLOPs utilisation in percent of the GPU's dense bf16 peak (harness table); None when unknown."""
    if device.type != "cuda":
        return None
    peak = H.gpu_peak_flops(torch.cuda.get_device_name(device))
    return 100 * flops_per_second / peak if peak else None


if __name__ == "__main__":
    try:
        main()
    except H.HarnessError as exc:
        print(f"ERROR: {exc}", flush=True)
        sys.exit(2)
