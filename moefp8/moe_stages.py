"""The MoE layer's routed path in stages, one micro-batch each (docs/design.md §2): what the plain
schedule (`RoutedExperts`, below) runs in order and what the two micro-batch overlap
(moefp8.overlap) interleaves on a compute and a communication stream.

  forward:  x -> "1x128" FP8 (before dispatch) -> dispatch -> permute (FP8 rows + scales) ->
            expert MLP (moefp8.experts) -> y [M, H] bf16 -> z[t] = sum_k w[t,k] y[row] (bf16) ->
            combine -> out
  backward: dout -> "1x128" FP8 -> dispatch along the forward's routes -> permute with each
            row's scales multiplied by its routing weight (dy = w * dout stays FP8) -> expert MLP
            backward -> dx rows summed per token (unpermute) -> combine -> dx.
            The routing weights' gradient dw[t,k] = <dout[t], y[row]> is computed in fp32 from
            the forward's y: exact (it is what BF16 autograd computes for the combine). With EP > 1
            the gradient arrives in FP8 and dw uses its dequantized value.
Saved for backward: the dispatched FP8 rows (row-wise, not a permuted copy: the backward
permutes again), the FP8 SwiGLU input h, y in BF16, the routing weights and the layout; with
the layer's `recompute_out` (train.recompute=[expert_out]) fc2's FP8 input instead of y (I bytes
a slot where y takes 2H), and the backward recomputes y from it bit for bit: one more fc2 GEMM
per layer (~1/7 of its m-grouped GEMM time). The BF16 recipe saves the BF16 rows, h and y.

Every stage takes the layer (a moefp8.moe.MoELayer: its recipe, dispatcher, weight cache and
scale statistics) and, where it multiplies, the `GemmPolicy` the schedule runs its GEMMs with.
Stages marked (comm) only communicate or do small bookkeeping.
"""

import math
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import Tensor

from moefp8.accum import main_grad
from moefp8.dispatch import Dispatcher
from moefp8.experts import bf16_mlp_backward, bf16_mlp_forward, fp8_mlp_backward, fp8_mlp_forward
from moefp8.fp8 import Fp8Tensor, record_stream
from moefp8.kernels.grouped_gemm import GemmPolicy, fp8_grouped_gemm
from moefp8.kernels.permute import (PermuteLayout, build_layout, combine_backward, permute_fp8,
                                    permute_requant_colwise, permute_rows, rows_bound, unpermute_combine)
from moefp8.kernels.quant import quant_rowwise, requant_colwise
from moefp8.mlp import mlp_backward, mlp_forward
from moefp8.scope import scope


