"""Rotary position embedding (RoPE), fused: one pass reads q (or k) straight out of the attention
projection's output and writes the rotated heads in the layout attention wants.

    rope(x_BSnd, cos, sin) -> [B, nh, S, hd]      x [B, S, nh, hd] any strides (hd contiguous)
    rope_qkv(qkv_BS3nd, cos, sin) -> q, k, v       the attention's q, k rotated, v; d(qkv) in one buffer

Pairs (x[2i], x[2i+1]) rotate by angle[s, i]: (a cos - b sin, a sin + b cos), math in fp32, the
result in x's dtype. The backward is the inverse rotation of the gradient (angle -> -angle),
written as [B, S, nh, hd]: the same kernel with the sign of sin flipped and the strides swapped.

Unfused, the model's fp32 RoPE on the strided q/k views ran as ~26 elementwise kernels per layer
(stack, neg, mul, copies; 20 ms of a 119 ms step of the small model on an H200). `rope_ref` is
that composition (torch autograd gives its backward); `rope` runs the Triton kernel on CUDA.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from moefp8.fp8 import FP8_DTYPE, TILE, Fp8Tensor, check_scale_fmt
from moefp8.kernels import use_triton
from moefp8.kernels.quant import _abs_nan0, _scale_from_amax, _to_fp8, quant_rowwise_ref


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, o_ptr, os_ptr, S, stride_xb, stride_xs, stride_xh, stride_ob, stride_os,
                 stride_oh, stride_osb, stride_oss, stride_osh, HALF: tl.constexpr, INVERSE: tl.constexpr,
                 ROTATE: tl.constexpr, QUANT: tl.constexpr, POW2: tl.constexpr, BLOCK_S: tl.constexpr):
    """Grid (cdiv(S, BLOCK_S), nh, B): BLOCK_S positions of one head. cos/sin [S, HALF] fp32.
    Each head row is read and written whole (contiguous, vectorized) and split into its (even, odd)
    pairs in registers: loading the evens and the odds as two stride-2 streams and storing them the
    same way ran ~8x below the memory bandwidth (0.53 ms per call on the small model). ROTATE
    False: the rows copied as they are (dv into d(qkv): torch's copy_ between these strides ran
    non-vectorized, ~3x the bandwidth's time). QUANT (head_dim 128): each output row quantized "1x128"
    as it is stored, from the fp32 values: FP8 codes into o, one scale per row at os_ptr + b * stride_osb +
    s * stride_oss + h * stride_osh (the FP8 QKV projection's dgrad / wgrad operand)."""
    s0 = tl.program_id(0) * BLOCK_S
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_s = s0 + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, 2 * HALF)
    offs_p = tl.arange(0, HALF)
    mask = (offs_s < S)[:, None]
    x = x_ptr + b * stride_xb + h * stride_xh + offs_s[:, None].to(tl.int64) * stride_xs + offs_d[None, :]
    y = tl.load(x, mask=mask, other=0.0)
    if ROTATE:
        a, c = tl.split(tl.reshape(y.to(tl.float32), (BLOCK_S, HALF, 2)))
        t = offs_s[:, None] * HALF + offs_p[None, :]
        cos = tl.load(cos_ptr + t, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + t, mask=mask, other=0.0)
        if INVERSE:
            y0 = a * cos + c * sin
            y1 = c * cos - a * sin
        else:
            y0 = a * cos - c * sin
            y1 = a * sin + c * cos
        y = tl.reshape(tl.join(y0, y1), (BLOCK_S, 2 * HALF))
    o = o_ptr + b * stride_ob + h * stride_oh + offs_s[:, None].to(tl.int64) * stride_os + offs_d[None, :]
    if QUANT:
        y = y.to(tl.float32)
        scale, inv = _scale_from_amax(tl.max(_abs_nan0(y), axis=1), POW2)
        tl.store(o, _to_fp8(y, scale[:, None], inv[:, None], POW2), mask=mask)
        tl.store(os_ptr + b * stride_osb + h * stride_osh + offs_s.to(tl.int64) * stride_oss, scale, mask=offs_s < S)
    else:
        tl.store(o, y.to(o_ptr.dtype.element_ty), mask=mask)


def _launch(x_BSnd: Tensor, cos: Tensor, sin: Tensor, out_BSnd: Tensor, inverse: bool, rotate: bool = True,
            scales_BSn: Tensor | None = None, pow2: bool = True) -> None:
    """scales_BSn: out is FP8, quantized "1x128" by head rows, their scales written here (any strides)."""
    B, S, nh, hd = x_BSnd.shape
    if B and S and nh:
        BLOCK_S = 32
        st = scales_BSn.stride() if scales_BSn is not None else (0, 0, 0)
        _rope_kernel[(triton.cdiv(S, BLOCK_S), nh, B)](
            x_BSnd, cos, sin, out_BSnd, scales_BSn if scales_BSn is not None else cos, S, x_BSnd.stride(0),
            x_BSnd.stride(1), x_BSnd.stride(2), out_BSnd.stride(0), out_BSnd.stride(1), out_BSnd.stride(2), *st,
            HALF=hd // 2, INVERSE=inverse, ROTATE=rotate, QUANT=scales_BSn is not None, POW2=pow2, BLOCK_S=BLOCK_S,
            num_warps=4,
            enable_fp_fusion=False)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BSnd: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        out = torch.empty(x_BSnd.shape, dtype=x_BSnd.dtype, device=x_BSnd.device)
        _launch(x_BSnd, cos, sin, out, inverse=False)
        ctx.save_for_backward(cos, sin)
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, dout: Tensor):
        dx = torch.empty(dout.transpose(1, 2).shape, dtype=dout.dtype, device=dout.device)
        _rotate_back(dout, *ctx.saved_tensors, dx)
        return dx, None, None


