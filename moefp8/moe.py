"""The MoE layer (DESIGN.md §2): router -> quantize -> dispatch -> permute -> experts ->
unpermute -> combine, plus shared experts (a dense MLP on every token, `SharedExperts`).

The routed path is one autograd Function with an explicit backward, in this order:
  forward:  x -> "1x128" FP8 (before dispatch) -> dispatch -> permute (FP8 rows + scales) ->
            expert MLP (moefp8.experts) -> y [M, H] bf16 -> z[t] = sum_k w[t,k] y[row] (bf16) ->
            combine -> out
  backward: dout -> "1x128" FP8 -> dispatch along the forward's routes -> permute with each
            row's scales multiplied by its routing weight (dy = w * dout stays FP8) -> expert MLP
            backward -> dx rows summed per token (unpermute) -> combine -> dx.
            The routing weights' gradient dw[t,k] = <dout[t], y[row]> is computed in fp32 from
            y recomputed bit for bit from fc2's saved FP8 input: exact (it is what BF16 autograd
            computes for the combine). With EP > 1 the gradient arrives in FP8 and dw uses its
            dequantized value.
Saved for backward: the dispatched FP8 rows (row-wise, not a permuted copy: the backward
permutes again), the FP8 SwiGLU input h, fc2's FP8 input (for y), the routing weights and the
layout. The BF16 recipe saves the BF16 rows, h and y.

`recipe="bf16"` runs the same pipeline with BF16 rows and BF16 grouped GEMMs: the like-for-like
baseline. Nothing here keeps hidden state besides the FP8 weight cache (re-quantized when the
optimizer changes a weight) and the router's bias buffer.
"""

from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from moefp8.dispatch import Dispatcher, build_dispatcher
from moefp8.experts import WeightCache, bf16_mlp_backward, bf16_mlp_forward, fp8_mlp_backward, fp8_mlp_forward
from moefp8.kernels.grouped_gemm import fp8_grouped_gemm
from moefp8.fp8 import SCALE_STATS, TILE, Fp8Tensor, check_scale_fmt
from moefp8.kernels.permute import (PermuteLayout, build_layout, combine_backward, permute_fp8, permute_rows,
                                    unpermute_combine)
from moefp8.kernels.quant import quant_rowwise
from moefp8.linear import quant_operand
from moefp8.router import Router

RECIPES = ("fp8", "bf16")


class MoEOutput(NamedTuple):
    out: Tensor  # like x
    aux_loss: Tensor | None  # the router's sequence-wise balance loss, if enabled
    load_E: Tensor  # tokens per expert in this call (int64, no grad)


class Saved(NamedTuple):
    """What one micro-batch's routed path keeps for backward (FP8: data/scale pairs; BF16: the
    tensor and None)."""
    x: tuple  # dispatched rows (not a permuted copy: the backward permutes again)
    h: tuple  # the SwiGLU input
    y: tuple  # FP8: fc2's input (y is recomputed from it); BF16: y; (None, None) without dw
    topk_w: Tensor
    layout: PermuteLayout
    handle: object


def _tensors(s: Saved) -> tuple:
    return (*s.x, *s.h, *s.y, s.topk_w, s.layout.row_TK, s.layout.src_M, s.layout.offsets)


_N_SAVED = 10  # len(_tensors(...))


def save(ctx, saves: list[Saved], *params: Tensor) -> None:
    """Saved tensors go through save_for_backward (so saved-tensor hooks see and count them); the
    host-side parts (counts, the dispatch handle) stay on ctx."""
    ctx.save_for_backward(*(t for s in saves for t in _tensors(s)), *params)
    ctx.saved_meta = [(s.layout.counts, s.layout.M, s.handle) for s in saves]


def restore(ctx) -> tuple[list[Saved], tuple]:
    """-> (the Saved of each micro-batch, the params given to `save`); the inverse of `_tensors`."""
    ts, n = ctx.saved_tensors, _N_SAVED
    saves = []
    for i, (counts, M, handle) in enumerate(ctx.saved_meta):
        t = ts[n * i:n * (i + 1)]
        saves.append(Saved(t[0:2], t[2:4], t[4:6], t[6], PermuteLayout(t[7], t[8], t[9], counts, M), handle))
    return saves, ts[n * len(saves):]