class RowCap:
    """dispatch.rows_factor: an EP rank's permuted rows sized without reading its counts back.

    Where a dispatch brings no per-expert counts (the all_to_all capacity mode) the layout reads them
    back to size its rows: one host sync per MoE layer and micro-batch. With a factor f > 0 it takes
    instead rows_bound(f x T x K, E_l) rows (T: this rank's tokens; T x K pairs is what a rank receives
    on balanced routing) and no read-back (`build_layout(cap=)`); a rank whose pairs need more sets an
    overflow flag on the device, and that layer's result is wrong. The flags ride on the training
    loop's one host sync per step (`take`), and a step where any rank overflowed runs again with exact
    layouts: no token is ever dropped. Only while `on` (the training loop's steps, which check the flags;
    not its evaluation, nor a step's second run); EP = 1 keeps its bound (`build_layout(bound=True)`).
    With no read-back left in the layer, a MoE block under EP can replay one CUDA graph whole
    (train.cuda_graphs_mlp, moefp8.graphs) while `on`.
    One per model, shared by its MoE layers; factor 0: off.

    Backoff (`ready` / `fit`): a fresh router's collapsed routing overflows the cap step after step until
    the bias balances the load, and each such step would run twice. After a step that overflowed, the
    next `wait` steps run exact layouts at once (one run each); `wait` doubles with each overflow in a
    row, up to MAX_WAIT, and is back to 1 after a capped step that fit."""

    MAX_WAIT = 64

    def __init__(self, factor: float = 0.0, send_factor: float = 0.0):
        if not isinstance(factor, (int, float)) or not 0 <= factor < 1e6:
            raise ValueError(f"dispatch.rows_factor={factor!r}: expected 0 (off) or a factor > 0 of the balanced "
                             f"load, e.g. 1.5")
        if send_factor and not factor:
            raise ValueError(f"dispatch.send_factor={send_factor!r} needs dispatch.rows_factor > 0 (its overflows "
                             f"run again as the layouts' do)")
        self.factor, self.send_factor, self.on = float(factor), float(send_factor), False
        self._overflowed: Tensor | None = None  # int32 [1]: a running sum (no list growing where nobody takes)
        self._wait, self._skip = 1, 0  # the backoff: steps to skip after the next overflow, steps left to skip

    def ready(self) -> bool:
        """Whether the next training step tries the capped layouts (False: it runs exact ones, the backoff
        after an overflow; every rank gets the same answer, as every rank sees the same overflow sum)."""
        if self._skip:
            self._skip -= 1
            return False
        return True

    def fit(self, overflowed: bool) -> int:
        """After a capped step: whether its layouts overflowed on any rank -> how many steps from now run
        exact layouts without trying the cap (0 after a step that fit)."""
        if not overflowed:
            self._wait = 1
            return 0
        self._skip, self._wait = self._wait, min(2 * self._wait, self.MAX_WAIT)
        return self._skip

    def rows(self, n_tokens: int, topk: int, n_experts: int) -> int | None:
        """The rows for a layout of a dispatch of this rank's n_tokens at top-k over n_experts local
        experts; None: the exact layout (no factor, or not `on`)."""
        if not self.factor or not self.on:
            return None
        return rows_bound(math.ceil(self.factor * n_tokens * topk), n_experts)

    def send_rows(self, disp, topk: int) -> int | None:
        """dispatch.send_factor: the rows of the capacity mode's compacted send blocks for `disp` at top-k
        (`AllToAllDispatcher.compacted_rows`); None: whole blocks (off, not `on`, or a dispatcher without
        a capacity)."""
        rows_for = getattr(disp, "compacted_rows", None)
        if not (self.send_factor and self.on and rows_for):
            return None
        return rows_for(topk, self.send_factor)

    def note(self, overflow: Tensor) -> None:
        self._overflowed = overflow if self._overflowed is None else self._overflowed + overflow

    def swap(self, got: Tensor | None) -> Tensor | None:
        """Sets the running sum to `got` and returns what it was: a block captured whole in a CUDA graph
        returns its own layouts' flags as an output (`Block.whole_checked`), which its replays `note`."""
        old, self._overflowed = self._overflowed, got
        return old

    def take(self) -> Tensor | None:
        """The layouts that overflowed since the last take (int32 [1], on the device; None: no capped
        layout); forgets them."""
        got, self._overflowed = self._overflowed, None
        if got is not None and got.is_cuda:  # made on the layout stream under the overlap: read on the caller's
            got.record_stream(torch.cuda.current_stream(got.device))
        return got


class Saved(NamedTuple):
    """What one micro-batch's routed path keeps for backward (FP8: data/scale pairs; BF16: the
    tensor and None)."""
    x: tuple  # dispatched rows (not a permuted copy: the backward permutes again)
    h: tuple  # the SwiGLU input
    y: tuple  # (y, None); FP8 with recompute_out: fc2's FP8 input (data, scale); (None, None) without dw
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


def combine_buffer(disp: Dispatcher, handle, rows_MH: Tensor) -> Tensor | None:
    """Where to write the next combine's bf16 input (the dispatcher's send buffer, so that its
    transport moves it without staging it; `Dispatcher.combine_buffer`), or None."""
    return disp.combine_buffer(handle, rows_MH.shape[1], rows_MH.device) if rows_MH.dtype == torch.bfloat16 else None


