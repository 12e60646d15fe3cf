"""autoloop train.py: single-file, single-device, fixed-budget GPT pretraining.

This file is the experiment. The research loop edits it (the constants below, or any
code), trains it for a fixed budget, and keeps the edit only if val_bpb improves.

    python train.py                                  # harness default budget (300 s)
    AUTOLOOP_TIME_BUDGET=30 python train.py          # a 30-second run
    AUTOLOOP_MAX_STEPS=50 AUTOLOOP_SEED=1 python train.py   # step mode (deterministic on a CPU)

Every AUTOLOOP_* variable is optional (docs/architecture.md, "Contracts"). Data, tokenizer,
evaluation (val_bpb), the clock, and the infrastructure around the model (attention kernel
timing, FLOP counts and MFU, the torch.compile fallback) are the fixed harness's
(autoloop.harness), so no edit here can change how a trial is scored or measured.

On CUDA it trains a ~25M-parameter model (autoresearch's scale) compiled, in bf16; on a
CPU a tiny one in fp32, eager ("Device and scale"). Before the first batch, model and Muon
are warmed up on random tokens and put back (torch.compile compiles there; a compiler that
fails means an eager run and one WARNING line). Step mode repeats bit for bit on a CPU.

Importable names (the harness, `autoloop check` and tests rely on them): build_model,
model_config, GPT, muon_orthogonalize, muon_update, Muon, AdamW, build_optimizers,
make_train_step, prepare_training, softcapped_cross_entropy, lr_multiplier,
weight_decay_at, muon_momentum_at. Training runs only under __main__.
"""

import gc
import math
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
VOCAB_PAD_MULTIPLE = 64  # embedding and lm_head rows padded to a multiple of this (tensor-core shapes)
# SDPA kernel: "flash" | "cudnn" | "efficient" | "math" | "auto". A named kernel that cannot
# run these shapes is an error, never a silent fall back to math; "auto" times the usable
# ones for the model's shapes on CUDA and leaves flash only for one clearly faster.
ATTENTION_BACKEND = "auto"
ATTENTION_AUTO_MARGIN = 0.05  # "auto" picks another kernel than flash only if it is this much faster; speed

# Batch
TOTAL_BATCH_TOKENS = 2**19  # tokens per optimizer step (all micro-steps together)
DEVICE_BATCH_SIZE = 64  # sequences per forward/backward (micro-step); lower it on OOM (`autoloop check` suggests one)
EVAL_BATCH_SIZE = 32  # sequences per forward in the final evaluation
LOSS_CHUNK_BYTES = 2**30  # fp32 logits per chunk of the training loss (its working memory is ~4x): bounds it at large vocabularies; speed

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
# The one place where the device changes the run. Each derived switch is one line `NAME =
# <expression>`, so a test can force the CUDA code path on a CPU (tests/test_train.py does).
# ---------------------------------------------------------------------------

DEVICE_TYPE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE_TYPE == "cpu":
    # A CPU run shows the mechanism (the README's demo, the tests), so a step is cheap: at 120
    # steps on 2 cores, val_bpb 2.98 in 10 s (width 128, 2 heads, 2x the batch: 2.72 in 45 s).
    DEPTH = 2
    MODEL_DIM = 64
    N_HEAD = 1  # head_dim 64
    N_KV_HEAD = 1
    TOTAL_BATCH_TOKENS = 8 * 256  # 8 sequences of the harness's CPU context (256)
    DEVICE_BATCH_SIZE = 8  # one micro-step per optimizer step
    EVAL_BATCH_SIZE = 16
    MUON_MOMENTUM_WARMUP_STEPS = 50  # a CPU run has only a few hundred steps