def _rotate_back(dout_BnSd: Tensor, cos: Tensor, sin: Tensor, out_BSnd: Tensor, scales_BSn: Tensor | None = None,
                 pow2: bool = True) -> None:
    """The backward of a rotation: dout [B, nh, S, hd] (any strides) rotated back into out [B, S, nh, hd]
    (FP8 with scales_BSn: see `_launch`)."""
    d = dout_BnSd.transpose(1, 2)  # [B, S, nh, hd] view
    _launch(d if d.stride(-1) == 1 else d.contiguous(), cos, sin, out_BSnd, inverse=True, scales_BSn=scales_BSn,
            pow2=pow2)


def _rope_qkv_forward(qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    B, S, _, nh, hd = qkv.shape
    qk = torch.empty(2, B, S, nh, hd, dtype=qkv.dtype, device=qkv.device)
    _launch(qkv[:, :, 0], cos, sin, qk[0], inverse=False)
    _launch(qkv[:, :, 1], cos, sin, qk[1], inverse=False)
    return qk[0].transpose(1, 2), qk[1].transpose(1, 2), qkv[:, :, 2]


class _RopeQKV(torch.autograd.Function):
    """qkv [B, S, 3, nh, hd] -> (rope(q), rope(k), v); the backward writes d(qkv) whole: the inverse
    rotations straight into its q and k slots and dv copied into the third (the same kernel), where autograd's
    backward of unbind stacked three separate gradients (a full extra pass over d(qkv))."""

    @staticmethod
    def forward(ctx, qkv: Tensor, cos: Tensor, sin: Tensor):
        ctx.save_for_backward(cos, sin)
        return _rope_qkv_forward(qkv, cos, sin)

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor):
        B, nh, S, hd = dq.shape
        dqkv = torch.empty(B, S, 3, nh, hd, dtype=dq.dtype, device=dq.device)
        _rotate_back(dq, *ctx.saved_tensors, dqkv[:, :, 0])
        _rotate_back(dk, *ctx.saved_tensors, dqkv[:, :, 1])
        _launch(dv if dv.stride(-1) == 1 else dv.contiguous(), *ctx.saved_tensors, dqkv[:, :, 2], inverse=False,
                rotate=False)
        return dqkv, None, None