def _wire_rows(layer, t_TH: Tensor, kind: str):
    """What a dispatch sends of t [T, H]: FP8 recipe, its "1x128" quantization (recorded in the
    layer's scale statistics as kind, "act" | "grad"); BF16 recipe, t in bf16."""
    if layer.recipe.fp8:
        return layer.stats.record(kind, quant_rowwise(t_TH, layer.recipe.scale_fmt))
    return t_TH.to(torch.bfloat16)


def _send(disp: Dispatcher, rows, evented: bool, *args, **kw):
    """disp.dispatch(rows, ...), or with `evented` its event API (DeepEP's `dispatch_async`): started
    after the current stream's work so far, finished on the dispatcher's own stream -> (Dispatched,
    the event that finishes it)."""
    if not evented:
        return disp.dispatch(rows, *args, **kw)
    return disp.dispatch_async(rows, *args, previous_event=disp.capture(), allocate_on_comm_stream=True, **kw)


def fwd_dispatch(layer, x_TH: Tensor, topk_idx_TK: Tensor, topk_w_TK: Tensor, evented: bool = False, *,
                 xin=None):
    """(comm) quantize (FP8 recipe) and dispatch -> Dispatched. The quantization is the one
    compute kernel here: it must happen before the rows leave (docs/design.md §1). evented: through
    the dispatcher's event API (`_send`) -> (Dispatched, event). xin: `_wire_rows(layer, x_TH, "act")`
    where the caller made it (to share it with the shared experts)."""
    if xin is None:
        with scope("quant"):
            xin = _wire_rows(layer, x_TH, "act")
    with scope("dispatch"):
        rows = None if evented else layer.row_cap.send_rows(layer.dispatcher, topk_idx_TK.shape[1])
        if rows is None:
            return _send(layer.dispatcher, xin, evented, topk_idx_TK, topk_w_TK)
        d = layer.dispatcher.dispatch(xin, topk_idx_TK, topk_w_TK, rows=rows)  # compacted blocks (send_factor)
        if d.overflow is not None:
            layer.row_cap.note(d.overflow)
        return d


def fwd_layout(layer, d) -> PermuteLayout:
    """(comm) the permutation of the received rows among the local experts; one host sync (the counts),
    none where the dispatch brought them (`Dispatched.counts`) nor at EP = 1, where the rows are the
    router's T x K pairs and take their static bound (`build_layout(bound=True)`): no sync in the layer;
    nor with dispatch.rows_factor (`RowCap`: the rows capped, an overflow flag for the training loop)."""
    with scope("layout"):
        disp, E_l = layer.dispatcher, layer.dispatcher.num_local_experts
        n_tokens = getattr(d.handle, "num_tokens", None)
        cap = (layer.row_cap.rows(n_tokens, d.topk_idx.shape[1], E_l)
               if d.counts is None and disp.communicates and n_tokens is not None else None)
        if cap is not None:
            L = build_layout(d.topk_idx, E_l, cap=cap)
            layer.row_cap.note(L.overflow)
            return L
        return build_layout(d.topk_idx, E_l, counts=d.counts, bound=d.counts is None and not disp.communicates)


def fwd_experts(layer, d, L: PermuteLayout, w1: Tensor, w2: Tensor, want_dw: bool,
                gemm: GemmPolicy, add: Tensor | None = None) -> tuple[Tensor, Saved]:
    """permute -> expert MLP -> z[t] = sum_k w[t,k] y[row] (bf16, [T_recv, H]), and what backward needs.
    add: a bf16 [T_recv, H] added to z in the combine's pass (the shared experts' output at EP=1)."""
    fp8, fmt = layer.recipe.fp8, layer.recipe.scale_fmt
    with scope("permute"):
        xp = permute_fp8(d.x, L, colmajor_scale=True) if fp8 else permute_rows(d.x, L)
    if fp8:
        y, h, a8 = fp8_mlp_forward(xp, L.offsets, layer.cache.get(w1, fmt), layer.cache.get(w2, fmt), fmt,
                                   L.offsets_host, gemm=gemm, stats=layer.stats, src_M=L.src_M)
        # y for dw, or fc2's FP8 input (1 byte x I where y is 2 bytes x H) to recompute it from
        keep = (None, None) if not want_dw else (a8.data, a8.scale) if layer.recompute_out else (y, None)
        saved = Saved((d.x.data, d.x.scale), (h.data, h.scale), keep, d.topk_w, L, d.handle)
    else:
        y, h = bf16_mlp_forward(xp, L.offsets, layer.cache.get(w1, "bf16"), layer.cache.get(w2, "bf16"))
        saved = Saved((d.x, None), (h, None), (y if want_dw else None, None), d.topk_w, L, d.handle)
    with scope("combine"):
        return unpermute_combine(y, L, d.topk_w, out=combine_buffer(layer.dispatcher, d.handle, y), add_TH=add), saved


