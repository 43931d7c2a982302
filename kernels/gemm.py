"""Dense FP8 blockwise GEMMs (docs/design.md §1): the three GEMMs of a linear layer.

* fprop `Y = X · Wᵀ`: X "1x128" [M, K], W "128x128" [N, K] -> BF16 [M, N]
* dgrad `dX = dY · W`: dY "1x128" [M, N], W "128x128" [N, K] -> BF16 [M, K]
* wgrad `dW = dYᵀ · X`: dY "128x1" (data [N, M]), X "128x1" (data [K, M]) -> FP32 [N, K],
  optionally accumulated into an FP32 main grad

``impl``: None (default: cuBLAS blockwise ``torch._scaled_mm`` where it supports the case, else
the Triton kernels of `moefp8.kernels.grouped_gemm` run with one group), "cublas", "triton" or
"ref" (dequantize, multiply in fp32). CPU tensors default to "ref". ``policy``: the
`GemmPolicy` (its `variant` for the Triton kernels, `dense_wgrad_cublas` for the wgrad).

cuBLAS blockwise on sm90 (torch 2.11, probed with tools/bench_gemm.py --probe on an H200):
fprop takes A row-major [M, K] with scale_a [M, K/128] column-major and B column-major (Wᵀ of
a row-major W) with scale_b = W's [N/128, K/128] grid transposed as a view (strides (1, K/128));
every other scale layout is refused. With K/128 = 3 (K=384) the result is silently wrong
(rel. error 45), K=640 and 7168 are right: we use cuBLAS only when K/128 % 4 == 0. The wgrad
(1x128 x 1x128 over tokens) is accepted with scale_b = X's [K, M/128] scales transposed and made
contiguous, FP32 output included, M % 16 == 0. Hopper's FP8 tensor cores need both operands
K-major, so dgrad multiplies by `transpose_weight(W)`, an FP8 copy of Wᵀ (cuBLAS and Triton).
"""

import functools

import torch
from torch import Tensor

from moefp8.fp8 import TILE, Fp8Tensor, col_major
from moefp8.kernels.grouped_gemm import GemmPolicy, check_fp8, launch_kgrouped, launch_mgrouped, transpose_weight

_IMPLS = (None, "cublas", "triton", "ref")


def _pick(x: Tensor, impl: str | None, cublas_ok: bool) -> str:
    if impl not in _IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {_IMPLS}")
    if impl is None:
        if not x.is_cuda:
            return "ref"
        return "cublas" if cublas_ok else "triton"
    if impl == "cublas" and not cublas_ok:
        raise ValueError("impl='cublas': this case is not supported by blockwise torch._scaled_mm "
                         "(needs CUDA, M % 16 == 0, N % 128 == 0, "
                         "K/128 % 4 == 0; wgrad: M % 128 == 0)")
    return impl


def _cublas_weight_scale(s: Tensor) -> Tensor:
    """[N/128, K/128] -> the [K/128, N/128] transposed view cuBLAS reads."""
    return s.contiguous().t()


def _cublas_nt(a: Fp8Tensor, b: Fp8Tensor) -> Tensor:
    """A [M, K] "1x128" · B [N, K] "128x128"ᵀ through blockwise torch._scaled_mm -> BF16."""
    return torch._scaled_mm(a.data, b.data.t(), col_major(a.scale), _cublas_weight_scale(b.scale),
                            out_dtype=torch.bfloat16)


