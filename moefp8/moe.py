"""The MoE layer (docs/design.md §2): router -> quantize -> dispatch -> permute -> experts ->
unpermute -> combine, plus shared experts (a dense MLP on every token, moefp8.mlp.MLP).

The routed path's stages live in moefp8.moe_stages: `RoutedExperts` runs them one after the
other (the plain schedule); with an `OverlapPolicy` the layer runs moefp8.overlap's two
micro-batch schedule of the same stages instead.

`Recipe("bf16")` runs the same pipeline with BF16 rows and BF16 grouped GEMMs: the like-for-like
baseline. Nothing here keeps hidden state besides the FP8 weight cache (re-quantized when the
optimizer changes a weight) and the router's bias buffer.
"""

from typing import NamedTuple

import torch
from torch import Tensor, nn

from moefp8.dispatch import Dispatcher, build_dispatcher
from moefp8.experts import WeightCache
from moefp8.fp8 import TILE, ScaleStats
from moefp8.kernels.grouped_gemm import GemmPolicy
from moefp8.megablocks_experts import MegablocksExperts
from moefp8.mlp import MLP
from moefp8.moe_stages import RoutedExperts, RowCap
from moefp8.overlap import OverlappedMoE, OverlapPolicy, side_stream
from moefp8.recipe import Recipe
from moefp8.router import Router
from moefp8.scope import scope


class MoEOutput(NamedTuple):
    out: Tensor  # like x
    aux_loss: Tensor | None  # the router's sequence-wise balance loss, if enabled
    load_E: Tensor  # tokens per expert in this call (int64, no grad)


