"""The model's one dense SwiGLU MLP, `MLP`: the first n_dense_layers' MLP and the MoE layer's shared
experts (every token, no routing). silu(x·W1_gateᵀ) * (x·W1_upᵀ) · W2ᵀ with W1 [2I, H] (gate rows,
then up) and W2 [H, I], on the routed experts' pipeline with dense GEMMs (moefp8.experts with
off=None; docs/design.md §1, §2):

* FP8: x quantized row-wise (fc1's operand; the MoE layer's shared experts reuse its dispatch's)
  and requantized col-wise (fc1's wgrad operand), dy likewise; h cached in FP8 and the SwiGLU
  recomputed from it in backward (fused kernels); the FP8 weights (and their transposes for dgrad)
  cached per optimizer step (`WeightCache`: the micro-batches of one step share them).
* BF16: the BF16 grouped-MLP path (BF16 GEMMs, fp32 weight gradients; fp32 math on CPU).

`mlp_forward` / `mlp_backward` are the stages the overlapped schedule (moefp8.overlap) calls on its
halves; `MLP.forward` is their autograd around a whole batch.
"""

import torch
from torch import Tensor, nn

from moefp8.experts import WeightCache, bf16_mlp_backward, bf16_mlp_forward, fp8_mlp_backward, fp8_mlp_forward
from moefp8.fp8 import Fp8Tensor, ScaleStats, col_major
from moefp8.kernels.grouped_gemm import GemmPolicy
from moefp8.kernels.quant import requant_colwise
from moefp8.linear import quant_operand


def _given(q8: Fp8Tensor, fmt: str) -> tuple[Fp8Tensor, Fp8Tensor]:
    """A caller's "1x128" quantization (any scale layout) -> (it with the GEMMs' column-major scales,
    its "128x1" copy): what `quant_operand(..., colwise=True)` makes of the same tensor, bit for bit."""
    q8 = Fp8Tensor(q8.data, col_major(q8.scale), "1x128")
    return q8, requant_colwise(q8, fmt)


def mlp_forward(mlp, x_TH: Tensor, w1: Tensor, w2: Tensor, gemm: GemmPolicy,
                x8: Fp8Tensor | None = None) -> tuple[Tensor, tuple]:
    """x [T, H] -> (y [T, H] bf16, what backward needs: FP8 (x "128x1" data, scale, h8 data, scale);
    BF16 (x, None, h, None)). mlp: an `MLP` (its precision, cache and recorder); gemm: the GEMMs that run.
    x8 (FP8 only): x's "1x128" quantization where the caller already made (and recorded) it: the MoE
    layer's shared experts take its dispatch's (one pass over x for both)."""
    fmt = mlp.scale_fmt
    if mlp.fp8:
        x8, x_col = quant_operand(x_TH, fmt, colwise=True, kind="act", stats=mlp.stats) if x8 is None else \
            _given(x8, fmt)
        y, h8, _ = fp8_mlp_forward(x8, None, mlp.cache.get(w1, fmt), mlp.cache.get(w2, fmt), fmt, gemm=gemm,
                                   stats=mlp.stats)
        return y, (x_col.data, x_col.scale, h8.data, h8.scale)
    x = x_TH.to(torch.bfloat16)
    y, h = bf16_mlp_forward(x, None, mlp.cache.get(w1, "bf16"), mlp.cache.get(w2, "bf16"))
    return y, (x, None, h, None)


def mlp_backward(mlp, dy: Tensor, saved: tuple, w1: Tensor, w2: Tensor, want_dx: bool, gemm: GemmPolicy,
                 dy8: Fp8Tensor | None = None):
    """-> (dx [T, H] like dy or None, dW1 [2I, H] fp32, dW2 [H, I] fp32). dy8: as `mlp_forward`'s x8,
    for dy."""
    fmt, (x, xs, h, hs) = mlp.scale_fmt, saved
    if mlp.fp8:
        dy8, dy_col = quant_operand(dy, fmt, colwise=True, kind="grad", stats=mlp.stats) if dy8 is None else \
            _given(dy8, fmt)
        dx, dw1, dw2 = fp8_mlp_backward(dy8, dy_col, Fp8Tensor(x, xs, "128x1"), Fp8Tensor(h, hs, "1x128"), None,
                                        w1, w2, mlp.cache, fmt, want_dx=want_dx, gemm=gemm, stats=mlp.stats)
    else:
        dx, dw1, dw2 = bf16_mlp_backward(dy.to(torch.bfloat16), x, h, None, mlp.cache.get(w1, "bf16"),
                                         mlp.cache.get(w2, "bf16"), want_dx=want_dx)
    return dx.to(dy.dtype) if dx is not None else None, dw1, dw2


class _MLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, mlp):
        y, saved = mlp_forward(mlp, x.reshape(-1, x.shape[-1]), w1, w2, mlp.gemm)
        ctx.save_for_backward(*saved, w1, w2)
        ctx.mlp = mlp
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        *saved, w1, w2 = ctx.saved_tensors
        mlp = ctx.mlp
        dx, dw1, dw2 = mlp_backward(mlp, dy.reshape(-1, dy.shape[-1]).contiguous(), saved, w1, w2,
                                    ctx.needs_input_grad[0], mlp.gemm)
        return dx.view(dy.shape) if dx is not None else None, dw1.to(w1.dtype), dw2.to(w2.dtype), None


class MLP(nn.Module):
    """The dense SwiGLU MLP (module docstring) on x [..., H] -> [..., H] bf16. fp8: FP8 or BF16
    (the dense layers: `Recipe.dense_fp8("dense_mlp")`; the shared experts: `Recipe.fp8`);
    n_shared experts of size I are one MLP of size n_shared * I. scale_fmt: the FP8 scales; stats:
    the recorder its quantizations report to (the model's; None: one of its own, off); gemm:
    which GEMMs run. Weights w1 [2I, H] (gate rows, then up) and w2 [H, I]."""

    def __init__(self, hidden: int, inter: int, fp8: bool, scale_fmt: str = "pow2", stats: ScaleStats | None = None,
                 gemm: GemmPolicy = GemmPolicy()):
        super().__init__()
        self.fp8, self.scale_fmt, self.gemm = fp8, scale_fmt, gemm
        self.stats = stats if stats is not None else ScaleStats()
        self.w1 = nn.Parameter(torch.randn(2 * inter, hidden) * hidden**-0.5)  # [gate | up]
        self.w2 = nn.Parameter(torch.randn(hidden, inter) * inter**-0.5)
        self.cache = WeightCache()

    def forward(self, x: Tensor) -> Tensor:
        return _MLPFunction.apply(x, self.w1, self.w2, self)