COMPILE = DEVICE_TYPE == "cuda"  # torch.compile the model and Muon's step
AUTOCAST_DTYPE = torch.bfloat16 if DEVICE_TYPE == "cuda" else None  # None: plain fp32
# Token embedding table and rotary tables; the residual stream and every matmul follow the
# embedding's dtype (Linear casts its fp32 master weight), as in autoresearch and nanochat.
EMBEDDING_DTYPE = torch.bfloat16 if DEVICE_TYPE == "cuda" else torch.float32
INIT_ON_META = DEVICE_TYPE == "cuda"  # build on the meta device, then allocate on the target
MUON_DTYPE = torch.bfloat16 if DEVICE_TYPE == "cuda" else torch.float32  # Polar Express dtype

# ---------------------------------------------------------------------------
# ---- Model ----
# GPT: token embedding -> RMSNorm -> DEPTH x [attention, MLP] (pre-norm, parameter-free
# RMSNorm) -> RMSNorm -> untied lm_head -> soft-capped logits. Attention uses rotary
# position embeddings and RMSNorm on queries and keys (QK-norm); the MLP is ReLU^2.
# Output projections start at zero, so every block starts as the identity. The
# vocabulary is padded to a multiple of VOCAB_PAD_MULTIPLE rows; logits and the loss
# cover the real vocabulary only.
# ---------------------------------------------------------------------------


def model_config(vocab_size=None, seq_len=None):
    """The architecture as a plain dict (stored in the checkpoint; build_model reads it)."""
    return {"vocab_size": int(vocab_size or H.ByteTokenizer.vocab_size), "seq_len": int(seq_len or H.seq_len(DEVICE_TYPE)),
            "n_layer": DEPTH, "n_embd": MODEL_DIM, "n_head": N_HEAD, "n_kv_head": N_KV_HEAD, "mlp_ratio": MLP_RATIO,
            "rope_base": ROPE_BASE, "logit_softcap": LOGIT_SOFTCAP, "vocab_pad_to": VOCAB_PAD_MULTIPLE}


def padded_vocab(cfg):
    multiple = max(1, int(cfg.get("vocab_pad_to", 1)))
    return -(-cfg["vocab_size"] // multiple) * multiple


def norm(x):
    # Back to x's dtype: autocast may run rms_norm in fp32, which would promote q/k and the stream.
    return F.rms_norm(x, (x.size(-1),)).to(x.dtype)


def apply_rotary(x, cos, sin):
    # x: (B, H, T, D); rotate the two halves of each head as complex pairs.
    d = x.size(-1) // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


class Linear(nn.Linear):
    """nn.Linear whose fp32 master weight is cast to the input's dtype: bf16 activations give
    bf16 matmuls with or without autocast (the optimizers still update fp32 weights)."""

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head = cfg["n_head"], cfg["n_kv_head"]
        self.head_dim = cfg["n_embd"] // cfg["n_head"]
        assert cfg["n_embd"] % cfg["n_head"] == 0 and cfg["n_head"] % cfg["n_kv_head"] == 0
        self.c_q = Linear(cfg["n_embd"], self.n_head * self.head_dim, bias=False)
        self.c_k = Linear(cfg["n_embd"], self.n_kv_head * self.head_dim, bias=False)
        self.c_v = Linear(cfg["n_embd"], self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = Linear(self.n_head * self.head_dim, cfg["n_embd"], bias=False)
        # The SDPA kernel is pinned here, inside forward, so torch.compile traces the pin:
        # the kernel is part of the compiled graph (and of its cache key), and a shared
        # compile cache never hands one trial the kernel another one compiled. None: SDPA chooses.
        self.kernel = None

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = norm(apply_rotary(q, cos, sin)), norm(apply_rotary(k, cos, sin))
        with H.attention_kernel(self.kernel):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hidden = cfg["mlp_ratio"] * cfg["n_embd"]
        self.c_fc = Linear(cfg["n_embd"], hidden, bias=False)
        self.c_proj = Linear(hidden, cfg["n_embd"], bias=False)

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
        rows = padded_vocab(cfg)
        self.wte = nn.Embedding(rows, cfg["n_embd"])
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg["n_layer"])])
        self.lm_head = Linear(cfg["n_embd"], rows, bias=False)
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

    def set_attention_kernel(self, name):
        """Pin every attention layer's SDPA call to kernel `name` (None: SDPA's own choice)."""
        H.check_kernel_name(name)
        for module in self.modules():
            if isinstance(module, CausalSelfAttention):
                module.kernel = name

    def forward(self, idx, targets=None):
        """Logits (B, T, vocab) in fp32, real vocabulary only; with targets, the mean cross-entropy instead."""
        T = idx.size(1)
        assert T <= self.cos.size(2), f"sequence of {T} tokens is longer than the rotary table ({self.cos.size(2)})"
        cos, sin = self.cos[:, :, :T], self.sin[:, :, :T]
        x = norm(self.wte(idx))
        for block in self.blocks:
            x = block(x, cos, sin)
        x = norm(x)
        vocab, cap = self.config["vocab_size"], self.config["logit_softcap"]
        if targets is None:
            logits = self.lm_head(x)[..., :vocab].float()  # the padding rows are never a prediction
            return cap * torch.tanh(logits / cap)
        return softcapped_cross_entropy(x.flatten(0, 1), self.lm_head.weight, targets.reshape(-1), cap, vocab)


