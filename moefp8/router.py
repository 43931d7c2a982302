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

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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
    """x · Wᵀ computed in fp32 (or fp64) that saves x as it came (bf16), not its fp32 copy."""

    @staticmethod
    def forward(ctx, x, w, dt):
        ctx.save_for_backward(x, w)
        ctx.dt = dt
        return F.linear(x.to(dt), w.to(dt))

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        dx = (g @ w.to(ctx.dt)).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = (g.t() @ x.to(ctx.dt)).to(w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def seq_aux_loss(scores_TE: Tensor, idx_TK: Tensor, n_experts: int, topk: int, seq_len: int) -> Tensor:
    """DeepSeek-V3's sequence-wise balance loss (without alpha): mean over sequences of
    sum_i f_i * P_i, f_i = E / (K * S) * #tokens of the sequence routed to i,
    P_i = mean over the sequence of the normalized scores s_i / sum_j s_j."""
    T = scores_TE.shape[0]
    if T % seq_len:
        raise ValueError(f"seq_aux_loss: {T} tokens are not a whole number of sequences of {seq_len}")
    B = T // seq_len
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
