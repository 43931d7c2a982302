"""The MoE router (docs/design.md §2), in fp32, after DeepSeek-V3's gate.

scores = softmax|sigmoid(x · Wgᵀ) [T, E]; the selection adds a per-expert bias (aux-loss-free
balancing: the bias only steers which experts are picked, never the weights), optionally first
keeps the best `topk_groups` of `n_groups` expert groups per token (group-limited routing; with
one group per node it is DeepSeek-V3's node-limited routing), then takes the top-k. The weights
are the unbiased scores of the picked experts (normalized to sum 1 for sigmoid scores), times
`route_scale`.

Aux-loss-free balancing: `update_bias(load_E)` (called by the training loop after the optimizer
step, outside the optimizer) moves each expert's bias by `bias_update_rate` towards the mean
load: up when underloaded, down when overloaded. The optional sequence-wise auxiliary loss is
DeepSeek-V3's L_bal = alpha * sum_i f_i * P_i per sequence, averaged over sequences, returned
from forward (no hidden state).
"""

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moefp8.kernels import device_index
from moefp8.kernels.route import route_select


class RouterOutput(NamedTuple):
    topk_idx_TK: Tensor  # int64 [T, K] expert ids
    topk_w_TK: Tensor  # fp32 [T, K] routing weights (differentiable)
    aux_loss: Tensor | None  # scalar, when seq_aux_alpha > 0
    load_E: Tensor  # int64 [E] tokens routed to each expert this call (no grad)