def bwd_dispatch(layer, dout: Tensor, s: Saved, evented: bool = False, *, rows=None):
    """(comm) the gradient of the combine: dout along the forward's routes (FP8 on the wire in the
    FP8 recipe, quantized 1x128 before it leaves). evented: -> (rows, event), as `fwd_dispatch`.
    rows: `_wire_rows(layer, dout, "grad")` where the caller made it."""
    with scope("bwd_dispatch"):
        if rows is None:
            rows = _wire_rows(layer, dout, "grad")
        d = _send(layer.dispatcher, rows, evented, handle=s.handle)
        return (d[0].x, d[1]) if evented else d.x


def bwd_experts(layer, dz, dout: Tensor, s: Saved, w1: Tensor, w2: Tensor, want_dx: bool, gemm: GemmPolicy,
                dw_into: tuple | None = None, dx_add: Tensor | None = None):
    """dz (the dispatched gradient) -> (dx rows summed per received token [T_recv, H] or None,
    dw [T_recv, K] fp32 or None, dW1, dW2 fp32). dout: this rank's gradient, used for dw at EP=1.
    dw_into: fp32 (dW1, dW2) to add this micro-batch's into (another micro-batch's, or the weights'
    `main_grad`, moefp8.accum; returned as dW1, dW2), else None. dx_add: a bf16 [T_recv, H] added to
    the dx rows' sum in its pass (the shared experts' dx at EP=1)."""
    fp8, fmt, disp = layer.recipe.fp8, layer.recipe.scale_fmt, layer.dispatcher
    L, w_TK = s.layout, s.topk_w
    dw = None
    if fp8:
        if s.y[0] is not None:
            with scope("bwd_dw"):
                y = s.y[0] if s.y[1] is None else fp8_grouped_gemm(  # recompute_out: = forward's y, bit for bit
                    Fp8Tensor(*s.y, "1x128"), layer.cache.get(w2, fmt), L.offsets, validate=False,
                    host_offsets=L.offsets_host, policy=gemm)
                # EP: the FP8 gradient as it arrived, dequantized inside the kernel (no BF16 copy)
                dw = combine_backward(dout if not disp.communicates else dz, y, L, w_TK, want_dy=False)[1]
                del y  # [M, H] bf16 (recompute_out): not alive during the expert backward
        with scope("bwd_permute"):
            dy8 = permute_fp8(dz, L, scale_by_TK=w_TK, colmajor_scale=True)  # dy = w * dout, still FP8
            dy_col = requant_colwise(dy8, fmt)  # the fc2 wgrad's "128x1" copy
            # fc1's input only feeds the wgrad here: its "128x1" copy straight from the saved rows
            x_col = permute_requant_colwise(Fp8Tensor(*s.x, "1x128"), L, fmt)
        dxp, dw1, dw2 = fp8_mlp_backward(dy8, dy_col, x_col, Fp8Tensor(*s.h, "1x128"), L.offsets, w1, w2, layer.cache,
                                         fmt, want_dx=want_dx, off_host=L.offsets_host, dw_into=dw_into, gemm=gemm,
                                         stats=layer.stats, src_M=L.src_M)
    else:
        with scope("bwd_dw"):
            dy, dw = combine_backward(dz, s.y[0], L, w_TK, want_dy=True)
        with scope("bwd_permute"):
            xp = permute_rows(s.x[0], L)
        dxp, dw1, dw2 = bf16_mlp_backward(dy, xp, s.h[0], L.offsets, layer.cache.get(w1, "bf16"),
                                          layer.cache.get(w2, "bf16"), want_dx=want_dx, dw_into=dw_into)
    dx_rows = None
    if dxp is not None:  # sum each token's rows (their weights are already in dy)
        with scope("bwd_unpermute"):
            dx_rows = unpermute_combine(dxp, L, torch.ones_like(w_TK), out=combine_buffer(disp, s.handle, dxp),
                                        add_TH=dx_add)
    return dx_rows, dw, dw1, dw2


