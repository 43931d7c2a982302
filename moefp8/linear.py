"""The dense linear layers (docs/design.md §1): `Fp8Linear`, autograd over the blockwise FP8 GEMMs, and
`Bf16Linear`, the baseline; `make_linear` picks one from the recipe.

`Fp8Linear` computes y = x · Wᵀ with the DeepSeek-V3 recipe:

* forward: x [.., K] bf16 -> "1x128" FP8; W (fp32 master or bf16) -> "128x128" FP8; fprop GEMM
  -> BF16. Saved for backward: x col-wise ("128x1", requantized from the row-wise FP8 values,
  `quant_rowwise_colwise`: 1 byte per element instead of the bf16 input) and
  the FP8 weight's transpose for dgrad, made in the weight's quantization pass (`quant_weight(transposed=True)`):
  the persistent copy kept on the weight, which the optimizer refreshes (moefp8.weight_copy).
* backward: dY -> "1x128" FP8 -> dgrad GEMM (BF16 dX) and, in the same pass, -> "128x1" ->
  wgrad GEMM with the saved x (FP32 dW). If the weight carries an fp32 ``main_grad`` tensor
  (Megatron style), the wgrad accumulates into it inside the GEMM and the weight gets no ``.grad``.

K and N must be multiples of 128 (the quantization tiles); x may have any number of rows. The
experts' linears are not built from these: their MLP (moefp8.experts) runs the grouped GEMMs.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moefp8.accum import main_grad
from moefp8.fp8 import TILE, Fp8Tensor, ScaleStats
from moefp8.kernels.gemm import fp8_gemm
from moefp8.kernels.grouped_gemm import GemmPolicy
from moefp8.kernels.norm import rms_norm_bwd, rms_norm_quant_fwd
from moefp8.kernels.quant import quant_rowwise, quant_rowwise_colwise, quant_weight, requant_colwise
from moefp8.kernels.rope import rope_qkv_backward_quant, rope_qkv_forward
from moefp8.recipe import Recipe
from moefp8.weight_copy import bf16_of, copy_of

HAS_OUT_DTYPE = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 8)  # mm/addmm's out_dtype (CUDA)


def _check_dims(name: str, N: int, K: int) -> None:
    if K % TILE or N % TILE:
        raise ValueError(f"{name}: in_features={K} and out_features={N} must both be divisible by {TILE}")


def quant_operand(x2: Tensor, scale_fmt: str, colwise: bool, kind: str,
                  stats: ScaleStats) -> tuple[Fp8Tensor, Fp8Tensor | None]:
    """A GEMM operand [M, K] -> ("1x128" with the GEMMs' column-major scales, its "128x1" copy for
    the wgrad GEMM when `colwise`, else None); recorded in `stats` as kind ("act" | "grad")."""
    if colwise:
        q, qc = quant_rowwise_colwise(x2, scale_fmt)
    else:
        q, qc = quant_rowwise(x2, scale_fmt, colmajor_scale=True), None
    return stats.record(kind, q), qc


def _fp8_linear_forward(ctx, x: Tensor, weight: Tensor, scale_fmt: str, stats: ScaleStats,
                        gemm: GemmPolicy, quantized: tuple | None = None) -> tuple[Tensor, tuple]:
    """y = x · wᵀ in FP8 -> (y [..., N] bf16, the tensors its backward needs); ctx gets the rest.
    quantized: x's operands made already, ("1x128" with column-major scales, its "128x1" copy or None
    where the weight wants no gradient), recorded by the caller; x then only gives the shape."""
    N, K = weight.shape
    _check_dims("Fp8Linear", N, K)
    if x.shape[-1] != K:
        raise ValueError(f"Fp8Linear: input has {x.shape[-1]} features, weight expects in_features={K}")
    x8, xc = quantized if quantized is not None else \
        quant_operand(x.reshape(-1, K), scale_fmt, colwise=weight.requires_grad, kind="act", stats=stats)
    # the weight's persistent copy, which the optimizer refreshes (moefp8.weight_copy); else (a capture
    # without one) quantized here, the dgrad's Wᵀ from the same pass (no transpose kernel in the backward)
    c = copy_of(weight, scale_fmt, transposed=ctx.needs_input_grad[0])
    if c is not None:
        w8, w8t = c.low, (c.low_t if ctx.needs_input_grad[0] else None)
    else:
        w8, w8t = quant_weight(weight, scale_fmt, transposed=True) if ctx.needs_input_grad[0] else \
            (quant_weight(weight, scale_fmt), None)
    y = fp8_gemm(x8, w8, policy=gemm)
    wt = (w8t.data, w8t.scale) if w8t is not None else (None, None)
    ctx.scale_fmt, ctx.stats, ctx.gemm = scale_fmt, stats, gemm
    ctx.x_shape = x.shape
    ctx.w_dtype, ctx.main_grad = weight.dtype, main_grad(weight)
    return y.reshape(*x.shape[:-1], N), (*((xc.data, xc.scale) if weight.requires_grad else (None, None)), *wt)


def _fp8_linear_backward(ctx, saved: tuple, dy8: Fp8Tensor, dy_col: Fp8Tensor | None) -> tuple[Tensor | None,
                                                                                               Tensor | None]:
    """dY as "1x128" (and "128x1" where the weight wants a gradient) -> (dx, dw) of `_fp8_linear_forward`."""
    xc_data, xc_scale, wt_data, wt_scale = saved
    dx = dw = None
    if ctx.needs_input_grad[0]:
        # dX = dY · W = dY · (Wᵀ)ᵀ: the fprop GEMM on the transposed copy (fp8_gemm_dgrad's own path)
        dx = fp8_gemm(dy8, Fp8Tensor(wt_data, wt_scale, "128x128"), policy=ctx.gemm).reshape(ctx.x_shape)
    if ctx.needs_input_grad[1]:
        x_col = Fp8Tensor(xc_data, xc_scale, "128x1")
        if ctx.main_grad is not None:
            fp8_gemm(dy_col, x_col, out=ctx.main_grad, policy=ctx.gemm)
        else:
            dw = fp8_gemm(dy_col, x_col, policy=ctx.gemm).to(ctx.w_dtype)
    return dx, dw


class Fp8LinearFunction(torch.autograd.Function):
    """y = x · wᵀ in FP8. x [..., K] (bf16), w [N, K] (fp32 or bf16) -> y [..., N] bf16."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, scale_fmt: str, stats: ScaleStats, gemm: GemmPolicy) -> Tensor:
        y, saved = _fp8_linear_forward(ctx, x, weight, scale_fmt, stats, gemm)
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        N = dy.shape[-1]
        dy2 = dy.reshape(-1, N)
        if dy2.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            dy2 = dy2.float()
        dy8, dy_col = quant_operand(dy2, ctx.scale_fmt, colwise=ctx.needs_input_grad[1], kind="grad", stats=ctx.stats)
        return (*_fp8_linear_backward(ctx, ctx.saved_tensors, dy8, dy_col), None, None, None)