def softcapped_cross_entropy(x, weight, targets, cap, vocab=None, chunk_bytes=None):
    """Mean cross-entropy of the soft-capped logits cap * tanh(x @ weight.T / cap) against targets.

    x: (N, d) hidden states; weight: (V_padded, d), the lm_head; rows past `vocab` are
    padding, sliced off before the softmax. All N rows' fp32 logits take N x vocab x 4 bytes
    (17 GB at a 32k vocabulary and 131k tokens per micro-step), so above `chunk_bytes`
    (LOSS_CHUNK_BYTES) they go through in chunks, each chunk's gradient computed on the
    spot; below it (the byte vocabulary) the plain path, which torch.compile fuses best.
    """
    vocab = weight.size(0) if vocab is None else vocab
    chunk_bytes = LOSS_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    rows = max(1, int(chunk_bytes) // (4 * vocab))
    if x.size(0) <= rows:
        logits = F.linear(x, weight.to(x.dtype))[:, :vocab].float()
        logits = cap * torch.tanh(logits / cap)
        return F.cross_entropy(logits, targets)
    return _ChunkedSoftcapCrossEntropy.apply(x, weight, targets, cap, vocab, rows)


class _ChunkedSoftcapCrossEntropy(torch.autograd.Function):
    """The loss and its gradients chunk by chunk in forward; backward only scales them.

    d loss / d raw logit = (softmax - onehot) / N * (1 - tanh^2); zero for the padding
    columns. Kept for backward: dx (N x d) and dW (V_padded x d, fp32), never N x V.
    """

    @staticmethod
    def forward(ctx, x, weight, targets, cap, vocab, rows):
        n = x.size(0)
        w = weight.to(x.dtype)
        want_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        dx = torch.empty_like(x) if want_grad else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if want_grad else None
        for start in range(0, n, rows):
            # In place wherever it can be: a chunk needs ~4 chunk-sized fp32 buffers (logsumexp's included).
            xc, yc = x[start:start + rows], targets[start:start + rows]
            t = F.linear(xc, w)[:, :vocab].float().div_(cap).tanh_()
            logits = t * cap
            lse = torch.logsumexp(logits, dim=-1)
            total = total + (lse - logits.gather(1, yc[:, None]).squeeze(1)).sum()
            if want_grad:
                g = logits.sub_(lse[:, None]).exp_()  # softmax
                g.scatter_add_(1, yc[:, None], torch.full_like(g[:, :1], -1.0))
                g.mul_(t.square_().neg_().add_(1)).div_(n)  # x (1 - tanh^2), the mean
                g = F.pad(g, (0, weight.size(0) - vocab)).to(x.dtype)
                dx[start:start + rows] = g @ w
                dw += (g.t() @ xc).float()
        if want_grad:
            ctx.save_for_backward(dx, dw)
        ctx.weight_dtype = weight.dtype
        return total / n

    @staticmethod
    def backward(ctx, grad):
        dx, dw = ctx.saved_tensors
        return dx * grad.to(dx.dtype), (dw * grad).to(ctx.weight_dtype), None, None, None, None


def build_model(config=None, device="cpu"):
    """The model for `config` (None: model_config()), initialised, on `device`. The harness
    rebuilds a trained model with it from a checkpoint's config, then loads the weights."""
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
    if EMBEDDING_DTYPE != torch.float32:
        # bf16 embedding rows and rotary tables: the residual stream starts (and stays) bf16.
        model.wte.to(dtype=EMBEDDING_DTYPE)
        model.cos, model.sin = model.cos.to(EMBEDDING_DTYPE), model.sin.to(EMBEDDING_DTYPE)
    return model


# ---------------------------------------------------------------------------
# ---- Optimizer ----
# Muon (MomentUm Orthogonalized by Newton-Schulz; here Polar Express) for the blocks' 2-D
# weights: the Nesterov-momentum update is replaced by the nearest semi-orthogonal matrix, so
# every direction moves at the same rate. AdamW for the embedding, lm_head and the rest.
# ---------------------------------------------------------------------------

# Polar Express (Amsel et al. 2025, arXiv:2505.16932) coefficients, as in modded-nanogpt and
# nanochat: each step the optimal odd polynomial for the current singular value interval, so
# five bring all singular values close to 1 (plain Newton-Schulz needs more).
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def muon_orthogonalize(G, steps=MUON_NS_STEPS, dtype=None):
    """Approximate U V^T of G = U S V^T (singular values pushed to ~1); batched over leading dims.
    Computed and returned in `dtype` (MUON_DTYPE by default: bf16 on CUDA, fp32 on a CPU)."""
    assert G.ndim >= 2 and steps <= len(POLAR_EXPRESS_COEFFS)
    X = G.to(dtype or MUON_DTYPE)
    # Scale so the largest singular value is below 1 (the Frobenius norm bounds it); the
    # 2% margin is Polar Express's safety factor for low-precision arithmetic.
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
    # Iterate on the smaller Gram matrix: X^T X for a tall X (X <- a X + X (b A + c A^2)),
    # the same polynomial. Written without transposing a tall X (X.mT ... X.mT, as
    # nanochat does): torch 2.13's CPU inductor compiled that in bf16, fed Muon's 0-D
    # hyperparameter tensors, to NaN on every call (tests/test_train.py).
    tall = G.size(-2) > G.size(-1)
    for a, b, c in POLAR_EXPRESS_COEFFS[:steps]:
        A = X.mT @ X if tall else X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + (X @ B if tall else B @ X)
    return X


def muon_update(params, grads, momentum_buffer, momentum, lr, decay):
    """One Muon step for a group of same-shape matrices, in place. grads (K, rows, cols) stacked;
    momentum, lr (shape-scaled) and decay (1 - lr x weight decay) are floats eagerly and 0-D
    tensors compiled: a tensor's value is data to compiled code, so the schedule never recompiles it."""
    momentum_buffer.lerp_(grads, 1 - momentum)
    update = muon_orthogonalize(grads.lerp_(momentum_buffer, momentum))  # Nesterov: look ahead
    for p, u in zip(params, update.unbind(0)):
        p.mul_(decay).sub_(lr * u.to(p.dtype))


class Muon:
    """Muon with Nesterov momentum and Polar Express, for groups of same-shape 2-D parameters.

    Parameters of one shape are stacked and orthogonalised in one batched call. The LR is
    scaled by max(1, rows/cols)**0.5 so tall matrices (the MLP up-projection) get updates of
    the same RMS per element as square ones. Weight decay is decoupled (p *= 1 - lr*wd). With
    compiled=True each group's step is one compiled graph (a few kernels, not ~150), fed 0-D tensors.
    """

    def __init__(self, params, lr, momentum=MUON_MOMENTUM, weight_decay=0.0, compiled=False):
        params = list(params)
        self.param_groups = [{"params": [p for p in params if tuple(p.shape) == shape], "name": "matrix {}x{}".format(*shape),
                              "lr": lr, "momentum": momentum, "weight_decay": weight_decay}
                             for shape in sorted({tuple(p.shape) for p in params})]
        self.state, self.compiled = {}, compiled
        # fullgraph: a graph break here would silently bring the launches back.
        self._update = torch.compile(muon_update, dynamic=False, fullgraph=True) if compiled else muon_update
        # CPU 0-D tensors (as autoresearch): read by the compiled code as scalars, no copy to the GPU.
        self._hyper = [torch.zeros((), dtype=torch.float32) for _ in range(3)]

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            params = group["params"]
            if all(p.grad is None for p in params):
                continue
            grads = torch.stack([torch.zeros_like(p) if p.grad is None else p.grad for p in params])  # (K, rows, cols)
            state = self.state.setdefault(params[0], {})  # one stacked buffer per group, on its first parameter
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grads)
            rows, cols = params[0].shape
            lr = group["lr"] * max(1.0, rows / cols) ** 0.5
            hyper = (group["momentum"], lr, 1 - group["lr"] * group["weight_decay"])
            if self.compiled:
                for tensor, value in zip(self._hyper, hyper):
                    tensor.fill_(value)
                hyper = self._hyper
            self._update(params, grads, state["momentum_buffer"], *hyper)


