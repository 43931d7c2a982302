"""The routed experts' MLP, fc1 -> SwiGLU -> fc2, on permuted rows (docs/design.md §2).

Rows are the local experts' tokens stacked in 128-aligned segments (`group_offsets`, the grouped
GEMM contract); padding rows are zeros and stay zeros through the MLP, so they never reach a
result or a gradient. Weights: W1 [E, 2I, H] (gate rows first, then up), W2 [E, H, I].
`off=None` is the dense MLP every token goes through (the shared experts): weights [2I, H] and
[H, I], dense GEMMs (`moefp8.kernels.gemm`) instead of grouped ones, the same fused kernels.

FP8 recipe, forward: h = x8 · W1ᵀ (m-grouped FP8 GEMM, BF16 out) -> h cached as "1x128" FP8 ->
a = swiglu(h) quantized "1x128" (one fused kernel) -> y = a8 · W2ᵀ (BF16).
Backward (dy arrives as "1x128" FP8, the combine's gradient): da = dy8 · W2 (dgrad);
dW2 = dyᵀ · a with dy requantized col-wise and a recomputed from the cached FP8 h and quantized
col-wise in the same pass; dh = swiglu'(h) · da quantized row-wise (fc1 dgrad) and col-wise
(fc1 wgrad) in one fused pass; dx = dh8 · W1; dW1 = dhᵀ · x with x requantized col-wise from
the saved row-wise FP8.

BF16 recipe: the same data flow with BF16 grouped GEMMs (`torch._grouped_mm` on CUDA, a loop of
matmuls elsewhere), fused BF16 SwiGLU kernels and h cached in BF16: the like-for-like baseline.

Weights are quantized (FP8) or cast (BF16) by the optimizer, in its update pass: the GEMMs read the
persistent copy kept on each weight (`moefp8.weight_copy`, through `WeightCache`, which makes the copies
a CUDA graph capture must make itself). The FP8 functions take the GEMM
policy (`moefp8.kernels.grouped_gemm.GemmPolicy`: which GEMM implementation runs) and the scale
statistics recorder (`moefp8.fp8.ScaleStats`) of the layer that calls them.
"""

from typing import NamedTuple

import torch
from torch import Tensor

from moefp8.fp8 import Fp8Tensor, ScaleStats
from moefp8.kernels.gemm import fp8_gemm
from moefp8.kernels.grouped_gemm import GemmPolicy, fp8_grouped_gemm, fp8_grouped_gemm_wgrad, transpose_weight
from moefp8.kernels.quant import dequant_swiglu_quant_colwise, quant_weight, swiglu_quant_cache
from moefp8.kernels.swiglu import swiglu_backward_bf16, swiglu_backward_quant, swiglu_bf16
from moefp8.scope import scope
from moefp8.weight_copy import capturing as weight_capturing, copy_of


class _Copy(NamedTuple):
    """One weight's entry in a `WeightCache`."""
    version: int  # the parameter's version counter when the copy was made
    fmt: str  # "pow2" | "fp32" | "bf16"
    low: "Fp8Tensor | Tensor"  # the FP8 "128x128" copy, or the BF16 cast
    low_t: "Fp8Tensor | None"  # its transpose for dgrad (FP8), made with it or on the first request
    captured: bool  # made during a CUDA graph capture


class WeightCache:
    """Low-precision copies of weights: the weight's persistent copy (`weight_copy.copy_of`), which the
    optimizer refreshes. fmt "pow2"/"fp32": the FP8 "128x128" quantization and its transpose for dgrad
    (both in one pass where the backward will want it: a weight that requires grad, whatever the grad
    mode, since the layers ask from inside their autograd Functions' forwards, where it is off; else the
    transpose on request); "bf16": a BF16 cast.

    Where no persistent copy serves (under a CUDA graph capture, moefp8.graphs, a weight whose copy
    does not match it) the copy is made here, keyed on (id, version counter): a copy made outside a
    capture is made again inside, and the replays then quantize the weight as it is at each replay (the version check runs
    only at the capture). A copy made during the capture is reused by the rest of it (the backward's graph
    reads the forward graph's buffer, which every forward replay refills), and by nothing outside
    it: a capture runs no kernel, so until a replay fills it that buffer holds whatever its memory
    held (the eager step after the capture, the weights unchanged, read it before this rule)."""

    def __init__(self):
        self._store: dict[int, _Copy] = {}

    def get(self, w: Tensor, scale_fmt: str, transposed: bool = False):
        c = copy_of(w, scale_fmt, transposed)  # the copy kept on the weight, which the optimizer refreshes
        if c is not None:
            return c.low_t if transposed else c.low
        key, ver = id(w), w._version
        capturing = weight_capturing(w)
        hit = self._store.get(key)
        if hit is None or hit.version != ver or hit.fmt != scale_fmt or capturing != hit.captured:
            if scale_fmt == "bf16":
                hit = _Copy(ver, scale_fmt, w.detach().to(torch.bfloat16), None, capturing)
            elif (transposed or w.requires_grad) and w.shape[-2] % 128 == 0:
                hit = _Copy(ver, scale_fmt, *quant_weight(w.detach(), scale_fmt, transposed=True), capturing)
            else:
                hit = _Copy(ver, scale_fmt, quant_weight(w.detach(), scale_fmt), None, capturing)
        if transposed and hit.low_t is None:
            hit = hit._replace(low_t=transpose_weight(hit.low))
        self._store[key] = hit
        return hit.low_t if transposed else hit.low