def _qkv_grad(ctx, dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Fp8Tensor, Fp8Tensor | None]:
    """The QKV functions' output gradients -> d(qkv) "1x128", quantized in the RoPE backward, and its
    "128x1" copy where the weight (input 1) wants a gradient."""
    dy8 = ctx.stats.record("grad", rope_qkv_backward_quant(dq, dk, dv, cos, sin, ctx.scale_fmt))
    return dy8, (requant_colwise(dy8, ctx.scale_fmt) if ctx.needs_input_grad[1] else None)


class Fp8QKVRopeFunction(torch.autograd.Function):
    """The attention's QKV projection and RoPE as one function: x [B, S, K] -> (q, k [B, nh, S, 128]
    rotated, v [B, S, nh, 128]), as `rope_qkv(Fp8LinearFunction(x, w).view(B, S, 3, nh, 128))`, whose
    backward quantizes d(qkv) inside the RoPE backward kernel (`rope_qkv_backward_quant`: head rows
    are the 1x128 groups) instead of writing it in BF16 for `quant_rowwise` to read back."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, n_heads: int, scale_fmt: str,
                stats: ScaleStats, gemm: GemmPolicy):
        y, saved = _fp8_linear_forward(ctx, x, weight, scale_fmt, stats, gemm)
        ctx.save_for_backward(*saved, cos, sin)
        B, S = x.shape[:2]
        return rope_qkv_forward(y.view(B, S, 3, n_heads, -1), cos, sin)

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor):
        *saved, cos, sin = ctx.saved_tensors
        return (*_fp8_linear_backward(ctx, saved, *_qkv_grad(ctx, dq, dk, dv, cos, sin)), None, None, None, None,
                None, None)


class Fp8NormQKVRopeFunction(torch.autograd.Function):
    """RMSNorm, then `Fp8QKVRopeFunction`, as one function: x [B, S, K] (the block's input), the norm's
    weight -> (q, k, v as `Fp8QKVRopeFunction`'s, x again for the residual). The norm's output goes
    straight to FP8 in the norm's pass (`rms_norm_quant_fwd`: the bits of `quant_rowwise` of the BF16
    norm, which is never written nor read back; its r may sit one fp32 step from `rms_norm_split`'s, see
    kernels/norm.py `_normed`); the backward feeds the QKV's dgrad to the norm's
    backward, which adds the residual's gradient in the same pass (as `rms_norm_split`). Inputs in this
    order so that needs_input_grad[0] / [1] are x / the QKV weight, as `_fp8_linear_backward` reads them."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, norm_w: Tensor, eps: float, cos: Tensor, sin: Tensor, n_heads: int,
                scale_fmt: str, stats: ScaleStats, gemm: GemmPolicy):
        B, S, K = x.shape
        x2 = x.reshape(-1, K)
        x8, r = rms_norm_quant_fwd(x2, norm_w, eps, scale_fmt)
        stats.record("act", x8)
        xc = requant_colwise(x8, scale_fmt) if weight.requires_grad else None
        y, saved = _fp8_linear_forward(ctx, x, weight, scale_fmt, stats, gemm, quantized=(x8, xc))
        ctx.save_for_backward(*saved, cos, sin, x2, norm_w, r)
        return (*rope_qkv_forward(y.view(B, S, 3, n_heads, -1), cos, sin), x.view_as(x))

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor, dx_res: Tensor | None):
        *saved, cos, sin, x2, norm_w, r = ctx.saved_tensors
        dn, dw = _fp8_linear_backward(ctx, saved, *_qkv_grad(ctx, dq, dk, dv, cos, sin))
        K = x2.shape[1]
        dx, dnw = rms_norm_bwd(x2, dn.reshape(-1, K), norm_w, r,
                               dx_res.reshape(-1, K) if dx_res is not None else None)
        return dx.view(ctx.x_shape), dw, dnw.to(norm_w.dtype), None, None, None, None, None, None, None


