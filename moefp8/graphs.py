"""CUDA graphs for the blocks' attention (train.cuda_graphs), and with train.cuda_graphs_mlp for whole
blocks where the MLP's shapes are static too: fewer host launches per step.

A block's attention (its norm, the QKV projection with its FP8 quantizations, RoPE, flash attention,
the output projection, the residual add and the MLP's input norm: `Block.attend`) has the same shapes
every step, unlike the MoE layer after it (its expert segments and exchanges change with the routing).
`graph_attention` captures each block's attention forward and backward once with torch's
`make_graphed_callables`, all blocks in one call (one memory pool, forwards in order, backwards in
reverse, as the step runs them), and the block replays the graphs instead of launching ~40 kernels
from Python per layer. The numerics are the eager path's: the same kernels replayed.

A block runs its eager path where a replay would be wrong or is not wanted: other shapes (an
evaluation batch), no autograd (evaluation), FP8 statistics being recorded (a replay would not
record them), and blocks that recompute their attention in the backward (`train.recompute=[attention]`).
Where the MoE layers run the two micro-batch overlap (moefp8.overlap: each block's attention on the
two halves of the micro-batch), the MoE blocks also capture one graph per half and the overlapped
block replays them (`graph_attention(halves=...)`).

With train.cuda_graphs_mlp a block whose MLP has static shapes is captured whole instead (`_Whole`:
attention, MLP or MoE layer, residual adds): a dense block always; a MoE block in the plain schedule
where nothing in its layer reads a count back: at EP = 1 (the layout sizes its rows by their static
bound, `kernels.permute.rows_bound`), and under EP where the exchanges have fixed sizes (the all_to_all
capacity mode over NCCL, `Dispatcher.static_exchange`: the graph holds its collectives) and the layouts
are capped (dispatch.rows_factor, `moe_stages.RowCap`). Such a block replays only while the cap is on
(the training loop's steps): a step run again with exact layouts, after a capped one overflowed, runs
it eagerly. Its replays return the layouts' overflow flags as an output, which the block hands to the
`RowCap` (`Block.whole_checked`), and do not check the dispatch inputs (`_Headers` in
dispatch/all_to_all.py: the eager steps do). Its GEMMs read the weights' persistent FP8 copies
(moefp8.weight_copy: made before the capture, in the warm-up, and written by the optimizer after each
step), so every replay reads the weights as they are then. The
router's bias is updated in place outside the graph, which reads it where it lives. Where every block is
captured whole at EP = 1 (`stackable`), the stack of blocks is one callable (`_Stack`) and the model replays one
graph each way (`Transformer.graphed_stack`, `replays_stack`): a graph per block copied each block's input, and
backward its output gradient, into the next graph's static buffers (~2 ms and 6.5 GiB of the 3B step).

Gradients: a replayed backward writes the weights' gradients into the graph's own buffers, which
autograd then hands to `.grad` as they are (no copy) where `.grad` is None. They stay valid until the
next replay of the same block, i.e. for one micro-batch: with train.grad_accum > 1 on one process the
second micro-batch would overwrite the first one's, so the training loop calls `prepare_grads` (zeros
in `.grad`) before each such step; the data-parallel gradient buckets already make every `.grad` a view of
their own buffers, which autograd adds into.
"""

import gc

import torch
from torch import Tensor, nn

from moefp8.accum import armed, main_grad
from moefp8.kernels.rope import rope_tables


class _Whole(nn.Module):
    """A block whole (its attention and its MLP or MoE layer) for `make_graphed_callables`: x -> (x + a + o,
    whether a / o hold a NaN/Inf[, the MoE layer's load_E][, its aux_loss]) (`Block.whole_checked`)."""

    def __init__(self, block):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = block.attn_norm, block.attn, block.mlp_norm, block.mlp
        self._block = (block,)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, ...]:
        return self._block[0].whole_checked(x, cos, sin)


def whole_capturable(block) -> bool:
    """Whether a block's MLP can be captured with its attention: a dense MLP, or a MoE layer in the plain
    schedule with moefp8's experts (megablocks' dMoE sizes its buffers from the routing on the host) where
    nothing syncs the host: one that exchanges no rows (EP = 1: its layout takes the static bound), or
    one whose exchanges have fixed sizes and whose layouts are capped (dispatch.rows_factor). With
    dispatch.shared_overlap the capture holds the side stream too: the exchange forks from the capturing
    stream (`side.wait_stream`) and joins it before the layout (`moe_stages._join`)."""
    if not block.is_moe:
        return True
    moe = block.mlp
    if moe.overlap is not None or moe.megablocks is not None:
        return False
    return not moe.dispatcher.communicates or (moe.row_cap.factor > 0 and moe.dispatcher.static_exchange(moe.topk))