# ----------------------------------------------------------------------------------------------
# FP8


def _mm(a8: Fp8Tensor, w8: Fp8Tensor, off: Tensor | None, off_host: list | None, gemm: GemmPolicy) -> Tensor:
    """a8 "1x128" [M, K] · w8ᵀ -> BF16 [M, N]: m-grouped over `off`, or dense when off is None."""
    if off is None:
        return fp8_gemm(a8, w8, policy=gemm)
    return fp8_grouped_gemm(a8, w8, off, validate=False, host_offsets=off_host, policy=gemm)


def _wgrad(dy_col: Fp8Tensor, x_col: Fp8Tensor, off: Tensor | None, off_host: list | None, gemm: GemmPolicy,
           out: Tensor | None = None) -> Tensor:
    """dYᵀ · X per segment ("128x1" operands) -> FP32 [E, N, K] (added into `out` when given: one
    fp32 rounding, as `out + dYᵀ · X`), or [N, K] when off is None."""
    if off is None:
        return fp8_gemm(dy_col, x_col, policy=gemm)
    return fp8_grouped_gemm_wgrad(dy_col, x_col, off, out, validate=False, host_offsets=off_host, policy=gemm)


def fp8_mlp_forward(x8: Fp8Tensor, off: Tensor | None, w1_8: Fp8Tensor, w2_8: Fp8Tensor, scale_fmt: str,
                    off_host: list | None = None, *, gemm: GemmPolicy, stats: ScaleStats, src_M: Tensor | None = None):
    """x8 "1x128" [M, H] -> (y [M, H] bf16, h8 "1x128" [M, 2I] the cache for backward, a8 "1x128"
    [M, I] fc2's input: y = fp8_grouped_gemm(a8, w2_8) again gives y bit for bit).
    off_host: the offsets on the host, if known (lets the GEMMs pick a per-expert cuBLAS loop).
    src_M: the permutation's row sources (-1: padding), so that the statistics skip the padding rows."""
    with scope("fc1"):
        h = _mm(x8, w1_8, off, off_host, gemm)
    with scope("swiglu"):
        h8, a8 = swiglu_quant_cache(h, scale_fmt, colmajor_scale=True)
        stats.record("act", a8, src_M)
    with scope("fc2"):
        return _mm(a8, w2_8, off, off_host, gemm), h8, a8


def fp8_mlp_backward(dy8: Fp8Tensor, dy_col: Fp8Tensor, x_col: Fp8Tensor, h8: Fp8Tensor, off: Tensor | None,
                     w1: Tensor, w2: Tensor, cache: WeightCache, scale_fmt: str, want_dx: bool = True,
                     off_host: list | None = None, dw_into: tuple | None = None, *, gemm: GemmPolicy,
                     stats: ScaleStats, src_M: Tensor | None = None):
    """-> (dx [M, H] bf16 or None, dW1 [E, 2I, H] fp32, dW2 [E, H, I] fp32; dense: [2I, H], [H, I]).
    dy8 "1x128" and its "128x1" copy dy_col, fc1's input x_col "128x1": each caller makes them where
    it has them (the shared experts: `quant_rowwise_colwise` and the forward's saved copy; the MoE:
    `requant_colwise` of the permuted dy8, `permute_requant_colwise`). dw_into: grouped
    only, (dW1, dW2) of another micro-batch that these are added into (and returned): the two
    micro-batch schedules' dW_A + dW_B without a pass over two full fp32 copies. src_M: as in
    `fp8_mlp_forward`."""
    into1, into2 = dw_into if dw_into is not None and off is not None else (None, None)
    with scope("bwd_fc2"):
        da = _mm(dy8, cache.get(w2, scale_fmt, transposed=True), off, off_host, gemm)
        dw2 = _wgrad(dy_col, dequant_swiglu_quant_colwise(h8, scale_fmt), off, off_host, gemm, into2)
        del dy_col
    with scope("bwd_swiglu"):
        dh8, dh_col = swiglu_backward_quant(h8, da, scale_fmt, colmajor_scale=True)
        stats.record("grad", dh8, src_M)
    with scope("bwd_fc1"):
        dw1 = _wgrad(dh_col, x_col, off, off_host, gemm, into1)
        dx = _mm(dh8, cache.get(w1, scale_fmt, transposed=True), off, off_host, gemm) if want_dx else None
    return dx, dw1, dw2