# ----------------------------------------------------------------------------------------------
# The routed path in stages, one micro-batch each. `_RoutedExperts` runs them in order;
# moefp8.overlap interleaves two micro-batches' stages on a compute and a communication stream.
# Stages marked (comm) only communicate or do small bookkeeping.


def combine_buffer(layer, handle, rows_MH: Tensor) -> Tensor | None:
    """Where to write the next combine's bf16 input (the dispatcher's send buffer, so that its
    transport moves it without staging it; `AllToAllDispatcher.combine_buffer`), or None."""
    fn = getattr(layer.dispatcher, "combine_buffer", None)
    return fn(handle, rows_MH.shape[1], rows_MH.device) if fn is not None and rows_MH.dtype == torch.bfloat16 else None


def fwd_dispatch(layer, x_TH: Tensor, topk_idx_TK: Tensor, topk_w_TK: Tensor):
    """(comm) quantize (FP8 recipe) and dispatch -> Dispatched. The quantization is the one
    compute kernel here: it must happen before the rows leave (DESIGN.md §1)."""
    fp8, disp = layer.recipe == "fp8", layer.dispatcher
    with record_function("quant"):
        xin = SCALE_STATS.record("act", quant_rowwise(x_TH, layer.scale_fmt)) if fp8 else x_TH.to(torch.bfloat16)
    with record_function("dispatch"):
        return disp.dispatch(xin, topk_idx_TK, topk_w_TK)


def fwd_layout(layer, d) -> PermuteLayout:
    """(comm) the permutation of the received rows among the local experts; one host sync (the counts)."""
    with record_function("layout"):
        return build_layout(d.topk_idx, layer.dispatcher.num_local_experts)


def fwd_experts(layer, d, L: PermuteLayout, w1: Tensor, w2: Tensor, want_dw: bool) -> tuple[Tensor, Saved]:
    """permute -> expert MLP -> z[t] = sum_k w[t,k] y[row] (bf16, [T_recv, H]), and what backward needs."""
    fp8, fmt = layer.recipe == "fp8", layer.scale_fmt
    with record_function("permute"):
        xp = permute_fp8(d.x, L, colmajor_scale=True) if fp8 else permute_rows(d.x, L)
    if fp8:
        y, h, a8 = fp8_mlp_forward(xp, L.offsets, layer.cache.get(w1, fmt), layer.cache.get(w2, fmt), fmt,
                                   L.offsets_host)
        # Keep fc2's FP8 input, not y: backward recomputes y bit for bit (one more fc2 GEMM) for
        # the exact dw, and a8 is 1 byte x I where y is 2 bytes x H.
        saved = Saved((d.x.data, d.x.scale), (h.data, h.scale), (a8.data, a8.scale) if want_dw else (None, None),
                      d.topk_w, L, d.handle)
    else:
        y, h = bf16_mlp_forward(xp, L.offsets, layer.cache.get(w1, "bf16"), layer.cache.get(w2, "bf16"))
        saved = Saved((d.x, None), (h, None), (y if want_dw else None, None), d.topk_w, L, d.handle)
    with record_function("combine"):
        return unpermute_combine(y, L, d.topk_w, out=combine_buffer(layer, d.handle, y)), saved


def bwd_dispatch(layer, dout: Tensor, s: Saved):
    """(comm) the gradient of the combine: dout along the forward's routes (FP8 on the wire in the
    FP8 recipe, quantized 1x128 before it leaves)."""
    fp8, disp = layer.recipe == "fp8", layer.dispatcher
    with record_function("bwd_dispatch"):
        g = SCALE_STATS.record("grad", quant_rowwise(dout, layer.scale_fmt)) if fp8 else dout.to(torch.bfloat16)
        return disp.dispatch(g, handle=s.handle).x


