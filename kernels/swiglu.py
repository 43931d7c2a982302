"""SwiGLU backward (FP8 recipe, fused with its quantization) and the BF16 recipe's SwiGLU.

h [M, 2I] = [gate | up]; a = silu(g) * u. With sig = 1 / (1 + exp(-g)):
  dg = da * u * sig * (1 + g * (1 - sig)),   du = da * (g * sig).

* `swiglu_backward_quant(h8, da)`: h8 the cached "1x128" FP8 h, da [M, I] bf16 -> dh as "1x128"
  FP8 [M, 2I] (fc1 dgrad) in one pass over h and da, and its "128x1" copy (data [2I, M], fc1
  wgrad) requantized from those codes by `requant_colwise`.
* `swiglu_bf16(h)`, `swiglu_backward_bf16(h, da)`: the BF16 recipe's fused kernels (its
  like-for-like baseline would otherwise pay for several unfused elementwise passes).

Why two kernels and not one: a kernel making both copies must hold a 128 x 128 tile of dh until
its column amaxes are known. Held in fp32 registers (the kernel until session 52) it ran at 25%
occupancy, latency-bound; held in shared memory (a Gluon try) it lost to bank conflicts
(bench/notes/quant.md, sessions 50-52). The row kernel streams; the requant costs one more read of
the 1-byte codes. With power-of-two scales the "128x1" codes equal those of a direct col-wise
quantization of dh except where a value is subnormal in one of the two (E4M3 keeps its 4
significant bits through a power-of-two rescale).

Math in fp32 with exp(-g) as exp2 (`_sigmoid_denom`), IEEE division and no FMA contraction, in the
order the `_ref` twins use, so GPU results equal the references bit for bit.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from moefp8.fp8 import FP8_DTYPE, TILE, Fp8Tensor, check_scale_fmt
from moefp8.kernels import use_triton
from moefp8.kernels.quant import (LAUNCH, _dequant_rows, _load_rows, _quant_rows_store, _scales, _sigmoid_denom,
                                  _swiglu, quant_rowwise_ref, requant_colwise, requant_colwise_ref, sigmoid_denom_ref,
                                  swiglu_ref)


@triton.jit
def _sigmoid(g):
    return tl.math.div_rn(tl.full(g.shape, 1.0, tl.float32), _sigmoid_denom(g))


@triton.jit
def _swiglu_grad(g, u, da, GATE: tl.constexpr):
    sig = _sigmoid(g)
    if GATE:
        return da * u * sig * (1.0 + g * (1.0 - sig))
    return da * (g * sig)


@triton.jit
def _swiglu_bwd_rows_kernel(h_ptr, hs_ptr, da_ptr, q_ptr, qs_ptr, M, I, stride_hm, stride_hsm, stride_hsg,
                            stride_dam, stride_qm, stride_qsm, stride_qsg, POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """BLOCK_M rows x one 128-column group of I: both halves of dh (the gate's gradient at column
    c, the up's at I + c) from one load of g, u and da, each quantized "1x128" as it is computed."""
    pid_g = tl.program_id(0)
    m0 = tl.program_id(1).to(tl.int64) * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, 128)
    m_left = M - m0
    h = h_ptr + m0 * stride_hm + pid_g * 128
    hs = hs_ptr + m0 * stride_hsm + pid_g * stride_hsg
    g = _dequant_rows(h, hs, offs_m, offs_k, m_left, stride_hm, stride_hsm)
    u = _dequant_rows(h + I, hs + (I // 128) * stride_hsg, offs_m, offs_k, m_left, stride_hm, stride_hsm)
    da = _load_rows(da_ptr + m0 * stride_dam + pid_g * 128, offs_m, offs_k, m_left, 128, stride_dam)
    q = q_ptr + m0 * stride_qm + pid_g * 128
    qs = qs_ptr + m0 * stride_qsm + pid_g * stride_qsg
    # the sigmoid of both calls is one computation (pure ops of the same g: the compiler shares them)
    _quant_rows_store(_swiglu_grad(g, u, da, True), offs_m, offs_k, m_left, q, qs, stride_qm, stride_qsm, POW2)
    _quant_rows_store(_swiglu_grad(g, u, da, False), offs_m, offs_k, m_left, q + I, qs + (I // 128) * stride_qsg,
                      stride_qm, stride_qsm, POW2)


@triton.jit
def _swiglu_bf16_kernel(h_ptr, da_ptr, o_ptr, M, I, stride_hm, stride_dam, stride_om,
                        BACKWARD: tl.constexpr, GATE: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_k = tl.program_id(0)
    m0 = tl.program_id(1).to(tl.int64) * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = pid_k * 128 + tl.arange(0, 128)
    mask = (offs_m < M - m0)[:, None] & (offs_k < I)[None, :]
    h_tile = h_ptr + m0 * stride_hm + offs_m[:, None] * stride_hm + offs_k[None, :]
    g = tl.load(h_tile, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_tile + I, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        da = tl.load(da_ptr + m0 * stride_dam + offs_m[:, None] * stride_dam + offs_k[None, :], mask=mask,
                     other=0.0).to(tl.float32)
        out = _swiglu_grad(g, u, da, GATE)
        col = offs_k + (0 if GATE else I)
    else:
        out = _swiglu(g, u)
        col = offs_k
    tl.store(o_ptr + m0 * stride_om + offs_m[:, None] * stride_om + col[None, :], out, mask=mask)


# ----------------------------------------------------------------------------------------------
# Wrappers


def _check_h(name: str, h_cols: int) -> None:
    if h_cols % (2 * TILE):
        raise ValueError(f"{name}: h has {h_cols} columns, expected 2I with I % {TILE} == 0")


def swiglu_backward_quant(h8: Fp8Tensor, da: Tensor, scale_fmt: str = "pow2", impl: str | None = None, *,
                          colmajor_scale: bool = False, launch: dict | None = None) -> tuple[Fp8Tensor, Fp8Tensor]:
    """h8 "1x128" [M, 2I], da [M, I] bf16 -> (dh "1x128" [M, 2I], dh "128x1": data [2I, M]); the
    "1x128" scales column-major with colmajor_scale (fc1's dgrad operand). The "128x1" copy is
    requantized from the "1x128" codes (`requant_colwise`, as the recipe's other wgrad operands).
    launch: replaces quant.LAUNCH["swiglu_backward_quant"] (the row kernel's) for this call."""
    if not isinstance(h8, Fp8Tensor) or h8.layout != "1x128" or h8.data.dim() != 2:
        raise ValueError("swiglu_backward_quant: expected h8 as an Fp8Tensor [M, 2I] with layout '1x128'")
    M, I2 = h8.data.shape
    _check_h("swiglu_backward_quant", I2)
    if da.shape != (M, I2 // 2):
        raise ValueError(f"swiglu_backward_quant: da has shape {tuple(da.shape)}, expected ({M}, {I2 // 2})")
    pow2 = check_scale_fmt(scale_fmt)
    if not use_triton(h8.data, impl):
        return swiglu_backward_quant_ref(h8, da, scale_fmt, colmajor_scale=colmajor_scale)
    dev = h8.data.device
    q = torch.empty(M, I2, dtype=FP8_DTYPE, device=dev)
    qs = _scales(M, I2 // TILE, dev, colmajor_scale)
    if M:
        da = da if da.stride(-1) == 1 else da.contiguous()
        cfg = launch or LAUNCH["swiglu_backward_quant"]
        _swiglu_bwd_rows_kernel[(I2 // (2 * TILE), triton.cdiv(M, cfg["BLOCK_M"]))](
            h8.data, h8.scale, da, q, qs, M, I2 // 2, h8.data.stride(0), h8.scale.stride(0), h8.scale.stride(1),
            da.stride(0), q.stride(0), qs.stride(0), qs.stride(1), POW2=pow2, enable_fp_fusion=False, **cfg)
    row = Fp8Tensor(q, qs, "1x128")
    return row, requant_colwise(row, scale_fmt, impl)


def swiglu_bf16(h: Tensor, impl: str | None = None) -> Tensor:
    """h [M, 2I] (any even width) -> a = silu(gate) * up [M, I] bf16 (computed in fp32)."""
    if not use_triton(h, impl):
        return swiglu_ref(h).to(torch.bfloat16)
    M, I = h.shape[0], h.shape[1] // 2
    out = torch.empty(M, I, dtype=torch.bfloat16, device=h.device)
    if M:
        h = h if h.stride(-1) == 1 else h.contiguous()
        _swiglu_bf16_kernel[(triton.cdiv(I, TILE), triton.cdiv(M, 16))](h, h, out, M, I, h.stride(0), 0, out.stride(0),
                                                             BACKWARD=False, GATE=True, BLOCK_M=16, num_warps=4)
    return out


def swiglu_backward_bf16(h: Tensor, da: Tensor, impl: str | None = None) -> Tensor:
    """h [M, 2I] (any even width), da [M, I] -> dh [M, 2I] bf16 (computed in fp32)."""
    if not use_triton(h, impl):
        return swiglu_backward_ref(h.float(), da).to(torch.bfloat16)
    M, I = h.shape[0], h.shape[1] // 2
    out = torch.empty(M, 2 * I, dtype=torch.bfloat16, device=h.device)
    if M:
        h = h if h.stride(-1) == 1 else h.contiguous()
        da = da if da.stride(-1) == 1 else da.contiguous()
        for gate in (True, False):
            _swiglu_bf16_kernel[(triton.cdiv(I, TILE), triton.cdiv(M, 16))](h, da, out, M, I, h.stride(0), da.stride(0),
                                                                 out.stride(0), BACKWARD=True, GATE=gate, BLOCK_M=16,
                                                                 num_warps=4, enable_fp_fusion=False)
    return out


# ----------------------------------------------------------------------------------------------
# References: the kernels' formulas, in the same order, in fp32


def swiglu_backward_ref(h: Tensor, da: Tensor) -> Tensor:
    """h [M, 2I] fp32, da [M, I] -> dh [M, 2I] fp32."""
    g, u = h.float().chunk(2, dim=-1)
    da = da.float()
    sig = torch.ones_like(g) / sigmoid_denom_ref(g)  # a tensor numerator: an IEEE division on CUDA too
    dg = da * u * sig * (1.0 + g * (1.0 - sig))
    du = da * (g * sig)
    return torch.cat([dg, du], dim=-1)


def swiglu_backward_quant_ref(h8: Fp8Tensor, da: Tensor, scale_fmt: str = "pow2", *,
                              colmajor_scale: bool = False) -> tuple[Fp8Tensor, Fp8Tensor]:
    row = quant_rowwise_ref(swiglu_backward_ref(h8.dequantize(torch.float32), da), scale_fmt,
                            colmajor_scale=colmajor_scale)
    return row, requant_colwise_ref(row, scale_fmt)