# ----------------------------------------------------------------------------------------------
# BF16 (the baseline recipe)


def bf16_grouped_mm(x: Tensor, w: Tensor, off: Tensor | None, transpose_w: bool = True) -> Tensor:
    """x [M, K] bf16, w [E, N, K] -> [M, N] (x · w[e]ᵀ per segment); transpose_w=False: w [E, K, N]
    used as is. offsets[E] <= M (the permute layout's: at EP = 1 its static bound, the rows past offsets[E]
    padding: whatever _grouped_mm leaves there, no result reads them). off None: dense, w [N, K] (or [K, N])."""
    wt = w.transpose(-1, -2) if transpose_w else w
    if off is None:  # CPU: fp32 math, like the loop below
        return x @ wt.to(x.dtype) if x.is_cuda else (x.float() @ wt.float()).to(x.dtype)
    if x.is_cuda and x.shape[0]:  # M == 0 (an EP rank that received no token): the loop below
        return torch._grouped_mm(x, wt.to(x.dtype), offs=off[1:].int())
    out = torch.zeros(x.shape[0], wt.shape[2], dtype=x.dtype, device=x.device)
    h = off.tolist()
    for e in range(len(h) - 1):
        if h[e + 1] > h[e]:
            out[h[e]:h[e + 1]] = (x[h[e]:h[e + 1]].float() @ wt[e].float()).to(x.dtype)
    return out


def bf16_grouped_wgrad(dy: Tensor, x: Tensor, off: Tensor | None, out: Tensor | None = None) -> Tensor:
    """dW[e] = dy_eᵀ · x_e over each segment: dy [M, N], x [M, K] -> [E, N, K] fp32 (BF16-rounded on CUDA);
    off None: dense, [N, K]. out: fp32 of that shape the product is added into (in the same pass as the
    upcast; returned), as autograd would add the returned one."""
    if off is None:
        dw = dy.t() @ x if dy.is_cuda else dy.float().t() @ x.float()
        return dw.float() if out is None else out.add_(dw)
    # torch 2.11's _grouped_mm has no fp32 output for BF16 inputs: BF16, then upcast. M == 0 (an EP
    # rank that received no token) takes the loop: _grouped_mm rejects a zero-length contraction
    # ("strides should be multiple of 16 bytes", pytorch PR #192497)
    if dy.is_cuda and dy.shape[0]:
        dw = torch._grouped_mm(dy.t(), x, offs=off[1:].int())
        return dw.float() if out is None else out.add_(dw)
    h = off.tolist()
    E = len(h) - 1
    dw = torch.zeros(E, dy.shape[1], x.shape[1], dtype=torch.float32, device=dy.device)
    for e in range(E):
        dw[e] = dy[h[e]:h[e + 1]].float().t() @ x[h[e]:h[e + 1]].float()
    return dw if out is None else out.add_(dw)


def bf16_mlp_forward(x: Tensor, off: Tensor | None, w1: Tensor, w2: Tensor):
    """x [M, H] bf16, BF16 weights -> (y [M, H] bf16, h [M, 2I] bf16, the cache for backward)."""
    with scope("fc1"):
        h = bf16_grouped_mm(x, w1, off)
    with scope("swiglu"):
        a = swiglu_bf16(h)
    with scope("fc2"):
        return bf16_grouped_mm(a, w2, off), h


def bf16_mlp_backward(dy: Tensor, x: Tensor, h: Tensor, off: Tensor | None, w1: Tensor, w2: Tensor, want_dx: bool = True,
                      dw_into: tuple | None = None):
    """BF16 weights -> (dx [M, H] bf16 or None, dW1 fp32, dW2 fp32). dw_into: fp32 (dW1, dW2) these are
    added into (and returned), as in `fp8_mlp_backward`."""
    into1, into2 = dw_into if dw_into is not None else (None, None)
    with scope("bwd_fc2"):
        da = bf16_grouped_mm(dy, w2, off, transpose_w=False)
        dw2 = bf16_grouped_wgrad(dy, swiglu_bf16(h), off, into2)
    with scope("bwd_swiglu"):
        dh = swiglu_backward_bf16(h, da)
    with scope("bwd_fc1"):
        dw1 = bf16_grouped_wgrad(dh, x, off, into1)
        dx = bf16_grouped_mm(dh, w1, off, transpose_w=False) if want_dx else None
    return dx, dw1, dw2