def bwd_combine(layer, dx_rows, dw, s: Saved, dtype, evented: bool = False):
    """(comm) send dx back to the tokens' ranks; dw [T_recv, K] (0 on slots routed elsewhere) ->
    [T, K] on the token's rank: exact (one nonzero term per slot), the identity at EP=1.
    needs_input_grad agrees across ranks, so the collectives stay matched. evented: dx through the
    dispatcher's event API (DeepEP's `combine_async`, after the current stream's work so far), dw
    (fp32, repacked as bytes on the current stream) through its synchronous combine -> ((dx, dw),
    [the event that finishes dx]): dw is ready on the current stream."""
    disp = layer.dispatcher
    with scope("bwd_combine"):
        if not evented:
            dx = disp.combine(dx_rows, s.handle).to(dtype) if dx_rows is not None else None
            return dx, disp.combine(dw, s.handle) if dw is not None else None
        dx = dw_T = None
        events = []
        if dx_rows is not None:
            dx, ev = disp.combine_async(dx_rows, s.handle, previous_event=disp.capture(), allocate_on_comm_stream=True)
            if dx.dtype != dtype:  # the cast reads dx: on the current stream, once it is there
                ev.current_stream_wait()
                dx = dx.to(dtype)
            events.append(ev)
        if dw is not None:
            dw_T = disp.combine(dw, s.handle)
        return (dx, dw_T), events