def _cublas_ok(M: int, N: int, K: int) -> bool:
    return M % 16 == 0 and N % TILE == 0 and (K // TILE) % 4 == 0


@functools.lru_cache(maxsize=64)
def _one_group(M: int, device: torch.device) -> Tensor:
    """The group offsets [0, M] of a dense GEMM run as one group, made once per (M, device):
    `torch.tensor([0, M], device=cuda)` copies from pageable host memory, which waits for the stream
    (a host sync per GEMM: 27 per step of the 16B preset, bench/notes/scale.md). Read-only."""
    return torch.tensor([0, M], dtype=torch.int32).to(device)


def _triton_nt(a: Fp8Tensor, b: Fp8Tensor, policy: GemmPolicy) -> Tensor:
    M, N = a.data.shape[0], b.data.shape[0]
    off = _one_group(M, a.data.device)
    out = torch.empty(M, N, dtype=torch.bfloat16, device=a.data.device)
    return launch_mgrouped(a, Fp8Tensor(b.data.unsqueeze(0), b.scale.unsqueeze(0), b.layout), off, out, policy)


def fp8_gemm(a: Fp8Tensor, b: Fp8Tensor, *, out: Tensor | None = None, impl: str | None = None,
             policy: GemmPolicy = GemmPolicy()) -> Tensor:
    """Dense FP8 GEMM, chosen by the operands' layouts:

    * a "1x128" [M, K], b "128x128" [N, K] -> BF16 [M, N] = A · Bᵀ (fprop; dgrad when b is
      `transpose_weight(W)`, see also `fp8_gemm_dgrad`). `out` is not supported here.
    * a "128x1" of dY [M, N] (data [N, M]), b "128x1" of X [M, K] (data [K, M]) -> FP32
      [N, K] = dYᵀ · X (wgrad), any M; accumulated into `out` (FP32 [N, K]) when given.
    """
    if isinstance(a, Fp8Tensor) and a.layout == "128x1":
        return _fp8_wgrad(a, b, out, impl, policy)
    check_fp8("fp8_gemm: a", a, "1x128", 2)
    check_fp8("fp8_gemm: b", b, "128x128", 2)
    if out is not None:
        raise ValueError("fp8_gemm: out= is only supported for the FP32 wgrad (two '128x1' operands)")
    M, K = a.data.shape
    N, Kb = b.data.shape
    if K != Kb:
        raise ValueError(f"fp8_gemm: a has K={K} columns, b has K={Kb}")
    which = _pick(a.data, impl, a.data.is_cuda and _cublas_ok(M, N, K))
    if which == "ref":
        return fp8_gemm_ref(a, b)
    if M == 0 or N == 0:
        return torch.zeros(M, N, dtype=torch.bfloat16, device=a.data.device)
    if which == "cublas":
        return _cublas_nt(a, b)
    return _triton_nt(a, b, policy)


def fp8_gemm_dgrad(dy: Fp8Tensor, w: Fp8Tensor, *, w_t: Fp8Tensor | None = None,
                   impl: str | None = None, policy: GemmPolicy = GemmPolicy()) -> Tensor:
    """dX = dY · W: dy "1x128" [M, N], w "128x128" [N, K] (N % 128 == 0) -> BF16 [M, K].
    Multiplies by `w_t` = transpose_weight(w) (made here when not given) with `fp8_gemm`."""
    check_fp8("fp8_gemm_dgrad: dy", dy, "1x128", 2)
    check_fp8("fp8_gemm_dgrad: w", w, "128x128", 2)
    M, N = dy.data.shape
    Nw, K = w.data.shape
    if N != Nw:
        raise ValueError(f"fp8_gemm_dgrad: dy has {N} columns, w has N={Nw} rows")
    if _pick(dy.data, impl, True) == "ref":
        return fp8_gemm_dgrad_ref(dy, w)
    return fp8_gemm(dy, w_t if w_t is not None else transpose_weight(w), impl=impl, policy=policy)


def _fp8_wgrad(dy: Fp8Tensor, x: Fp8Tensor, out: Tensor | None, impl: str | None, policy: GemmPolicy) -> Tensor:
    check_fp8("fp8_gemm (wgrad): a", dy, "128x1", 2)
    check_fp8("fp8_gemm (wgrad): b", x, "128x1", 2)
    N, M = dy.data.shape
    K, Mx = x.data.shape
    if M != Mx:
        raise ValueError(f"fp8_gemm (wgrad): a has {M} tokens (rows of dY), b has {Mx}")
    if out is not None and (out.shape != (N, K) or out.dtype != torch.float32 or out.stride(-1) != 1):
        raise ValueError(f"fp8_gemm (wgrad): out must be float32 [{N}, {K}] with a contiguous last dim, "
                         f"got {out.dtype} {tuple(out.shape)}")
    which = _pick(dy.data, impl, dy.data.is_cuda and M % TILE == 0 and N % 16 == 0 and K % 16 == 0
                  and policy.dense_wgrad_cublas)
    if which == "ref":
        return fp8_gemm_wgrad_ref(dy, x, out)
    if which == "cublas":
        res = torch._scaled_mm(dy.data, x.data.t(), col_major(dy.scale), x.scale.t().contiguous(),
                               out_dtype=torch.float32)
        return res if out is None else out.add_(res)
    accumulate = out is not None
    if out is None:
        out = torch.empty(N, K, dtype=torch.float32, device=dy.data.device)
    off = _one_group(M, dy.data.device)
    launch_kgrouped(dy, x, off, out.unsqueeze(0), accumulate, policy)
    return out


# ----------------------------------------------------------------------------------------------
# Pure-PyTorch reference twins: dequantize both operands, multiply in fp32.


def fp8_gemm_ref(a: Fp8Tensor, b: Fp8Tensor) -> Tensor:
    return (a.dequantize(torch.float32) @ b.dequantize(torch.float32).t()).to(torch.bfloat16)


def fp8_gemm_dgrad_ref(dy: Fp8Tensor, w: Fp8Tensor) -> Tensor:
    return (dy.dequantize(torch.float32) @ w.dequantize(torch.float32)).to(torch.bfloat16)


def fp8_gemm_wgrad_ref(dy: Fp8Tensor, x: Fp8Tensor, out: Tensor | None = None) -> Tensor:
    res = dy.dequantize(torch.float32).t() @ x.dequantize(torch.float32)
    if out is None:
        return res
    out += res
    return out


__all__ = ["fp8_gemm", "fp8_gemm_dgrad", "transpose_weight", "GemmPolicy", "fp8_gemm_ref", "fp8_gemm_dgrad_ref",
           "fp8_gemm_wgrad_ref"]
