"""The two dense SwiGLU MLPs of the model, side by side: `DenseMLP` (the first n_dense_layers'
MLP) and `SharedExperts` (the MoE layer's shared experts, every token). Both compute
silu(x·W1_gateᵀ) * (x·W1_upᵀ) · W2ᵀ with W1 [2I, H] (gate rows, then up) and W2 [H, I], but not
the same way (docs/design.md §1, §2):

=================  ======================================  =======================================
                   DenseMLP                                SharedExperts
=================  ======================================  =======================================
FP8 forward        two `Fp8Linear`s around a BF16 SwiGLU:  the routed experts' MLP on dense GEMMs
                   a = swiglu(h) rounded to BF16, then     (moefp8.experts, off=None): h cached in
                   quantized by fc2's linear               FP8, a quantized from the fp32 SwiGLU
FP8 backward       BF16 SwiGLU backward from the BF16 h,   fused SwiGLU backward and fc2's wgrad
                   dh quantized by fc1's linear            input recomputed from the FP8 h
FP8 weights        quantized at every call                 cached per optimizer step (WeightCache)
BF16               `Bf16Linear`s (F.linear in BF16)        BF16 grouped-MLP path (fp32 math on CPU)
parameters         w1.weight, w2.weight                    w1, w2
=================  ======================================  =======================================

They stay two classes because merging them changes numerics one way or the other (and the
parameter names, which key the checkpoints and seed the initialization): moving the dense layers
onto the shared experts' pipeline is a recipe change to measure, not a refactor.
"""

import torch
from torch import Tensor, nn

