"""FP8 linear layers (DESIGN.md §1): autograd over the blockwise GEMMs.

`Fp8Linear` (dense) and `fp8_grouped_linear` (experts; the MoE layer composes it) compute
y = x · Wᵀ with the DeepSeek-V3 recipe:

* forward: x [.., K] bf16 -> "1x128" FP8; W (fp32 master or bf16) -> "128x128" FP8; fprop GEMM
  -> BF16. Saved for backward: x col-wise ("128x1", requantized from the row-wise FP8 values by
  the same kernel, `quant_rowwise_colwise`: 1 byte per element instead of the bf16 input) and
  the FP8 weight (for dgrad).
* backward: dY -> "1x128" FP8 -> dgrad GEMM (BF16 dX) and, in the same pass, -> "128x1" ->
  wgrad GEMM with the saved x (FP32 dW). If the weight carries an fp32 ``main_grad`` tensor
  (Megatron style), the wgrad accumulates into it inside the GEMM and the weight gets no ``.grad``.

K and N must be multiples of 128 (the quantization tiles); x may have any number of rows.
"""

import torch
from torch import Tensor, nn

from moefp8.fp8 import SCALE_STATS, TILE, Fp8Tensor
from moefp8.kernels.gemm import fp8_gemm, fp8_gemm_dgrad
from moefp8.kernels.grouped_gemm import fp8_grouped_gemm, fp8_grouped_gemm_wgrad, prepare_offsets
from moefp8.kernels.quant import quant_rowwise, quant_rowwise_colwise, quant_weight


def _check_dims(name: str, N: int, K: int) -> None:
    if K % TILE or N % TILE:
        raise ValueError(f"{name}: in_features={K} and out_features={N} must both be divisible by {TILE}")


def _wgrad_target(weight: Tensor) -> Tensor | None:
    mg = getattr(weight, "main_grad", None)
    return mg if isinstance(mg, Tensor) and mg.dtype == torch.float32 else None


def quant_operand(x2: Tensor, scale_fmt: str, colwise: bool, kind: str) -> tuple[Fp8Tensor, Fp8Tensor | None]:
    """A GEMM operand [M, K] -> ("1x128" with the GEMMs' column-major scales, its "128x1" copy for
    the wgrad GEMM when `colwise`, else None); kind ("act" | "grad") for SCALE_STATS."""
    if colwise:
        q, qc = quant_rowwise_colwise(x2, scale_fmt)
    else:
        q, qc = quant_rowwise(x2, scale_fmt, colmajor_scale=True), None
    return SCALE_STATS.record(kind, q), qc


class Fp8LinearFunction(torch.autograd.Function):
    """y = x · wᵀ in FP8. x [..., K] (bf16), w [N, K] (fp32 or bf16) -> y [..., N] bf16."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, scale_fmt: str = "pow2") -> Tensor:
        N, K = weight.shape
        _check_dims("Fp8Linear", N, K)
        if x.shape[-1] != K:
            raise ValueError(f"Fp8Linear: input has {x.shape[-1]} features, weight expects in_features={K}")
        x2 = x.reshape(-1, K)
        x8, xc = quant_operand(x2, scale_fmt, colwise=weight.requires_grad, kind="act")
        w8 = quant_weight(weight, scale_fmt)
        y = fp8_gemm(x8, w8)
        if weight.requires_grad:
            ctx.save_for_backward(xc.data, xc.scale, w8.data, w8.scale)
        else:
            ctx.save_for_backward(None, None, w8.data, w8.scale)
        ctx.scale_fmt = scale_fmt
        ctx.x_shape = x.shape
        ctx.w_dtype, ctx.main_grad = weight.dtype, _wgrad_target(weight)
        return y.reshape(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, dy: Tensor):
        xc_data, xc_scale, w_data, w_scale = ctx.saved_tensors
        N, K = w_data.shape
        dy2 = dy.reshape(-1, N)
        if dy2.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            dy2 = dy2.float()
        dy8, dy_col = quant_operand(dy2, ctx.scale_fmt, colwise=ctx.needs_input_grad[1], kind="grad")
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = fp8_gemm_dgrad(dy8, Fp8Tensor(w_data, w_scale, "128x128")).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            x_col = Fp8Tensor(xc_data, xc_scale, "128x1")
            if ctx.main_grad is not None:
                fp8_gemm(dy_col, x_col, out=ctx.main_grad)
            else:
                dw = fp8_gemm(dy_col, x_col).to(ctx.w_dtype)
        return dx, dw, None


class Fp8Linear(nn.Module):
    """Dense linear layer (no bias) computed in FP8; the weight is an fp32 master Parameter
    [out_features, in_features] (or bf16 with ``dtype=torch.bfloat16``)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.float32,
                 device=None, scale_fmt: str = "pow2"):
        super().__init__()
        _check_dims("Fp8Linear", out_features, in_features)
        self.in_features, self.out_features, self.scale_fmt = in_features, out_features, scale_fmt
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)  # as nn.Linear

    def forward(self, x: Tensor) -> Tensor:
        return Fp8LinearFunction.apply(x, self.weight, self.scale_fmt)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scale_fmt={self.scale_fmt}"