def _check(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"rope: expected x [B, S, n_heads, head_dim] with an even head_dim, got {tuple(x.shape)}")
    want = (x.shape[1], x.shape[-1] // 2)
    if tuple(cos.shape) != want or tuple(sin.shape) != want:
        raise ValueError(f"rope: cos/sin must be [S, head_dim/2] = {list(want)}, got {list(cos.shape)} "
                         f"and {list(sin.shape)}")


def _tables(hd: int, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """cos/sin as the kernel reads them (fp32, contiguous); its power-of-two head_dim checked."""
    if hd & (hd - 1):
        raise ValueError(f"rope: the Triton kernel needs a power-of-two head_dim, got {hd}")
    return cos.float().contiguous(), sin.float().contiguous()


def rope(x_BSnd: Tensor, cos: Tensor, sin: Tensor, impl: str | None = None) -> Tensor:
    """x [B, S, nh, hd] (e.g. a slice of the [B, S, 3, nh, hd] qkv projection), cos/sin [S, hd/2]
    fp32 -> rotated [B, nh, S, hd] in x's dtype, a view of a [B, S, nh, hd] buffer (heads-last: the
    memory layout SDPA then keeps for its output); differentiable. head_dim a power of two on the
    Triton path."""
    _check(x_BSnd, cos, sin)
    if not use_triton(x_BSnd, impl):
        return rope_ref(x_BSnd, cos, sin)
    cos, sin = _tables(x_BSnd.shape[-1], cos, sin)
    return _Rope.apply(x_BSnd if x_BSnd.stride(-1) == 1 else x_BSnd.contiguous(), cos, sin)


def rope_qkv(qkv_BS3nd: Tensor, cos: Tensor, sin: Tensor, impl: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The attention projection's output [B, S, 3, nh, hd] -> (rope(q), rope(k), v): q and k as
    `rope` gives them ([B, nh, S, hd] views of heads-last buffers), v the [B, S, nh, hd] view of its
    slice; differentiable, with d(qkv) written in one buffer (no stack of three gradients)."""
    if qkv_BS3nd.dim() != 5 or qkv_BS3nd.shape[2] != 3:
        raise ValueError(f"rope_qkv: expected qkv [B, S, 3, n_heads, head_dim], got {tuple(qkv_BS3nd.shape)}")
    q, k, v = qkv_BS3nd.unbind(2)
    _check(q, cos, sin)
    if not use_triton(q, impl):
        return rope_ref(q, cos, sin), rope_ref(k, cos, sin), v
    cos, sin = _tables(q.shape[-1], cos, sin)
    return _RopeQKV.apply(qkv_BS3nd if qkv_BS3nd.stride(-1) == 1 else qkv_BS3nd.contiguous(), cos, sin)


def rope_qkv_forward(qkv_BS3nd: Tensor, cos: Tensor, sin: Tensor, impl: str | None = None) -> tuple[Tensor, Tensor,
                                                                                                  Tensor]:
    """`rope_qkv`'s outputs without autograd (for an autograd Function that owns the backward:
    `moefp8.linear.Fp8QKVRopeFunction`)."""
    q = qkv_BS3nd[:, :, 0]
    _check(q, cos, sin)
    if not use_triton(q, impl):
        return rope_ref(q, cos, sin), rope_ref(qkv_BS3nd[:, :, 1], cos, sin), qkv_BS3nd[:, :, 2]
    cos, sin = _tables(q.shape[-1], cos, sin)
    return _rope_qkv_forward(qkv_BS3nd if qkv_BS3nd.stride(-1) == 1 else qkv_BS3nd.contiguous(), cos, sin)


def rope_qkv_backward_quant(dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor, scale_fmt: str = "pow2",
                            impl: str | None = None) -> Fp8Tensor:
    """The backward of `rope_qkv` (dq, dk [B, nh, S, hd], dv [B, S, nh, hd], any strides) quantized as it
    is written: d(qkv) as "1x128" FP8 [B*S, 3*nh*hd] with column-major scales (the QKV projection's
    dgrad operand; head_dim 128: one group a head row). Where a BF16 d(qkv) would be written and read
    back by `quant_rowwise`; the groups are quantized from the fp32 rotations (no BF16 rounding)."""
    B, nh, S, hd = dq.shape
    if hd != TILE:
        raise ValueError(f"rope_qkv_backward_quant: head_dim must be {TILE} (one 1x128 group a head row), got {hd}")
    pow2 = check_scale_fmt(scale_fmt)
    if not use_triton(dq, impl):
        return rope_qkv_backward_quant_ref(dq, dk, dv, cos, sin, scale_fmt)
    cos, sin = _tables(hd, cos, sin)
    data = torch.empty(B, S, 3, nh, hd, dtype=FP8_DTYPE, device=dq.device)
    scales = torch.empty(3 * nh, B * S, dtype=torch.float32, device=dq.device)  # [T, 3 nh] column-major
    sc = scales.view(3, nh, B, S).permute(2, 3, 0, 1)  # [B, S, 3, nh]
    _rotate_back(dq, cos, sin, data[:, :, 0], sc[:, :, 0], pow2)
    _rotate_back(dk, cos, sin, data[:, :, 1], sc[:, :, 1], pow2)
    _launch(dv if dv.stride(-1) == 1 else dv.contiguous(), cos, sin, data[:, :, 2], inverse=False, rotate=False,
            scales_BSn=sc[:, :, 2], pow2=pow2)
    return Fp8Tensor(data.view(B * S, 3 * nh * hd), scales.t(), "1x128")


def rope_qkv_backward_quant_ref(dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor,
                                scale_fmt: str = "pow2") -> Fp8Tensor:
    """The kernel's inverse rotations (fp32, its order of operations), dv as it is, quantized "1x128"."""
    def back(d):  # [B, nh, S, hd] -> [B, S, nh, hd] fp32
        x32 = d.float().unflatten(-1, (-1, 2))
        a, c = x32[..., 0], x32[..., 1]
        return torch.stack((a * cos + c * sin, c * cos - a * sin), dim=-1).flatten(-2).transpose(1, 2)

    dqkv = torch.stack((back(dq), back(dk), dv.float()), dim=2)  # [B, S, 3, nh, hd]
    B, S, _, nh, hd = dqkv.shape  # (the width named: a -1 is ambiguous for a batch of no tokens)
    return quant_rowwise_ref(dqkv.reshape(B * S, 3 * nh * hd), scale_fmt, colmajor_scale=True)


def rope_ref(x_BSnd: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The same rotation composed of torch ops (fp32 math), [B, nh, S, hd] in x's dtype."""
    x32 = x_BSnd.transpose(1, 2).float().unflatten(-1, (-1, 2))
    a, b = x32[..., 0], x32[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x_BSnd.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[Tensor, Tensor]:
    """cos, sin [S, head_dim/2] fp32 for rotating pairs (x[2i], x[2i+1])."""
    inv = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv)
    return ang.cos(), ang.sin()


__all__ = ["rope", "rope_qkv", "rope_qkv_backward_quant", "rope_qkv_backward_quant_ref", "rope_qkv_forward", "rope_ref",
           "rope_tables"]