class AdamW:
    """AdamW as torch.optim.AdamW computes it. Like Muon, not a torch.optim.Optimizer: those
    import torch._dynamo on first use, 1.6 s of CPU an eager run would pay for nothing."""

    def __init__(self, groups, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=0.0):
        self.param_groups = [{"weight_decay": weight_decay, **group} for group in groups]
        self.betas, self.eps, self.state = betas, eps, {}

    @torch.no_grad()
    def step(self):
        beta1, beta2 = self.betas
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                if p not in self.state:  # moments and math in fp32 whatever p's dtype (bf16 embeddings on CUDA)
                    self.state[p] = {"step": 0, **{k: torch.zeros_like(p, dtype=torch.float32) for k in ("exp_avg", "exp_avg_sq")}}
                state = self.state[p]
                state["step"] = t = state["step"] + 1
                m, v, w, g = state["exp_avg"], state["exp_avg_sq"], p.float(), p.grad.float()  # w is p when p is fp32
                w.mul_(1 - group["lr"] * group["weight_decay"])
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                w.addcdiv_(m, (v.sqrt() / (1 - beta2**t) ** 0.5).add_(self.eps), value=-group["lr"] / (1 - beta1**t))
                if w is not p:
                    p.copy_(w)


def build_optimizers(model, compiled=False):
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
    adamw = AdamW(adam_groups, betas=ADAM_BETAS, eps=ADAM_EPS)
    muon = Muon(matrices, lr=MATRIX_LR, momentum=MUON_MOMENTUM_START, weight_decay=WEIGHT_DECAY, compiled=compiled)
    optimizers = [muon, adamw]
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers


