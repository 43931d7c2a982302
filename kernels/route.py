"""The router's expert selection and load count in one launch (moefp8.router): Triton kernel ->
public wrapper -> `_ref` twin.

    idx_TK, load_E = route_select(scores_TE, bias_E, topk, n_groups, topk_groups)

Selection by biased score s + b (DeepSeek-V3's aux-loss-free balancing: the bias steers the choice
only), optionally within the best `topk_groups` of `n_groups` expert groups (a group's score: the
sum of its two best biased scores, or its best where groups hold one expert), then the top-k in
descending biased score; ties go to the lower expert (and group) id, in both twins. load_E: the
tokens routed to each expert (int64, exact). No host sync.

The reference is a dozen small ops (the bias add, a group top-2 and its sum, the group top-k, a
mask, the top-k, the load's scatter-add): ~12 launches per router call and three top-k kernels on a
GPU. The kernel reads the scores once and does it all in registers: a program holds BLOCK_T tokens
x all experts, takes each group's two best by two masked max passes, then the k best by k argmax
passes (each masking the one it took), and counts the picks with integer atomics.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from moefp8.kernels import use_triton
from moefp8.kernels.pack import pairs_per_expert

FLT_MAX = 3.4028234663852886e38  # the largest fp32; -FLT_MAX stands in for a NaN score (see route_select)


@triton.jit
def _route_select_kernel(s_ptr, b_ptr, idx_ptr, load_ptr, T, E, stride_s, K: tl.constexpr, G: tl.constexpr,
                         EG: tl.constexpr, KG: tl.constexpr, E_PAD: tl.constexpr, G_PAD: tl.constexpr,
                         BLOCK_T: tl.constexpr, FLT_MAX: tl.constexpr = FLT_MAX):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    row_ok = rows < T
    col_ok = cols < E
    s = tl.load(s_ptr + rows[:, None] * stride_s + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0)
    s = s + b[None, :]
    s = tl.where(s == s, s, -FLT_MAX)  # NaN: below every score, above -inf (a NaN row still picks K distinct ids)
    s = tl.where(col_ok[None, :], s, float("-inf"))  # the biased scores; padding never picked
    if G > 1:
        gid = cols // EG
        gcols = tl.arange(0, G_PAD)
        gscore = tl.full((BLOCK_T, G_PAD), float("-inf"), tl.float32)
        for g in tl.static_range(G):
            x = tl.where((gid == g)[None, :], s, float("-inf"))
            best = tl.max(x, axis=1)
            if EG > 1:  # plus the second best: the first argmax (lowest id among ties) masked out
                first = tl.argmax(x, axis=1, tie_break_left=True)
                best = best + tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), x), axis=1)
            gscore = tl.where((gcols == g)[None, :], best[:, None], gscore)
        keep = (cols < 0)[None, :] & row_ok[:, None]  # all False, [BLOCK_T, E_PAD]
        for _ in tl.static_range(KG):
            gj = tl.argmax(gscore, axis=1, tie_break_left=True)
            gscore = tl.where(gcols[None, :] == gj[:, None], float("-inf"), gscore)
            keep = keep | (gid[None, :] == gj[:, None])
        s = tl.where(keep, s, float("-inf"))
    ones = tl.full((BLOCK_T,), 1, tl.int64)
    for k in tl.static_range(K):
        e = tl.argmax(s, axis=1, tie_break_left=True)
        tl.store(idx_ptr + rows * K + k, e.to(tl.int64), mask=row_ok)
        tl.atomic_add(load_ptr + e, ones, mask=row_ok, sem="relaxed")
        s = tl.where(cols[None, :] == e[:, None], float("-inf"), s)


def _check(scores_TE: Tensor, bias_E: Tensor, topk: int, n_groups: int, topk_groups: int) -> None:
    if scores_TE.dim() != 2 or bias_E.shape != (scores_TE.shape[1],):
        raise ValueError(f"route_select: scores [T, E] and bias [E], got {tuple(scores_TE.shape)} and "
                         f"{tuple(bias_E.shape)}")
    E = scores_TE.shape[1]
    groups_ok = n_groups >= 1 and E % n_groups == 0 and 1 <= topk_groups <= n_groups
    if not groups_ok or not 1 <= topk <= topk_groups * (E // n_groups):
        raise ValueError(f"route_select: topk={topk} of {E} experts in topk_groups={topk_groups} "
                         f"of n_groups={n_groups}")


def route_select(scores_TE: Tensor, bias_E: Tensor, topk: int, n_groups: int = 1, topk_groups: int = 1,
                 impl: str | None = None) -> tuple[Tensor, Tensor]:
    """scores [T, E] (no grad needed), bias [E] -> (expert ids int64 [T, K] in descending biased score,
    tokens per expert int64 [E]). fp32 scores take the kernel on CUDA tensors; fp64 (tests), the reference.
    A NaN biased score counts as -FLT_MAX (picked last, so ids stay distinct and in range: a diverged
    router still routes, and the loss says it diverged); torch.topk would have picked it first."""
    _check(scores_TE, bias_E, topk, n_groups, topk_groups)
    if not use_triton(scores_TE, impl) or scores_TE.dtype != torch.float32:
        return route_select_ref(scores_TE, bias_E, topk, n_groups, topk_groups)
    T, E = scores_TE.shape
    s = scores_TE if scores_TE.stride(-1) == 1 else scores_TE.contiguous()
    idx = torch.empty(T, topk, dtype=torch.int64, device=s.device)
    load = torch.zeros(E, dtype=torch.int64, device=s.device)
    if T:
        E_PAD = triton.next_power_of_2(E)
        BLOCK_T = max(1, min(64, 4096 // E_PAD))  # ~32 fp32 scores per thread at 4 warps
        _route_select_kernel[(triton.cdiv(T, BLOCK_T),)](
            s, bias_E.float().contiguous(), idx, load, T, E, s.stride(0), K=topk, G=n_groups, EG=E // n_groups,
            KG=topk_groups, E_PAD=E_PAD, G_PAD=triton.next_power_of_2(n_groups), BLOCK_T=BLOCK_T, num_warps=4)
    return idx, load


def route_select_ref(scores_TE: Tensor, bias_E: Tensor, topk: int, n_groups: int = 1,
                     topk_groups: int = 1) -> tuple[Tensor, Tensor]:
    """The same selection in torch ops (any float dtype): stable descending sorts, so ties go to the
    lower id as in the kernel (torch.topk leaves their order open)."""
    _check(scores_TE, bias_E, topk, n_groups, topk_groups)
    s = scores_TE + bias_E
    s = torch.where(s.isnan(), -FLT_MAX, s)
    T, E = s.shape
    if n_groups > 1:
        g = s.view(T, n_groups, E // n_groups)
        group_score = g.topk(min(2, E // n_groups), dim=-1).values.sum(-1)  # [T, n_groups]
        keep = group_score.sort(dim=-1, descending=True, stable=True).indices[:, :topk_groups]
        mask = torch.ones(T, n_groups, dtype=torch.bool, device=s.device).scatter_(1, keep, False)
        s = g.masked_fill(mask[:, :, None], float("-inf")).view(T, E)
    idx = s.sort(dim=-1, descending=True, stable=True).indices[:, :topk].contiguous()
    return idx, pairs_per_expert(idx, E)

