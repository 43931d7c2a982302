"""SwiGLU backward (FP8 recipe, fused with both quantizations) and the BF16 recipe's SwiGLU.

h [M, 2I] = [gate | up]; a = silu(g) * u. With sig = 1 / (1 + exp(-g)):
  dg = da * u * sig * (1 + g * (1 - sig)),   du = da * (g * sig).

* `swiglu_backward_quant(h8, da)`: h8 the cached "1x128" FP8 h, da [M, I] bf16 -> dh as "1x128"
  FP8 [M, 2I] (fc1 dgrad) and "128x1" FP8 (data [2I, M], fc1 wgrad), in one pass over h and da.
* `swiglu_bf16(h)`, `swiglu_backward_bf16(h, da)`: the BF16 recipe's fused kernels (its
  like-for-like baseline would otherwise pay for several unfused elementwise passes).

Each program covers 128 rows x 128 columns of one half (gate or up; one launch for both),
which is one 1x128 group per row and one 128x1 group per column, so both quantizations finish in
registers. Math in fp32 with exp(-g) as exp2 (`_sigmoid_denom`), IEEE division and no FMA
contraction, in the order the `_ref` twins use, so GPU results equal the references bit for bit.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from moefp8.fp8 import FP8_DTYPE, TILE, Fp8Tensor, check_scale_fmt
from moefp8.kernels import use_triton
from moefp8.kernels.quant import (LAUNCH, _dequant_rows, _load_rows, _packs, _quant_cols4_store, _quant_rows_store,
                                  _scales, _sigmoid_denom, _swiglu, quant_colwise_ref, quant_rowwise_ref,
                                  sigmoid_denom_ref, swiglu_ref)


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
def _swiglu_grad_rows(h_ptr, hs_ptr, da_ptr, rows, offs_k, m_left, I, gate, stride_hm, stride_hsm, stride_hsg,
                      stride_dam, q_ptr, qs_ptr, stride_qm, stride_qsm, POW2: tl.constexpr):
    """dh for rows `rows` of one 128-column tile (fp32 [len(rows), 128]; pointers at the tile's
    origin: h's gate columns and their scale group, da, dh's "1x128" codes and scales); stores its
    row-wise quantization. Masked rows load 0 and give dh = 0, out of both amaxes."""
    g = _dequant_rows(h_ptr, hs_ptr, rows, offs_k, m_left, stride_hm, stride_hsm)
    u = _dequant_rows(h_ptr + I, hs_ptr + (I // 128) * stride_hsg, rows, offs_k, m_left, stride_hm, stride_hsm)
    da = _load_rows(da_ptr, rows, offs_k, m_left, 128, stride_dam)
    if gate:
        d = _swiglu_grad(g, u, da, True)
    else:
        d = _swiglu_grad(g, u, da, False)
    _quant_rows_store(d, rows, offs_k, m_left, q_ptr, qs_ptr, stride_qm, stride_qsm, POW2)
    return d


@triton.jit
def _swiglu_bwd_quant_kernel(h_ptr, hs_ptr, da_ptr, q_ptr, qs_ptr, c_ptr, cs_ptr, M, I, stride_hm, stride_hsm,
                             stride_hsg, stride_dam, stride_qm, stride_qsm, stride_qsg, stride_ck, stride_csk,
                             stride_csm, POW2: tl.constexpr, PACK: tl.constexpr):
    """One launch for both halves of dh [M, 2I]: programs 0..I/128-1 the gate's gradient, the next
    I/128 the up's. A program covers one 128x128 tile as four interleaved quarters (rows 4i + j,
    as the col-wise quant kernels): rows quantized as they are computed, columns at the end
    (PACK: the transposed store moves 32-bit words, see _quant_cols4_store)."""
    col = tl.program_id(0)  # this tile's 128-column group in dh [M, 2I]
    pid_m = tl.program_id(1)
    G = I // 128
    gate = col < G
    pid_k = col - tl.where(gate, 0, G)  # the 128 columns of h's gate (and up) halves this tile reads
    m0 = pid_m.to(tl.int64) * 128
    r = 4 * tl.arange(0, 32)
    offs_k = tl.arange(0, 128)
    m_left = M - m0
    h = h_ptr + m0 * stride_hm + pid_k * 128
    hs = hs_ptr + m0 * stride_hsm + pid_k * stride_hsg
    da = da_ptr + m0 * stride_dam + pid_k * 128
    q = q_ptr + m0 * stride_qm + col * 128
    qs = qs_ptr + m0 * stride_qsm + col * stride_qsg
    d0 = _swiglu_grad_rows(h, hs, da, r, offs_k, m_left, I, gate, stride_hm, stride_hsm, stride_hsg, stride_dam,
                           q, qs, stride_qm, stride_qsm, POW2)
    d1 = _swiglu_grad_rows(h, hs, da, r + 1, offs_k, m_left, I, gate, stride_hm, stride_hsm, stride_hsg, stride_dam,
                           q, qs, stride_qm, stride_qsm, POW2)
    d2 = _swiglu_grad_rows(h, hs, da, r + 2, offs_k, m_left, I, gate, stride_hm, stride_hsm, stride_hsg, stride_dam,
                           q, qs, stride_qm, stride_qsm, POW2)
    d3 = _swiglu_grad_rows(h, hs, da, r + 3, offs_k, m_left, I, gate, stride_hm, stride_hsm, stride_hsg, stride_dam,
                           q, qs, stride_qm, stride_qsm, POW2)
    _quant_cols4_store(d0, d1, d2, d3, tl.arange(0, 32), offs_k, m_left, 128,
                       c_ptr + (col * 128).to(tl.int64) * stride_ck + m0,
                       cs_ptr + col * 128 * stride_csk + pid_m * stride_csm, stride_ck, stride_csk, POW2, PACK)


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
    """h8 "1x128" [M, 2I], da [M, I] -> (dh "1x128" [M, 2I], dh "128x1": data [2I, M]); the
    "1x128" scales column-major with colmajor_scale (fc1's dgrad operand). launch: replaces
    quant.LAUNCH["swiglu_backward_quant"] for this call."""
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
    c = torch.empty(I2, M, dtype=FP8_DTYPE, device=dev)
    cs = _scales(I2, triton.cdiv(M, TILE), dev, True)
    if M:
        da = da if da.stride(-1) == 1 else da.contiguous()
        _swiglu_bwd_quant_kernel[(I2 // TILE, triton.cdiv(M, TILE))](
            h8.data, h8.scale, da, q, qs, c, cs, M, I2 // 2, h8.data.stride(0), h8.scale.stride(0),
            h8.scale.stride(1), da.stride(0), q.stride(0), qs.stride(0), qs.stride(1), c.stride(0), cs.stride(0),
            cs.stride(1), POW2=pow2, PACK=_packs(M), enable_fp_fusion=False,
            **(launch or LAUNCH["swiglu_backward_quant"]))
    return Fp8Tensor(q, qs, "1x128"), Fp8Tensor(c, cs, "128x1")


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
    dh = swiglu_backward_ref(h8.dequantize(torch.float32), da)
    return quant_rowwise_ref(dh, scale_fmt, colmajor_scale=colmajor_scale), quant_colwise_ref(dh, scale_fmt)