class RoutedExperts(torch.autograd.Function):
    """The routed path of one micro-batch, stage after stage (the plain schedule), with the
    layer's GEMM policy. apply(x [T, H], topk_w [T, K], w1, w2, topk_idx [T, K], layer[, sw1, sw2])
    -> [T, H]; with the shared experts' weights sw1, sw2: routed + shared (`moefp8.mlp`), the shared
    experts taking the dispatch's quantization of x and of the output gradient (FP8: one pass over
    each for both; the same codes their own would be). They run after the combine; with the
    layer's `shared_overlap_stream` right after the dispatch is enqueued, while it exchanges on that
    stream (forward and backward); at EP=1 before the experts, their output (and dx) added in the
    combine's pass (`unpermute_combine(add_TH=)`): the same operations on the same values, in
    another order."""

    @staticmethod
    def forward(ctx, x_TH, topk_w_TK, w1, w2, topk_idx_TK, layer, sw1=None, sw2=None):
        with scope("quant"):
            xin = _wire_rows(layer, x_TH, "act")
        side = layer.shared_overlap_stream(x_TH) if sw1 is not None else None
        with exchanging(layer.dispatcher, side):
            d = fwd_dispatch(layer, x_TH, topk_idx_TK, topk_w_TK, xin=xin)
        shared = None
        local = sw1 is not None and not layer.dispatcher.communicates  # shared output added in the combine
        if side is not None or local:
            shared = _shared_forward(layer, x_TH, xin, sw1, sw2)
        if side is not None:
            _join(side, d.x, d.topk_idx, d.topk_w)
        L = fwd_layout(layer, d)
        z, saved = fwd_experts(layer, d, L, w1, w2, ctx.needs_input_grad[1], layer.gemm,
                               add=shared[0] if local else None)
        with scope("combine"):
            out = layer.dispatcher.combine(z, d.handle)
        if sw1 is not None and shared is None:
            shared = _shared_forward(layer, x_TH, xin, sw1, sw2)
        if shared is not None and not local:
            out = out + shared[0]
        save(ctx, [saved], w1, w2, *((sw1, sw2, *shared[1]) if shared is not None else ()))
        ctx.layer = layer
        return out

    @staticmethod
    def backward(ctx, dout):
        (s,), (w1, w2, *shared) = restore(ctx)
        layer = ctx.layer
        dout = dout.contiguous()
        rows = _wire_rows(layer, dout, "grad")
        side = layer.shared_overlap_stream(dout) if shared else None
        with exchanging(layer.dispatcher, side):
            dz = bwd_dispatch(layer, dout, s, rows=rows)
        sh = None
        local = bool(shared) and not layer.dispatcher.communicates  # shared dx added in the dx rows' sum
        if side is not None or local:
            sh = _shared_backward(ctx, layer, dout, rows, shared)
        if side is not None:
            _join(side, dz)
        into = _main_grads(w1, w2)  # moefp8.accum: summed over micro-batches inside the wgrad GEMMs
        dx_rows, dw, dw1, dw2 = bwd_experts(layer, dz, dout, s, w1, w2, ctx.needs_input_grad[0], layer.gemm,
                                            dw_into=into, dx_add=sh[0] if local else None)
        dx, dw = bwd_combine(layer, dx_rows, dw, s, dout.dtype)
        dw1, dw2 = (None, None) if into is not None else (dw1.to(w1.dtype), dw2.to(w2.dtype))
        if not shared:
            return dx, dw, dw1, dw2, None, None
        if sh is None:
            sh = _shared_backward(ctx, layer, dout, rows, shared)
        sdx, sdw1, sdw2 = sh
        if dx is not None and not local:
            dx = dx + sdx
        sw1, sw2 = shared[:2]
        return dx, dw, dw1, dw2, None, None, sdw1.to(sw1.dtype), sdw2.to(sw2.dtype)


def _main_grads(w1: Tensor, w2: Tensor) -> tuple[Tensor, Tensor] | None:
    """(w1.main_grad, w2.main_grad) where both weights carry one (moefp8.accum), else None."""
    g1, g2 = main_grad(w1), main_grad(w2)
    return (g1, g2) if g1 is not None and g2 is not None else None


def _shared_forward(layer, x_TH: Tensor, xin, sw1: Tensor, sw2: Tensor) -> tuple[Tensor, tuple]:
    """The shared experts on x (FP8: the dispatch's "1x128" x, `xin`) -> (y, what their backward keeps)."""
    with scope("shared"):
        sh = layer.shared
        return mlp_forward(sh, x_TH, sw1, sw2, sh.gemm, x8=xin if sh.fp8 else None)


def _shared_backward(ctx, layer, dout: Tensor, rows, shared: list) -> tuple:
    """The shared experts' backward (FP8: the gradient dispatch's "1x128" dout, `rows`) -> (dx, dW1, dW2)."""
    sw1, sw2, *s_saved = shared
    with scope("shared bwd"):
        sh = layer.shared
        return mlp_backward(sh, dout, s_saved, sw1, sw2, ctx.needs_input_grad[0], sh.gemm,
                            dy8=rows if sh.fp8 else None)


@contextmanager
def exchanging(disp: Dispatcher, side):
    """Calls of `disp` inside exchange on the stream `side` (their results valid there; None: on the
    caller's stream, as always): `Dispatcher.exchange_stream` for the duration."""
    disp.exchange_stream = side
    try:
        yield
    finally:
        disp.exchange_stream = None


def _join(side, *results) -> None:
    """The current stream waits for the exchanges enqueued on `side` so far, whose `results` (tensors,
    Fp8Tensors) it reads from now on."""
    cur = torch.cuda.current_stream(side.device)
    cur.wait_stream(side)
    record_stream(cur, *results)
