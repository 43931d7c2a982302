"""Gradient accumulation inside the routed experts' wgrad GEMMs (Megatron's gradient accumulation
fusion), for train.grad_accum > 1 where no other rank sums the experts' gradients.

Without it, every micro-batch's expert gradient (fp32 [E, N, K], written by its wgrad GEMM) is added
into `.grad` by autograd in a pass of its own: 12 bytes a weight (read both, write one), and under CUDA
graphs the same for every parameter a graph hands back (moefp8.graphs.prepare_grads). On the 3B preset
(one H200) those adds took ~10 ms of each ~295 ms micro-batch in both recipes (bench/notes/scale.md,
session 64). With it, each routed expert weight carries a persistent fp32 `main_grad` (`arm`, at build,
before any capture); the backward accumulates into it inside the GEMM (FP8: the k-grouped kernel adds
the tile it made to the one it reads; BF16: `_grouped_mm`'s product added into it in one pass) and
gives autograd no gradient for the weight (`linear.Fp8Linear` takes `main_grad` the same way). The
loop zeroes the buffers before a step's first micro-batch (`zero`) and hands them to `.grad` after its
last (`to_grad`), for the gradient norm and the optimizer. The same bits as autograd's accumulation
from zeros: each micro-batch's dW is made as before and added once in fp32.

Where: the routed experts of the plain schedule (`moe_stages.RoutedExperts`; the two micro-batch overlap
and megablocks' experts hand theirs to autograd) where no rank shares their gradient: one process, or
expert parallelism over every rank (dispatch.ep_size = world: `grad_sync.GradBuckets` keeps them out of
its buckets, whose reductions autograd's hooks start). ~85% of the 3B preset's weights, ~73% of a 16B EP4
rank's.
"""

import torch
from torch import Tensor


def main_grad(weight: Tensor) -> Tensor | None:
    """The fp32 buffer a weight's wgrad GEMM accumulates into (Megatron's `main_grad`: `arm`, or the caller's
    own), else None: autograd takes the weight's gradient."""
    mg = getattr(weight, "main_grad", None)
    return mg if isinstance(mg, Tensor) and mg.dtype == torch.float32 else None


def armed(model) -> list[Tensor]:
    """The parameters that carry a `main_grad` (`arm`)."""
    return [p for p in model.parameters() if main_grad(p) is not None]


def arm(model, grad_accum: int, experts_alone: bool) -> int:
    """Gives the routed experts' weights of the plain schedule their fp32 `main_grad` (zeros) where the
    fusion applies (module docstring): grad_accum > 1, and experts_alone (no other rank sums their
    gradient: one process, or dispatch.ep_size = world). -> how many weights got one. Before
    `graphs.cuda_graphs`: a capture records the accumulation into these buffers."""
    if grad_accum <= 1 or not experts_alone:
        return 0
    n = 0
    for b in model.layers:
        moe = b.mlp if b.is_moe else None
        if moe is None or moe.overlap is not None or moe.megablocks is not None:
            continue
        for w in (moe.w1, moe.w2):
            if w.requires_grad and main_grad(w) is None:
                w.main_grad = torch.zeros_like(w, dtype=torch.float32)
                n += 1
    return n


def zero(params: list[Tensor]) -> None:
    """Before a step's first micro-batch: the buffers hold the last step's sums (or a capture's warm-up)."""
    if params:
        torch._foreach_zero_([p.main_grad for p in params])


def to_grad(params: list[Tensor]) -> None:
    """After a step's last micro-batch, before the gradient buckets finish: each buffer becomes its
    weight's `.grad` (the optimizer's `zero_grad` lets go of it again). A gradient autograd gave the
    weight anyway (a path that does not take `main_grad`) is added in rather than lost."""
    for p in params:
        if p.grad is not None and p.grad is not p.main_grad:
            p.main_grad.add_(p.grad)
        p.grad = p.main_grad