class MoELayer(nn.Module):
    """Routed experts (E experts of intermediate size I, top-k) + n_shared shared experts.

    recipe: the `Recipe` (FP8 or BF16 experts, the scale format; its moe_impl "megablocks": the
    routed experts by megablocks' dMoE, moefp8.megablocks_experts: BF16, EP=1, no overlap).
    dispatcher: a `moefp8.dispatch.Dispatcher` (default: the EP=1 `local` backend); its
    num_local_experts experts are this rank's slice of the expert weights.
    overlap: None, the plain schedule; an `OverlapPolicy`: split the tokens in two micro-batches
    and overlap one's dispatch/combine with the other's expert compute (moefp8.overlap), with
    that policy's streams and SM reserve; every rank of the EP group must agree.
    gemm: the `GemmPolicy` its GEMMs run with. stats: the `ScaleStats` its quantizations report
    to (the model's; None: one of its own, off). recompute_out: FP8 recipe, keep fc2's FP8 input
    instead of the experts' BF16 output y and recompute y in the backward (for the routing weights'
    gradient; train.recompute=[expert_out]): less memory, one more fc2 GEMM; the same bits.
    row_cap: the `moe_stages.RowCap` its layouts follow under EP (the model's, dispatch.rows_factor;
    None: off). shared_overlap: in the plain schedule, the shared experts run while the dispatch and
    the gradient dispatch exchange on a side stream (`shared_overlap_stream`; dispatch.shared_overlap)."""

    def __init__(self, hidden: int, inter: int, n_experts: int, topk: int, n_shared: int = 1,
                 recipe: Recipe = Recipe(), dispatcher: Dispatcher | None = None,
                 overlap: OverlapPolicy | None = None, gemm: GemmPolicy = GemmPolicy(),
                 stats: ScaleStats | None = None, recompute_out: bool = False, row_cap: RowCap | None = None,
                 shared_overlap: bool = False, **router_kwargs):
        super().__init__()
        if recipe.fp8:
            for name, v in (("hidden", hidden), ("expert intermediate size", inter)):
                if v % TILE:
                    raise ValueError(f"MoELayer: {name} {v} is not divisible by {TILE}, which the FP8 recipe "
                                     f"needs (1x{TILE} and {TILE}x{TILE} tiles); use recipe='bf16' or another size")
        self.router = Router(hidden, n_experts, topk, **router_kwargs)
        self.dispatcher = dispatcher or build_dispatcher("local", n_experts)
        E_local = self.dispatcher.num_local_experts
        if self.dispatcher.num_experts != n_experts:
            raise ValueError(f"MoELayer: the dispatcher was built for {self.dispatcher.num_experts} experts, "
                             f"the layer has {n_experts}")
        if recipe.fp8 and self.dispatcher.scale_fmt not in (None, recipe.scale_fmt):
            raise ValueError(f"MoELayer: scale_fmt={recipe.scale_fmt!r} but the dispatcher sends "
                             f"{self.dispatcher.scale_fmt!r} scales: build both with the same scale format")
        if n_experts % E_local:
            raise ValueError(f"MoELayer: {n_experts} experts cannot be split evenly into shards of {E_local}")
        self.hidden, self.inter, self.n_experts, self.topk = hidden, inter, n_experts, topk
        self.recipe, self.overlap, self.gemm, self.recompute_out = recipe, overlap, gemm, recompute_out
        self.shared_overlap = shared_overlap
        self.stats = stats if stats is not None else ScaleStats()
        self.row_cap = row_cap if row_cap is not None else RowCap()
        self.w1 = nn.Parameter(torch.randn(E_local, 2 * inter, hidden) * hidden**-0.5)
        self.w2 = nn.Parameter(torch.randn(E_local, hidden, inter) * inter**-0.5)
        self.shared = MLP(hidden, n_shared * inter, recipe.fp8, recipe.scale_fmt, self.stats, gemm) if n_shared else None
        self.cache = WeightCache()
        self.megablocks = None
        if recipe.moe_impl == "megablocks":
            if E_local != n_experts or overlap is not None:
                raise ValueError("MoELayer: recipe moe_impl='megablocks' runs on one process (EP=1) without the "
                                 "overlap; use moe_impl='moefp8' for expert parallelism or dispatch.overlap")
            self.megablocks = MegablocksExperts(hidden, inter, n_experts, topk)

    def shared_overlap_stream(self, t: Tensor):
        """The side stream this layer's dispatches exchange on while its shared experts run (the plain
        schedule, `RoutedExperts`), or None: shared_overlap off, no shared experts, not CUDA, or a
        dispatcher that cannot pack on the caller's stream and exchange on another (its capacity mode)."""
        if not (self.shared_overlap and self.shared is not None and t.is_cuda and self.dispatcher.communicates
                and self.dispatcher.packs_on_caller_stream(self.topk)):
            return None
        return side_stream(t.device, "comm", OverlapPolicy.side_stream_priority)  # the default policy's

    def forward(self, x: Tensor, seq_len: int | None = None) -> MoEOutput:
        """x [..., H] bf16 -> MoEOutput(out like x, aux_loss, load_E)."""
        shape = x.shape
        x2 = x.reshape(-1, self.hidden)
        with scope("router"):
            r = self.router(x2, seq_len)
        if self.overlap is not None:  # two micro-batches, communication overlapped (moefp8.overlap)
            sh = self.shared
            out = OverlappedMoE.apply(x2, r.topk_w_TK, self.w1, self.w2, sh.w1 if sh else None,
                                      sh.w2 if sh else None, r.topk_idx_TK, self)
            return MoEOutput(out.reshape(shape), r.aux_loss, r.load_E)
        sh = self.shared
        if self.megablocks is None:  # the shared experts inside: they reuse the dispatch's FP8 x and dout
            out = RoutedExperts.apply(x2, r.topk_w_TK, self.w1, self.w2, r.topk_idx_TK, self,
                                      *((sh.w1, sh.w2) if sh is not None else ()))
            return MoEOutput(out.reshape(shape), r.aux_loss, r.load_E)
        out = self.megablocks(x2, r.topk_w_TK, r.topk_idx_TK, self.w1, self.w2)
        if sh is not None:
            with scope("shared"):
                out = out + sh(x2)
        return MoEOutput(out.reshape(shape), r.aux_loss, r.load_E)