def fp8_grouped_linear(x: Tensor, weight: Tensor, group_offsets, scale_fmt: str = "pow2",
                       validate: bool = True) -> Tensor:
    """Autograd entry for the experts' linear: x [M, K] bf16 (all local experts' rows, segments
    128-aligned and padded with zeros), weight [E, N, K] (fp32 master or bf16), group_offsets
    int [E+1] (grouped_gemm's contract; validated on the host when validate=True) -> [M, N] bf16.
    Backward: dgrad m-grouped (BF16 dX), wgrad k-grouped (FP32 dW[E, N, K], or accumulated into
    ``weight.main_grad``)."""
    if weight.dim() != 3:
        raise ValueError(f"fp8_grouped_linear: weight must be [E, N, K], got shape {tuple(weight.shape)}")
    E, N, K = weight.shape
    _check_dims("fp8_grouped_linear", N, K)
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"fp8_grouped_linear: x must be [M, {K}], got shape {tuple(x.shape)}")
    off = prepare_offsets(group_offsets, E, x.shape[0], x.device, validate)
    return _GroupedLinear.apply(x, weight, off, scale_fmt)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, off: Tensor, scale_fmt: str) -> Tensor:
        x8, xc = quant_operand(x, scale_fmt, colwise=weight.requires_grad, kind="act")
        w8 = quant_weight(weight, scale_fmt)
        y = fp8_grouped_gemm(x8, w8, off, validate=False)
        if weight.requires_grad:
            ctx.save_for_backward(xc.data, xc.scale, w8.data, w8.scale, off)
        else:
            ctx.save_for_backward(None, None, w8.data, w8.scale, off)
        ctx.scale_fmt = scale_fmt
        ctx.w_dtype, ctx.main_grad = weight.dtype, _wgrad_target(weight)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        xc_data, xc_scale, w_data, w_scale, off = ctx.saved_tensors
        dy8, dy_col = quant_operand(dy.contiguous(), ctx.scale_fmt, colwise=ctx.needs_input_grad[1], kind="grad")
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = fp8_grouped_gemm(dy8, Fp8Tensor(w_data, w_scale, "128x128"), off, transpose_b=True,
                                  validate=False)
        if ctx.needs_input_grad[1]:
            x_col = Fp8Tensor(xc_data, xc_scale, "128x1")
            if ctx.main_grad is not None:
                fp8_grouped_gemm_wgrad(dy_col, x_col, off, out=ctx.main_grad, validate=False)
            else:
                dw = fp8_grouped_gemm_wgrad(dy_col, x_col, off, validate=False).to(ctx.w_dtype)
        return dx, dw, None, None