def bwd_experts(layer, dz, dout: Tensor, s: Saved, w1: Tensor, w2: Tensor, want_dx: bool, dw_into: tuple | None = None):
    """dz (the dispatched gradient) -> (dx rows summed per received token [T_recv, H] or None,
    dw [T_recv, K] fp32 or None, dW1, dW2 fp32). dout: this rank's gradient, used for dw at EP=1.
    dw_into: (dW1, dW2) of another micro-batch to add this one's into (FP8 recipe; returned as
    dW1, dW2), else None."""
    fp8, fmt, disp = layer.recipe == "fp8", layer.scale_fmt, layer.dispatcher
    L, w_TK = s.layout, s.topk_w
    dw = None
    if fp8:
        if s.y[0] is not None:
            with record_function("bwd_dw"):
                y = fp8_grouped_gemm(Fp8Tensor(*s.y, "1x128"), layer.cache.get(w2, fmt), L.offsets,
                                     validate=False, host_offsets=L.offsets_host)  # = forward's y
                dzf = dout if not disp.communicates else dz.dequantize(torch.bfloat16)
                dw = combine_backward(dzf, y, L, w_TK, want_dy=False)[1]
                del y, dzf  # [M, H] and [T_recv, H] bf16: not alive during the expert backward
        with record_function("bwd_permute"):
            dy8 = permute_fp8(dz, L, scale_by_TK=w_TK, colmajor_scale=True)  # dy = w * dout, still FP8
            x8 = permute_fp8(Fp8Tensor(*s.x, "1x128"), L, colmajor_scale=True)
        dxp, dw1, dw2 = fp8_mlp_backward(dy8, x8, Fp8Tensor(*s.h, "1x128"), L.offsets, w1, w2, layer.cache, fmt,
                                         want_dx=want_dx, off_host=L.offsets_host, dw_into=dw_into)
    else:
        with record_function("bwd_dw"):
            dy, dw = combine_backward(dz, s.y[0], L, w_TK, want_dy=True)
        with record_function("bwd_permute"):
            xp = permute_rows(s.x[0], L)
        dxp, dw1, dw2 = bf16_mlp_backward(dy, xp, s.h[0], L.offsets, layer.cache.get(w1, "bf16"),
                                          layer.cache.get(w2, "bf16"), want_dx=want_dx)
    dx_rows = None
    if dxp is not None:  # sum each token's rows (their weights are already in dy)
        with record_function("bwd_unpermute"):
            dx_rows = unpermute_combine(dxp, L, torch.ones_like(w_TK), out=combine_buffer(layer, s.handle, dxp))
    return dx_rows, dw, dw1, dw2


def bwd_combine(layer, dx_rows, dw, s: Saved, dtype):
    """(comm) send dx back to the tokens' ranks; dw [T_recv, K] (0 on slots routed elsewhere) ->
    [T, K] on the token's rank: exact (one nonzero term per slot), the identity at EP=1.
    needs_input_grad agrees across ranks, so the collectives stay matched."""
    disp = layer.dispatcher
    with record_function("bwd_combine"):
        dx = disp.combine(dx_rows, s.handle).to(dtype) if dx_rows is not None else None
        return dx, disp.combine(dw, s.handle) if dw is not None else None


class _RoutedExperts(torch.autograd.Function):
    """The routed path of one micro-batch, stage after stage (the serialized schedule)."""

    @staticmethod
    def forward(ctx, x_TH, topk_w_TK, w1, w2, topk_idx_TK, layer):
        d = fwd_dispatch(layer, x_TH, topk_idx_TK, topk_w_TK)
        L = fwd_layout(layer, d)
        z, saved = fwd_experts(layer, d, L, w1, w2, want_dw=ctx.needs_input_grad[1])
        save(ctx, [saved], w1, w2)
        ctx.layer = layer
        with record_function("combine"):
            return layer.dispatcher.combine(z, d.handle)

    @staticmethod
    def backward(ctx, dout):
        (s,), (w1, w2) = restore(ctx)
        layer = ctx.layer
        dout = dout.contiguous()
        dz = bwd_dispatch(layer, dout, s)
        dx_rows, dw, dw1, dw2 = bwd_experts(layer, dz, dout, s, w1, w2, want_dx=ctx.needs_input_grad[0])
        dx, dw = bwd_combine(layer, dx_rows, dw, s, dout.dtype)
        return dx, dw, dw1.to(w1.dtype), dw2.to(w2.dtype), None, None