def make_train_step(model, optimizers, batches, *, grad_accum=1, train_model=None, kernel=None):
    """One optimizer step as a function: `train_step() -> (mean loss, grad norm)`, floats.

    `batches` yields (inputs, targets), each drawn right after a backward (on CUDA its copy
    overlaps the GPU's work). The forward runs through `train_model` (the compiled module;
    `model` by default); `kernel` pins the model's SDPA kernel. The caller sets the LRs."""
    train_model = model if train_model is None else train_model
    if kernel is not None:
        model.set_attention_kernel(kernel)
    device = next(model.parameters()).device
    autocast = torch.autocast(device.type, dtype=AUTOCAST_DTYPE, enabled=AUTOCAST_DTYPE is not None)
    x, y = next(batches)

    def train_step():
        nonlocal x, y
        loss_sum = torch.zeros((), device=device)
        for _ in range(grad_accum):
            with autocast:
                loss = train_model(x, y)
            loss_sum += loss.detach()
            (loss / grad_accum).backward()  # mean over micro-steps
            x, y = next(batches)  # fetch the next batch while the GPU works
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        # One multi-tensor kernel for all the norms, not one launch per parameter.
        grad_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        return loss_sum.item() / grad_accum, grad_norm.item()  # .item() waits for the step to finish

    return train_step