class Router(nn.Module):
    def __init__(self, hidden: int, n_experts: int, topk: int, score_func: str = "sigmoid", n_groups: int = 1,
                 topk_groups: int = 1, route_scale: float = 1.0, bias_update_rate: float = 1e-3,
                 seq_aux_alpha: float = 0.0, force_balance: bool = False):
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"router: score_func={score_func!r}, expected 'softmax' or 'sigmoid'")
        if not 1 <= topk <= n_experts:
            raise ValueError(f"router: topk={topk} must be between 1 and the number of experts ({n_experts})")
        if n_groups < 1 or n_experts % n_groups:
            raise ValueError(f"router: n_groups={n_groups} does not divide n_experts={n_experts}")
        if not 1 <= topk_groups <= n_groups:
            raise ValueError(f"router: topk_groups={topk_groups} must be between 1 and n_groups={n_groups}")
        if topk > topk_groups * (n_experts // n_groups):
            raise ValueError(f"router: topk={topk} experts cannot come from topk_groups={topk_groups} groups of "
                             f"{n_experts // n_groups} experts")
        self.n_experts, self.topk, self.score_func = n_experts, topk, score_func
        self.n_groups, self.topk_groups, self.route_scale = n_groups, topk_groups, route_scale
        self.bias_update_rate, self.seq_aux_alpha = bias_update_rate, seq_aux_alpha
        self.force_balance = force_balance  # benchmarks: random logits (model.force_balanced_routing)
        self.weight = nn.Parameter(torch.empty(n_experts, hidden, dtype=torch.float32))
        nn.init.normal_(self.weight, std=hidden**-0.5)
        self.register_buffer("bias", torch.zeros(n_experts, dtype=torch.float32))  # selection only

    def forward(self, x_TH: Tensor, seq_len: int | None = None) -> RouterOutput:
        """x [T, H] (any float dtype; computed in fp32, fp64 if x is fp64). seq_len: tokens per
        sequence, for the sequence-wise auxiliary loss (default: all T tokens are one sequence)."""
        dt = torch.float64 if x_TH.dtype == torch.float64 else torch.float32
        logits = _Logits.apply(x_TH, self.weight, dt)
        if self.force_balance:  # standard normal logits in value; the gradient still reaches the router's GEMM
            logits = logits + (torch.randn_like(logits) - logits).detach()
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        idx, load = route_select(scores.detach(), self.bias.to(dt), self.topk, self.n_groups, self.topk_groups)
        w = scores.gather(1, idx)
        if self.score_func == "sigmoid":
            w = w / w.sum(-1, keepdim=True)
        w = w * self.route_scale
        aux = None
        if self.seq_aux_alpha > 0:
            aux = seq_aux_loss(scores, idx, self.n_experts, self.topk, seq_len or x_TH.shape[0]) * self.seq_aux_alpha
        return RouterOutput(idx, w.float() if dt == torch.float32 else w, aux, load)

    @torch.no_grad()
    def update_bias(self, load_E: Tensor) -> None:
        """Aux-loss-free balancing step from the load summed over the step (all micro-batches and,
        when experts are sharded, all ranks): bias += rate * sign(mean - load)."""
        load = load_E.to(self.bias.device, torch.float32)
        self.bias += self.bias_update_rate * torch.sign(load.mean() - load)


class _Logits(torch.autograd.Function):
    """x · Wᵀ computed in fp32 (or fp64) that saves x as it came (bf16), not its fp32 copy.

    On a GPU with BF16 x and fp32 W the three products run on BF16 tensor cores with fp32
    accumulation (`logits_bf16x3`), at fp32-GEMM accuracy: cuBLAS's fp32 GEMMs run on the CUDA cores
    (~20 TFLOP/s) and x's fp32 copy costs a pass each way."""

    @staticmethod
    def forward(ctx, x, w, dt):
        ctx.dt = dt
        if _bf16x3_applies(x, w, dt):
            w3 = bf16x3(w, 0)
            ctx.save_for_backward(x, w, w3)
            return logits_bf16x3(x, w3)
        ctx.save_for_backward(x, w, None)
        return F.linear(x.to(dt), w.to(dt))

    @staticmethod
    def backward(ctx, g):
        x, w, w3 = ctx.saved_tensors
        if w3 is not None:
            return *logits_backward_bf16x3(g, x, w3, ctx.needs_input_grad[0], ctx.needs_input_grad[1]), None
        dx = (g @ w.to(ctx.dt)).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = (g.t() @ x.to(ctx.dt)).to(w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


# ----------------------------------------------------------------------------------------------
# The router's GEMMs on BF16 tensor cores at fp32 accuracy. An fp32 value v splits exactly into
# three BF16 parts, v = v1 + v2 + v3 (8 significant bits each, RNE: v1 = bf16(v), v2 = bf16(v - v1),
# v3 = v - v1 - v2, which has <= 8 bits left); x is BF16 already, so every product x · v_i is exact
# in the fp32 accumulator and x · W = sum_i x · W_i is an fp32 GEMM up to the order of its
# additions. One cuBLAS call per product: the parts stacked along N (forward), M (dW) or K (dx).


def bf16x3(v: Tensor, dim: int) -> Tensor:
    """fp32 v (2-D) -> its three BF16 parts concatenated along `dim` (v1 | v2 | v3, sum exactly v for
    finite v above ~1e-36: fp32 and BF16 share the exponent range). Five kernels, written in place."""
    a, b = v.shape
    out = torch.empty((3, a, b) if dim == 0 else (a, 3, b), dtype=torch.bfloat16, device=v.device)
    part = out.unbind(0 if dim == 0 else 1)
    part[0].copy_(v)  # RNE
    r = v - part[0]  # exact (fp32)
    part[1].copy_(r)
    r.sub_(part[1])  # exact: what is left has <= 8 significant bits
    part[2].copy_(r)
    return out.view(3 * a, b) if dim == 0 else out.view(a, 3 * b)


def _mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """BF16 a · b with the fp32 accumulator as the output (no BF16 rounding of the result); on the
    CPU (tests) an fp32 matmul of the same exact products."""
    return torch.mm(a, b, out_dtype=torch.float32) if a.is_cuda else a.float() @ b.float()


@functools.cache
def _has_mm_out_dtype(index: int) -> bool:
    """torch.mm(..., out_dtype=fp32) for BF16 inputs on this GPU (torch >= 2.8 on CUDA)."""
    try:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device=f"cuda:{index}")
        return _mm_f32(a, a).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False


def _bf16x3_applies(x: Tensor, w: Tensor, dt) -> bool:
    return (x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.float32 and dt == torch.float32
            and _has_mm_out_dtype(device_index(x.device)))


def logits_bf16x3(x_TH: Tensor, w3: Tensor) -> Tensor:
    """x [T, H] bf16 · Wᵀ -> [T, E] fp32, W given as its parts w3 = bf16x3(W [E, H], 0) (one GEMM
    of N = 3E, then the parts' sum)."""
    return _mm_f32(x_TH, w3.t()).view(x_TH.shape[0], 3, w3.shape[0] // 3).sum(1)  # (E named: T may be 0)


def logits_backward_bf16x3(g_TE: Tensor, x_TH: Tensor, w3: Tensor, want_dx: bool, want_dw: bool):
    """-> (dx [T, H] bf16 = g · W, dW [E, H] fp32 = gᵀ · x), W as its parts w3 [3E, H]. dW: exact
    products (g in three parts, x BF16). dx drops the parts' cross terms below 2^-16 of the
    result (g1·W3, g2·W2, g2·W3, g3·W*), far under its BF16 rounding: A = [g1 | g2 | g1],
    B = [W1; W1; W2]."""
    E = w3.shape[0] // 3
    g3 = bf16x3(g_TE.float().contiguous(), 1)  # [T, 3E]
    dx = dw = None
    if want_dw:
        dw = _mm_f32(g3.t(), x_TH).view(3, E, -1).sum(0)
    if want_dx:
        dx = torch.mm(torch.cat([g3[:, :2 * E], g3[:, :E]], 1), torch.cat([w3[:E], w3[:2 * E]], 0))
    return dx, dw


def seq_aux_loss(scores_TE: Tensor, idx_TK: Tensor, n_experts: int, topk: int, seq_len: int) -> Tensor:
    """DeepSeek-V3's sequence-wise balance loss (without alpha): mean over sequences of
    sum_i f_i * P_i, f_i = E / (K * S) * #tokens of the sequence routed to i,
    P_i = mean over the sequence of the normalized scores s_i / sum_j s_j."""
    T = scores_TE.shape[0]
    if T % seq_len:
        raise ValueError(f"seq_aux_loss: {T} tokens are not a whole number of sequences of {seq_len}")
    B = T // seq_len
    if B == 0:  # no sequence (a rank that holds no token): nothing to balance, and no mean of nothing (NaN)
        return scores_TE.sum() * 0.0
    s = scores_TE / scores_TE.sum(-1, keepdim=True)
    p = s.view(B, seq_len, n_experts).mean(1)  # [B, E]
    hits = torch.zeros(B, n_experts, dtype=scores_TE.dtype, device=scores_TE.device)
    hits.scatter_add_(1, idx_TK.view(B, seq_len * topk), torch.ones_like(idx_TK, dtype=scores_TE.dtype).view(B, -1))
    f = hits * n_experts / (topk * seq_len)
    return (f * p).sum(-1).mean()


def load_stats(load_E: Tensor) -> dict:
    """Tokens per expert -> logging figures: max/mean imbalance, min, max, experts with no token."""
    load = load_E.float()
    mean = float(load.mean()) if load.numel() else 0.0
    return {"load_max_over_mean": float(load.max()) / mean if mean > 0 else 0.0,
            "load_min": int(load.min()) if load.numel() else 0, "load_max": int(load.max()) if load.numel() else 0,
            "experts_empty": int((load == 0).sum())}