def shared_forward(shared, x_TH: Tensor, w1: Tensor, w2: Tensor) -> tuple[Tensor, tuple]:
    """The shared experts' dense SwiGLU MLP on every token (no routing, no permutation):
    -> (y [T, H] bf16, what backward needs: FP8 (x "128x1" data, scale, h8 data, scale); BF16 (x, None, h, None)).
    FP8: x is quantized row-wise (fc1's operand) and col-wise (fc1's wgrad operand) in one pass."""
    fmt = shared.scale_fmt
    if shared.recipe == "fp8":
        x8, x_col = quant_operand(x_TH, fmt, colwise=True, kind="act")
        y, h8, _ = fp8_mlp_forward(x8, None, shared.cache.get(w1, fmt), shared.cache.get(w2, fmt), fmt)
        return y, (x_col.data, x_col.scale, h8.data, h8.scale)
    x = x_TH.to(torch.bfloat16)
    y, h = bf16_mlp_forward(x, None, shared.cache.get(w1, "bf16"), shared.cache.get(w2, "bf16"))
    return y, (x, None, h, None)


def shared_backward(shared, dy: Tensor, saved: tuple, w1: Tensor, w2: Tensor, want_dx: bool):
    """-> (dx [T, H] like dy or None, dW1 [2I, H] fp32, dW2 [H, I] fp32)."""
    fmt, (x, xs, h, hs) = shared.scale_fmt, saved
    if shared.recipe == "fp8":
        dy8, dy_col = quant_operand(dy, fmt, colwise=True, kind="grad")
        dx, dw1, dw2 = fp8_mlp_backward(dy8, Fp8Tensor(x, xs, "128x1"), Fp8Tensor(h, hs, "1x128"), None, w1, w2,
                                        shared.cache, fmt, want_dx=want_dx, dy_col=dy_col)
    else:
        dx, dw1, dw2 = bf16_mlp_backward(dy.to(torch.bfloat16), x, h, None, shared.cache.get(w1, "bf16"),
                                         shared.cache.get(w2, "bf16"), want_dx=want_dx)
    return dx.to(dy.dtype) if dx is not None else None, dw1, dw2


class _SharedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w1, w2, shared):
        y, saved = shared_forward(shared, x_TH, w1, w2)
        ctx.save_for_backward(*saved, w1, w2)
        ctx.shared = shared
        return y

    @staticmethod
    def backward(ctx, dy):
        *saved, w1, w2 = ctx.saved_tensors
        dx, dw1, dw2 = shared_backward(ctx.shared, dy.contiguous(), saved, w1, w2, ctx.needs_input_grad[0])
        return dx, dw1.to(w1.dtype), dw2.to(w2.dtype), None


class SharedExperts(nn.Module):
    """Shared experts: a dense SwiGLU MLP every token goes through, with the routed experts' FP8
    recipe (x and h cached in FP8, the fused SwiGLU kernels, FP8 weights cached per optimizer
    step) on dense GEMMs. n_shared experts of size I are one MLP of size n_shared * I.
    Weights [2I, H] (gate rows, then up) and [H, I]."""

    def __init__(self, hidden: int, inter: int, recipe: str, scale_fmt: str):
        super().__init__()
        self.recipe, self.scale_fmt = recipe, scale_fmt
        self.w1 = nn.Parameter(torch.randn(2 * inter, hidden) * hidden**-0.5)  # [gate | up]
        self.w2 = nn.Parameter(torch.randn(hidden, inter) * inter**-0.5)
        self.cache = WeightCache()

    def forward(self, x_TH: Tensor) -> Tensor:
        return _SharedMLP.apply(x_TH, self.w1, self.w2, self)