from moefp8.experts import WeightCache, bf16_mlp_backward, bf16_mlp_forward, fp8_mlp_backward, fp8_mlp_forward
from moefp8.fp8 import Fp8Tensor, ScaleStats
from moefp8.kernels.grouped_gemm import GemmPolicy
from moefp8.kernels.swiglu import swiglu_backward_bf16, swiglu_bf16
from moefp8.linear import make_linear, quant_operand
from moefp8.recipe import Recipe


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up of h [..., 2I] BF16 -> [..., I] BF16, fp32 inside: the fused kernels the BF16
    experts use, one pass each way, h saved (the composite of fp32 ops with autograd took ~10
    elementwise kernels over fp32 copies of h)."""

    @staticmethod
    def forward(ctx, h: Tensor) -> Tensor:
        ctx.save_for_backward(h)
        return swiglu_bf16(h.reshape(-1, h.shape[-1])).view(*h.shape[:-1], h.shape[-1] // 2)

    @staticmethod
    def backward(ctx, da: Tensor) -> Tensor:
        (h,) = ctx.saved_tensors
        return swiglu_backward_bf16(h.reshape(-1, h.shape[-1]), da.reshape(-1, da.shape[-1])).view(h.shape)


class DenseMLP(nn.Module):
    """SwiGLU: w1 [2I, H] (gate rows, then up rows) -> silu(gate) * up -> w2 [H, I]; the two linears
    in FP8 where the recipe computes "dense_mlp" in FP8 (`make_linear`), the SwiGLU in BF16."""

    def __init__(self, hidden: int, inter: int, recipe: Recipe, stats: ScaleStats | None = None,
                 gemm: GemmPolicy = GemmPolicy()):
        super().__init__()
        self.w1 = make_linear(hidden, 2 * inter, recipe, "dense_mlp", stats, gemm)
        self.w2 = make_linear(inter, hidden, recipe, "dense_mlp", stats, gemm)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(_SwiGLU.apply(self.w1(x)))


def shared_forward(shared, x_TH: Tensor, w1: Tensor, w2: Tensor, gemm: GemmPolicy) -> tuple[Tensor, tuple]:
    """The shared experts' dense SwiGLU MLP on every token (no routing, no permutation):
    -> (y [T, H] bf16, what backward needs: FP8 (x "128x1" data, scale, h8 data, scale); BF16 (x, None, h, None)).
    FP8: x is quantized row-wise (fc1's operand) and col-wise (fc1's wgrad operand) in one pass.
    shared: a `SharedExperts` (its recipe, cache and recorder); gemm: the GEMMs that run."""
    fmt = shared.recipe.scale_fmt
    if shared.recipe.fp8:
        x8, x_col = quant_operand(x_TH, fmt, colwise=True, kind="act", stats=shared.stats)
        y, h8, _ = fp8_mlp_forward(x8, None, shared.cache.get(w1, fmt), shared.cache.get(w2, fmt), fmt, gemm=gemm,
                                   stats=shared.stats)
        return y, (x_col.data, x_col.scale, h8.data, h8.scale)
    x = x_TH.to(torch.bfloat16)
    y, h = bf16_mlp_forward(x, None, shared.cache.get(w1, "bf16"), shared.cache.get(w2, "bf16"))
    return y, (x, None, h, None)


def shared_backward(shared, dy: Tensor, saved: tuple, w1: Tensor, w2: Tensor, want_dx: bool, gemm: GemmPolicy):
    """-> (dx [T, H] like dy or None, dW1 [2I, H] fp32, dW2 [H, I] fp32)."""
    fmt, (x, xs, h, hs) = shared.recipe.scale_fmt, saved
    if shared.recipe.fp8:
        dy8, dy_col = quant_operand(dy, fmt, colwise=True, kind="grad", stats=shared.stats)
        dx, dw1, dw2 = fp8_mlp_backward(dy8, Fp8Tensor(x, xs, "128x1"), Fp8Tensor(h, hs, "1x128"), None, w1, w2,
                                        shared.cache, fmt, want_dx=want_dx, dy_col=dy_col, gemm=gemm,
                                        stats=shared.stats)
    else:
        dx, dw1, dw2 = bf16_mlp_backward(dy.to(torch.bfloat16), x, h, None, shared.cache.get(w1, "bf16"),
                                         shared.cache.get(w2, "bf16"), want_dx=want_dx)
    return dx.to(dy.dtype) if dx is not None else None, dw1, dw2


class _SharedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w1, w2, shared):
        y, saved = shared_forward(shared, x_TH, w1, w2, shared.gemm)
        ctx.save_for_backward(*saved, w1, w2)
        ctx.shared = shared
        return y

    @staticmethod
    def backward(ctx, dy):
        *saved, w1, w2 = ctx.saved_tensors
        shared = ctx.shared
        dx, dw1, dw2 = shared_backward(shared, dy.contiguous(), saved, w1, w2, ctx.needs_input_grad[0], shared.gemm)
        return dx, dw1.to(w1.dtype), dw2.to(w2.dtype), None


class SharedExperts(nn.Module):
    """Shared experts: a dense SwiGLU MLP every token goes through, with the routed experts' FP8
    recipe (x and h cached in FP8, the fused SwiGLU kernels, FP8 weights cached per optimizer
    step) on dense GEMMs. n_shared experts of size I are one MLP of size n_shared * I.
    Weights [2I, H] (gate rows, then up) and [H, I]. stats: the recorder its quantizations report
    to (the model's; None: one of its own, off); gemm: which GEMMs run."""

    def __init__(self, hidden: int, inter: int, recipe: Recipe, stats: ScaleStats | None = None,
                 gemm: GemmPolicy = GemmPolicy()):
        super().__init__()
        self.recipe, self.gemm = recipe, gemm
        self.stats = stats if stats is not None else ScaleStats()
        self.w1 = nn.Parameter(torch.randn(2 * inter, hidden) * hidden**-0.5)  # [gate | up]
        self.w2 = nn.Parameter(torch.randn(hidden, inter) * inter**-0.5)
        self.cache = WeightCache()

    def forward(self, x_TH: Tensor) -> Tensor:
        return _SharedMLP.apply(x_TH, self.w1, self.w2, self)