class _Attend(nn.Module):
    """A block's attention as a module of its own for `make_graphed_callables` (which graphs a module
    with its parameters): x -> (x + attention, the MLP's input, whether the attention output holds a
    NaN/Inf). Not registered under the block (the parameters stay the block's)."""

    def __init__(self, block):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm = block.attn_norm, block.attn, block.mlp_norm
        self._block = (block,)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self._block[0].attend_checked(x, cos, sin)


class _Stack(nn.Module):
    """Every block whole, in order, as one callable for `make_graphed_callables`: x -> (the last block's
    output, then each block's `whole_checked` flags and extras in order). One graph each way for the
    whole stack: no block's input or output gradient copied into the next graph's buffers, two launches."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, ...]:
        extra = []
        for b in self.blocks:
            x, *rest = b.whole_checked(x, cos, sin)
            extra += rest
        return (x, *extra)


def stackable(model, halves: tuple[int, int] | None) -> bool:
    """Whether train.cuda_graphs_mlp captures the blocks as one graph (`_Stack`, `Transformer.graphed_stack`):
    every block whole-capturable and none recomputing its attention, no overlap halves, and no exchanges
    (under EP the capped layouts' overflow flags go block by block to `RowCap`)."""
    return (halves is None and not model.dispatcher.communicates
            and all(not b.recompute_attention and whole_capturable(b) for b in model.layers))


def graph_attention(model, batch: int, seq_len: int, warmup: int = 2, halves: tuple[int, int] | None = None,
                    overlap_only: bool = False, mlp: bool = False) -> int:
    """Captures the attention of every block of `model` (a `moefp8.model.Transformer` on a CUDA device)
    that does not recompute it, for micro-batches of [batch, seq_len] tokens (`Block.graphed_attend`);
    returns how many blocks replay graphs. halves: the sequences of the two micro-batch overlap's
    halves (moefp8.overlap.halves of batch): each MoE block's attention is captured for them too,
    one graph per half (`Block.graphed_halves`, which `OverlappedBlock` replays: a graph's outputs
    live in its own buffers, and A's must outlive B's replay). overlap_only: the MoE blocks always
    run overlapped (dispatch.overlap=true), so they get the halves' graphs only. mlp (train.cuda_graphs_mlp):
    the blocks where `whole_capturable` holds are captured whole instead (`Block.graphed_whole`), and where
    every block is (`stackable`) the stack of them as one graph (`Transformer.graphed_stack`). All in one
    `make_graphed_callables` call (one memory pool): its order, the forwards as listed and the
    backwards reversed, is the step's, whole or split (A then B forward, B then A backward). Call it
    after the weights have their final storage (build, checkpoint restore) and before the first
    step; the FP8 statistics must be off."""
    blocks = [b for b in model.layers if not b.recompute_attention]
    if not blocks:
        return 0
    dev = next(model.parameters()).device
    cos, sin = rope_tables(seq_len, model.cfg.head_dim, model.cfg.rope_theta, dev)
    stack = mlp and stackable(model, halves)
    units = [(_Stack(model.layers), None, batch)] if stack else capture_plan(blocks, batch, halves, overlap_only)
    whole = [mlp and which is None and (stack or whole_capturable(b)) for b, which, _ in units]
    sample = tuple((torch.randn(n, seq_len, model.cfg.hidden, device=dev, dtype=torch.bfloat16,
                                requires_grad=True), cos, sin) for _, _, n in units)
    # whole MoE blocks under EP are captured with their layouts capped (the steps that replay them); the
    # warm-ups' overflow flags are no step's
    capped, model.row_cap.on = model.row_cap.on, True
    # No garbage collection during the capture: freeing an earlier model's graphs (cudaGraphExecDestroy)
    # while a capture is underway invalidates it ("operation failed due to a previous error during
    # capture"; torch's graph context no longer collects first). Collect now, none until it is done.
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        # weights whose gradient accumulates into their main_grad inside the graph (moefp8.accum) give
        # autograd none: "unused" inputs of the captured backward
        graphed = torch.cuda.make_graphed_callables(tuple(b if stack else _Whole(b) if w else _Attend(b)
                                                          for (b, _, _), w in zip(units, whole)),
                                                    sample, num_warmup_iters=warmup,
                                                    allow_unused_input=bool(armed(model)))
    finally:
        if collecting:
            gc.enable()
        model.row_cap.on = capped
        model.row_cap.take()
    for (b, which, n), g, w in zip(units, graphed, whole):
        entry = (g, (n, seq_len, model.cfg.hidden))
        if stack:
            model.graphed_stack = entry
        elif w:
            b.graphed_whole = entry
        elif which is None:
            b.graphed_attend = entry
        else:
            b.graphed_halves = (entry, b.graphed_halves[1]) if which == 0 else (b.graphed_halves[0], entry)
    return len(blocks)


def capture_plan(blocks, batch: int, halves: tuple[int, int] | None, overlap_only: bool) -> list[tuple]:
    """What `graph_attention` captures, in the step's order: (block, None for the whole micro-batch or
    the half 0 / 1, its sequences) per graph."""
    split = halves is not None and min(halves) > 0
    units = []
    for b in blocks:
        if not (split and overlap_only and b.is_moe):
            units.append((b, None, batch))
        if split and b.is_moe:
            units += [(b, 0, halves[0]), (b, 1, halves[1])]
    return units


def replays(block, x: Tensor, half: int | None = None, whole: bool = False) -> bool:
    """Whether `block` runs its captured attention for input x (see the module docstring): the whole
    micro-batch's graph, or with `half` (0 / 1) the overlap's graph of that half; whole: the graph of
    the whole block (attention and MLP, train.cuda_graphs_mlp). The graphs were captured for an input
    that requires grad, with autograd on."""
    g = block.graphed_whole if whole else block.graphed_attend if half is None else block.graphed_halves[half]
    if whole and g is not None and block.is_moe and block.mlp.dispatcher.communicates and not block.mlp.row_cap.on:
        return False  # captured with capped layouts (EP): exact ones run eagerly
    return (g is not None and torch.is_grad_enabled() and tuple(x.shape) == g[1] and x.dtype == torch.bfloat16
            and x.requires_grad and not block.stats.on)


def replays_stack(model, x: Tensor) -> bool:
    """Whether the model runs its blocks as the captured stack (`stackable`) for input x: `replays`' rules."""
    g = model.graphed_stack
    return (g is not None and torch.is_grad_enabled() and tuple(x.shape) == g[1] and x.dtype == torch.bfloat16
            and x.requires_grad and not model.scale_stats.on)


def release(model) -> None:
    """Frees the model's CUDA graphs (their blocks hold them in reference cycles, which only a collection
    frees). Before the process group ends: a graph that holds NCCL collectives (whole MoE blocks under EP)
    must go before its communicator, or destroying the group waits forever (the EP2 runs of session 49)."""
    model.graphed_stack = None
    for b in model.layers:
        b.graphed_attend = b.graphed_whole = None
        b.graphed_halves = (None, None)
    gc.collect()


def keeps_grads(model, grads, grad_accum: int) -> bool:
    """Whether a step must call `prepare_grads` first: one process (no gradient buckets: `grads` None)
    accumulating several micro-batches through graphed blocks, whose replays would otherwise hand the
    same graph buffers to `.grad` twice (the module docstring)."""
    return grads is None and grad_accum > 1 and (model.graphed_stack is not None
                                                 or any(b.graphed_attend or b.graphed_whole for b in model.layers))


def prepare_grads(model) -> None:
    """Zero `.grad` for the graphed blocks' parameters that have none (see the module docstring: one
    process with gradient accumulation)."""
    for b in model.layers:
        if b.graphed_whole is not None or model.graphed_stack is not None:
            params = b.parameters()
        elif b.graphed_attend is not None:  # (the halves' gradients come back through OverlappedBlock: summed)
            params = (*b.attn_norm.parameters(), *b.attn.parameters(), *b.mlp_norm.parameters())
        else:
            continue
        for p in params:
            if p.grad is None and main_grad(p) is None:  # (moefp8.accum: summed in its own buffer)
                p.grad = torch.zeros_like(p)