def fuses_norm(wqkv: nn.Module, head_dim: int, norm_fused: bool, x: Tensor) -> bool:
    """Whether the attention's norm runs inside its QKV function (`Fp8NormQKVRopeFunction`): fused norms
    (model.fused_norm), an FP8 QKV with 128-wide heads, CUDA, and x wanting a gradient (training's case;
    the norm's backward needs the QKV's dgrad) or no autograd at all."""
    return (norm_fused and x.is_cuda and isinstance(wqkv, Fp8Linear) and head_dim == TILE
            and (x.requires_grad or not torch.is_grad_enabled()))


class Fp8Linear(nn.Module):
    """Dense linear layer (no bias) computed in FP8; the weight is an fp32 master Parameter
    [out_features, in_features] (or bf16 with ``dtype=torch.bfloat16``). stats: the recorder its
    quantizations report to (a model's; None: one of its own, off); gemm: which GEMMs run."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.float32,
                 device=None, scale_fmt: str = "pow2", stats: ScaleStats | None = None,
                 gemm: GemmPolicy = GemmPolicy()):
        super().__init__()
        _check_dims("Fp8Linear", out_features, in_features)
        self.in_features, self.out_features, self.scale_fmt = in_features, out_features, scale_fmt
        self.stats, self.gemm = stats if stats is not None else ScaleStats(), gemm
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)  # as nn.Linear

    def forward(self, x: Tensor) -> Tensor:
        return Fp8LinearFunction.apply(x, self.weight, self.scale_fmt, self.stats, self.gemm)

    def qkv_rope(self, x: Tensor, cos: Tensor, sin: Tensor, n_heads: int) -> tuple[Tensor, Tensor, Tensor]:
        """This layer as the attention's QKV projection followed by `rope_qkv` (`Fp8QKVRopeFunction`)."""
        return Fp8QKVRopeFunction.apply(x, self.weight, cos, sin, n_heads, self.scale_fmt, self.stats, self.gemm)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scale_fmt={self.scale_fmt}"


def _mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a · b of BF16 operands in fp32: on CUDA one cuBLAS GEMM with an fp32 output (`out_dtype`, torch >=
    2.8), elsewhere the BF16 product cast (what autograd of a BF16 linear and its weight's cast gives)."""
    if a.is_cuda and HAS_OUT_DTYPE:
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


class Bf16LinearFunction(torch.autograd.Function):
    """y = x · wᵀ in BF16: x [..., K], w [N, K] (fp32 master) -> y [..., N] bf16. W in BF16 is the weight's
    copy (moefp8.weight_copy), which the optimizer refreshes; dW comes out of its GEMM in fp32."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        wb = bf16_of(weight)
        xb = x.to(torch.bfloat16)
        ctx.save_for_backward(xb, wb)
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return F.linear(xb, wb)

    @staticmethod
    def backward(ctx, dy: Tensor):
        xb, wb = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1]).to(torch.bfloat16)
        dx = (dy2 @ wb).view(xb.shape).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        dw = _mm_fp32(dy2.t(), xb.reshape(-1, xb.shape[-1])).to(ctx.w_dtype) if ctx.needs_input_grad[1] else None
        return dx, dw


class Bf16Linear(nn.Module):
    """nn.Linear without bias on an fp32 master weight [N, K], computed in BF16 (the baseline)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: Tensor) -> Tensor:
        return Bf16LinearFunction.apply(x, self.weight)


def make_linear(in_features: int, out_features: int, recipe: Recipe, linear: str, stats: ScaleStats | None = None,
                gemm: GemmPolicy = GemmPolicy()) -> nn.Module:
    """The dense linear named `linear` ("wqkv", "wo" or "dense_mlp"): an `Fp8Linear` where the
    recipe computes it in FP8 (`Recipe.dense_fp8`), else a `Bf16Linear`."""
    if recipe.dense_fp8(linear):
        return Fp8Linear(in_features, out_features, scale_fmt=recipe.scale_fmt, stats=stats, gemm=gemm)
    return Bf16Linear(in_features, out_features)