def prepare_training(config, device, *, seed, batch_size=None, kernel=None, compile_model=None, log=print):
    """Model, optimizers and the module to train through (compiled where compile_model, by
    default COMPILE, says), warmed up: the harness's compile_or_eager dict."""
    compile_model = COMPILE if compile_model is None else compile_model

    def setup(compiled):
        # Seeded, so starting over eager builds exactly the model an eager run builds.
        torch.manual_seed(seed)
        model = build_model(config, device=device)
        model.set_attention_kernel(kernel)
        # dynamic=False: shapes never change in training, and static shapes compile to
        # the fastest kernels. The uncompiled `model` is kept for evaluation and saving.
        train_model = torch.compile(model, dynamic=False) if compiled else model
        return model, build_optimizers(model, compiled=compiled), train_model

    return H.compile_or_eager(setup, make_train_step, compile_model=compile_model,
                              batch_size=batch_size or DEVICE_BATCH_SIZE, log=log)


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


def main():
    t_start = time.perf_counter()
    spec = H.RunSpec.from_env()
    device = torch.device(DEVICE_TYPE)
    torch.manual_seed(spec.seed)
    np.random.seed(spec.seed % 2**32)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # fp32 matmuls outside autocast may use TF32
    if COMPILE:
        H.configure_compile_cache(spec)

    ds = H.load_dataset(spec.data_dir)
    seq_len = H.seq_len(device.type)
    tokens_per_micro = DEVICE_BATCH_SIZE * seq_len
    if TOTAL_BATCH_TOKENS % tokens_per_micro:
        raise H.HarnessError(f"TOTAL_BATCH_TOKENS={TOTAL_BATCH_TOKENS} is not a multiple of DEVICE_BATCH_SIZE*seq_len="
                             f"{tokens_per_micro}: edit the constants so it is")
    grad_accum = TOTAL_BATCH_TOKENS // tokens_per_micro

    config = model_config(vocab_size=ds.vocab_size, seq_len=seq_len)
    kernel = H.choose_attention_kernel(config, DEVICE_BATCH_SIZE, device, EMBEDDING_DTYPE, ATTENTION_BACKEND,
                                       ATTENTION_AUTO_MARGIN)
    tokens_per_step = tokens_per_micro * grad_accum

    # Compile (or find it does not work) on random tokens, before the data feed serves a batch.
    training = prepare_training(config, device, seed=spec.seed, kernel=kernel)
    model, optimizers, compiled = training["model"], training["optimizers"], training["compiled"]
    muon = optimizers[0]
    loader = H.TokenLoader(ds, "train", DEVICE_BATCH_SIZE, seq_len, device, seed=spec.seed)
    train_step = make_train_step(model, optimizers, loader, grad_accum=grad_accum, train_model=training["train_model"])
    num_params = sum(p.numel() for p in model.parameters())
    utilisation = H.Utilisation(model, device, kernel=training["kernel_ran"], muon=muon, ns_steps=MUON_NS_STEPS,
                                tokens_per_step=tokens_per_step)
    clock = H.TrainingClock(spec)
    progress_log = H.ProgressWriter(spec.progress_path)

    budget = f"{spec.max_steps} steps" if spec.max_steps else f"{spec.time_budget:g} s"
    print(f"device: {device.type} | params: {num_params:,} | layers {DEPTH} x width {MODEL_DIM} | seq_len {seq_len}")
    print(f"batch: {TOTAL_BATCH_TOKENS:,} tokens/step = {grad_accum} x {DEVICE_BATCH_SIZE} x {seq_len} | "
          f"budget: {budget} | compile: {compiled} | dtype: {EMBEDDING_DTYPE} | attention: {kernel or 'sdpa default'} "
          f"(ran {training['kernel_ran']}) | warm-up {training['warmup_seconds']:.1f} s | seed {spec.seed}", flush=True)

    curve = H.LossCurve(CURVE_POINTS)
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
        train_loss, grad_norm = train_step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        clock.step_finished(dt)

        if math.isnan(train_loss):
            fail("loss is nan")
        if train_loss > 100:
            fail(f"loss exploded ({train_loss:.4g} > 100)")

        if step == 0:  # GC pauses cost hundreds of ms at random steps; the loop makes no cycles
            gc.collect()
            gc.freeze()
            gc.disable()

        last = clock.done
        # The early stop is calibrated on the curve's points: where they are denser than LOG_EVERY the worker gets them.
        kept = curve.add(step, clock.training_seconds, train_loss, lr_mult, grad_norm, last)
        if step % LOG_EVERY == 0 or last or (kept and curve.stride < LOG_EVERY):
            tok_per_s = tokens_per_step / dt
            progress_log.step(step, progress, train_loss, lr_mult, grad_norm, clock.training_seconds, dt, tok_per_s,
                              utilisation.figures(tok_per_s)["mfu_percent"], echo=step % LOG_EVERY == 0 or last)
    gc.enable()

    # ---- Evaluation and results ----
    # The checkpoint first: the harness times its writing against the last step, and an evaluation
    # of its own (--no-verify) is not training. The uncompiled model, as the verifier rebuilds it from
    # the checkpoint. Under the controller (AUTOLOOP_EVAL=external) a harness process evaluates the
    # checkpoint: val_bpb stays null here.
    if spec.checkpoint_path is not None:
        H.save_checkpoint(spec.checkpoint_path, model, config)
    t_eval = time.perf_counter()
    val_bpb = None if spec.external_eval else H.evaluate_bpb(model, ds, "val", device=device, batch_size=EVAL_BATCH_SIZE)
    eval_seconds = time.perf_counter() - t_eval
    if spec.external_eval:
        print("val_bpb: n/a (evaluated by the harness from the checkpoint)", flush=True)

    timed_steps = max(0, clock.steps - clock.warmup_steps)
    tok_per_s = timed_steps * tokens_per_step / clock.training_seconds if clock.training_seconds > 0 else None
    result = {
        "val_bpb": val_bpb,
        "training_seconds": clock.training_seconds,
        "total_seconds": time.perf_counter() - t_start,
        "compile_seconds": clock.compile_seconds,
        "eval_seconds": eval_seconds,
        "peak_memory_mb": H.peak_memory_mb(device),
        "total_tokens": clock.steps * tokens_per_step,
        "num_steps": clock.steps,
        "num_params": num_params,
        "tokens_per_second": tok_per_s,
        "ms_per_step": 1000 * clock.training_seconds / timed_steps if timed_steps else None,
        **utilisation.result(tok_per_s),  # FLOPs per token in three conventions, MFU and HFU (harness/flops.py)
        "attention_kernel": kernel or "sdpa default",  # asked for
        **H.compile_result(training),  # compiled or not, the kernel that ran, warm-up seconds, recompiles
        "depth": DEPTH,
        "model_dim": MODEL_DIM,
        "batch_tokens": tokens_per_step,
        "device_batch_size": DEVICE_BATCH_SIZE,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "data_fingerprint": ds.fingerprint,
        "harness_fingerprint": H.harness_fingerprint(),
        "seed": spec.seed,
        "curve": curve.points,
    }
    H.finish(spec, result)


if __name__ == "__main__":
    try:
        main()
    except H.HarnessError as exc:
        print(f"ERROR: {exc}", flush=True)
        sys.exit(2)
