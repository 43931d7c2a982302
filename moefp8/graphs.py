"""CUDA graphs for the blocks' attention (train.cuda_graphs): fewer host launches per step.

A block's attention (its norm, the QKV projection with its FP8 quantizations, RoPE, flash attention,
the output projection, the residual add and the MLP's input norm: `Block.attend`) has the same shapes
every step, unlike the MoE layer after it (its expert segments and exchanges change with the routing).
`graph_attention` captures each block's attention forward and backward once with torch's
`make_graphed_callables`, all blocks in one call (one memory pool, forwards in order, backwards in
reverse, as the step runs them), and the block replays the graphs instead of launching ~40 kernels
from Python per layer. The numerics are the eager path's: the same kernels replayed.

A block runs its eager path where a replay would be wrong or is not wanted: other shapes (an
evaluation batch, the overlap's half batches), no autograd (evaluation), FP8 statistics being
recorded (a replay would not record them), and blocks that recompute their attention in the
backward (`train.recompute=[attention]`).

Gradients: a replayed backward writes the weights' gradients into the graph's own buffers, which
autograd then hands to `.grad` as they are (no copy) where `.grad` is None. They stay valid until the
next replay of the same block, i.e. for one micro-batch: with train.grad_accum > 1 on one process the
second micro-batch would overwrite the first one's, so the training loop calls `prepare_grads` (zeros
in `.grad`) before each such step; the data-parallel gradient buckets already make every `.grad` a view of
their own buffers, which autograd adds into.
"""

import torch
from torch import Tensor, nn

from moefp8.kernels.rope import rope_tables


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


def graph_attention(model, batch: int, seq_len: int, warmup: int = 2) -> int:
    """Captures the attention of every block of `model` (a `moefp8.model.Transformer` on a CUDA device)
    that does not recompute it, for micro-batches of [batch, seq_len] tokens; returns how many blocks
    replay graphs. Call it after the weights have their final storage (build, checkpoint restore) and
    before the first step; the FP8 statistics must be off."""
    blocks = [b for b in model.layers if not b.recompute_attention]
    if not blocks:
        return 0
    dev = next(model.parameters()).device
    cos, sin = rope_tables(seq_len, model.cfg.head_dim, model.cfg.rope_theta, dev)
    units = tuple(_Attend(b) for b in blocks)
    sample = tuple((torch.randn(batch, seq_len, model.cfg.hidden, device=dev, dtype=torch.bfloat16,
                                requires_grad=True), cos, sin) for _ in units)
    graphed = torch.cuda.make_graphed_callables(units, sample, num_warmup_iters=warmup)
    for b, g in zip(blocks, graphed):
        b.graphed_attend = (g, (batch, seq_len, model.cfg.hidden))
    return len(blocks)


def replays(block, x: Tensor) -> bool:
    """Whether `block` runs its captured attention for input x (see the module docstring)."""
    g = block.graphed_attend
    return (g is not None and torch.is_grad_enabled() and tuple(x.shape) == g[1] and x.dtype == torch.bfloat16
            and not block.stats.on)


def prepare_grads(model) -> None:
    """Zero `.grad` for the graphed blocks' parameters that have none (see the module docstring: one
    process with gradient accumulation)."""
    for b in model.layers:
        if b.graphed_attend is not None:
            for p in (*b.attn_norm.parameters(), *b.attn.parameters(), *b.mlp_norm.parameters()):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