class MoELayer(nn.Module):
    """Routed experts (E experts of intermediate size I, top-k) + n_shared shared experts.

    dispatcher: a `moefp8.dispatch.Dispatcher` (default: the EP=1 `local` backend); its
    num_local_experts experts are this rank's slice of the expert weights.
    overlap: split the tokens in two micro-batches and overlap one's dispatch/combine with the
    other's expert compute (moefp8.overlap); every rank of the EP group must agree."""

    def __init__(self, hidden: int, inter: int, n_experts: int, topk: int, n_shared: int = 1,
                 recipe: str = "fp8", scale_fmt: str = "pow2", dispatcher: Dispatcher | None = None,
                 overlap: bool = False, **router_kwargs):
        super().__init__()
        if recipe not in RECIPES:
            raise ValueError(f"MoELayer: recipe={recipe!r}, expected one of {RECIPES}")
        check_scale_fmt(scale_fmt)
        if recipe == "fp8":
            for name, v in (("hidden", hidden), ("expert intermediate size", inter)):
                if v % TILE:
                    raise ValueError(f"MoELayer: {name} {v} is not divisible by {TILE}, which the FP8 recipe "
                                     f"needs (1x{TILE} and {TILE}x{TILE} tiles); use recipe='bf16' or another size")
        self.router = Router(hidden, n_experts, topk, **router_kwargs)
        self.dispatcher = dispatcher or build_dispatcher("local", n_experts)
        E_local = self.dispatcher.num_local_experts
        if getattr(self.dispatcher, "num_experts", n_experts) != n_experts:
            raise ValueError(f"MoELayer: the dispatcher was built for {self.dispatcher.num_experts} experts, "
                             f"the layer has {n_experts}")
        if recipe == "fp8" and getattr(self.dispatcher, "scale_fmt", scale_fmt) != scale_fmt:
            raise ValueError(f"MoELayer: scale_fmt={scale_fmt!r} but the dispatcher sends "
                             f"{self.dispatcher.scale_fmt!r} scales: build both with the same scale format")
        if n_experts % E_local:
            raise ValueError(f"MoELayer: {n_experts} experts cannot be split evenly into shards of {E_local}")
        self.hidden, self.inter, self.n_experts, self.topk = hidden, inter, n_experts, topk
        self.recipe, self.scale_fmt, self.overlap = recipe, scale_fmt, overlap
        self.w1 = nn.Parameter(torch.randn(E_local, 2 * inter, hidden) * hidden**-0.5)
        self.w2 = nn.Parameter(torch.randn(E_local, hidden, inter) * inter**-0.5)
        self.shared = SharedExperts(hidden, n_shared * inter, recipe, scale_fmt) if n_shared else None
        self.cache = WeightCache()

    def forward(self, x: Tensor, seq_len: int | None = None) -> MoEOutput:
        """x [..., H] bf16 -> MoEOutput(out like x, aux_loss, load_E)."""
        shape = x.shape
        x2 = x.reshape(-1, self.hidden)
        with record_function("router"):
            r = self.router(x2, seq_len)
        if self.overlap:  # two micro-batches, communication overlapped (moefp8.overlap)
            from moefp8.overlap import OverlappedMoE

            sh = self.shared
            out = OverlappedMoE.apply(x2, r.topk_w_TK, self.w1, self.w2, sh.w1 if sh else None,
                                      sh.w2 if sh else None, r.topk_idx_TK, self)
            return MoEOutput(out.reshape(shape), r.aux_loss, r.load_E)
        out = _RoutedExperts.apply(x2, r.topk_w_TK, self.w1, self.w2, r.topk_idx_TK, self)
        if self.shared is not None:
            with record_function("shared"):
                out = out + self.shared(x2)
        return MoEOutput(out.reshape(shape), r.aux_loss, r.load_E)
