"""FP8 blockwise grouped GEMMs for the experts (docs/design.md §1): Triton kernel -> public wrapper
-> `_ref` twin.

Two shapes, both with per-128-K "promotion": every 128-wide block of the contraction is
multiplied in a fresh tensor-core accumulator, scaled by its two tile scales and added to a
running fp32 total, so Hopper's ~14-bit FP8 accumulator never sums more than 128 products.

* m-grouped (experts fprop and dgrad), `fp8_grouped_gemm`: the rows of all local experts are
  stacked in one "1x128" tensor A [M, K]; rows [offsets[e], offsets[e+1]) are multiplied by
  expert e's "128x128" weight B[e] [N, K]: out[m] = A[m] · B[e]ᵀ (fprop) or, with
  ``transpose_b=True``, A[m] [M, N] · B[e] [N, K] (dgrad, through `transpose_weight`, an FP8
  copy of Wᵀ: FP8 wgmma needs K-major operands). BF16 out. On Hopper GPUs the kernel is the
  warp-specialized Gluon one of `moefp8.kernels.grouped_gemm_ws` (bit-exact with the Triton
  kernels here, which run elsewhere and under the interpreter).
* k-grouped (experts wgrad), `fp8_grouped_gemm_wgrad`: dW[e] = dYᵀ·X over the rows of expert
  e, both operands "128x1" (data stored [N, M] and [K, M], tokens contiguous). FP32 out,
  optionally accumulated into an existing buffer.

``group_offsets`` contract (both kernels): an int32/int64 tensor [E+1] on the operands' device
(a CPU tensor or a list is copied there), non-decreasing, ``offsets[0] == 0``, every entry a
multiple of 128 and ``offsets[E] <= M``. Segment e is rows (tokens) [offsets[e], offsets[e+1]);
an empty segment is an expert with no tokens. Rows inside a segment past the expert's real
tokens (padding) are computed like any row: callers fill them with zeros (they must be finite,
or they poison the expert's wgrad). m-grouped: output rows >= offsets[E] are written as zeros.
k-grouped: rows >= offsets[E] are ignored; an empty expert gives exact zeros (or leaves `out`
unchanged). ``validate=True`` checks the contract on the host (one device sync); the MoE layer,
which builds the offsets itself, passes ``validate=False``.

The dense GEMMs (`moefp8.kernels.gemm`) reuse these kernels with one group and any M.
"""

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from moefp8.fp8 import FP8_DTYPE, TILE, Fp8Tensor, col_major
from moefp8.kernels import deepgemm
from moefp8.kernels import grouped_gemm_ws as ws
from moefp8.kernels import num_sms, use_triton
from moefp8.kernels.quant import transpose_weight_ref

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row tiles sweep all column tiles together (A and B reuse in L2)."""
    per_group = GROUP_M * num_n
    group = tile // per_group
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % size_m
    pid_n = (tile % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _mgrouped_gemm_kernel(a_ptr, ast_ptr, b_ptr, bs_ptr, c_ptr, off_ptr,
                          M, N, K, E, M_HINT,
                          stride_am, stride_bse, stride_bsn, stride_cm,
                          NUM_SMS: tl.constexpr, E_POW2: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Persistent: each program walks tiles pid, pid + NUM_SMS, ... of the [M, N] output.

    a [M, K] e4m3 (K contiguous) with its scales TRANSPOSED, ast [K/128, M] fp32 (one contiguous
    row per K block, so each step loads BLOCK_M consecutive floats); b [E, N, K] e4m3 (K
    contiguous), bs [E, ceil(N/128), K/128]. BLOCK_M divides 128 so that a row tile never spans
    two experts; BLOCK_N <= 128 so that one b scale covers a tile's columns per K block.
    """
    BLOCK_K: tl.constexpr = 128
    pid = tl.program_id(0)
    m_end = tl.load(off_ptr + E)  # rows >= m_end belong to no expert: written as zeros
    # Expert lookup without a loop: e(row) = #{i in 1..E-1 : offsets[i] <= row}.
    ie = tl.arange(0, E_POW2)
    inner = tl.load(off_ptr + 1 + ie, mask=ie < E - 1, other=2147483647)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = K // BLOCK_K
    rk = tl.arange(0, BLOCK_K)
    for tile in tl.range(pid, num_m * num_n, NUM_SMS):
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
        row0 = pid_m * BLOCK_M
        rm = row0 + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if row0 < m_end:
            e = tl.sum((inner <= row0).to(tl.int32), axis=0).to(tl.int64)
            # Clamped indices instead of masks keep the loads unpredicated (pipelines better);
            # rows/cols past the end are computed on repeated data and never stored.
            rm_l = rm % M
            rn_l = rn % N
            a_ptrs = a_ptr + rm_l.to(tl.int64)[:, None] * stride_am + rk[None, :]
            b_ptrs = b_ptr + e * N * K + rn_l.to(tl.int64)[None, :] * K + rk[:, None]
            as_ptrs = ast_ptr + rm_l
            bs_ptrs = bs_ptr + e * stride_bse + (pid_n * BLOCK_N // 128) * stride_bsn
            for kb in tl.range(0, k_tiles):
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
                sa = tl.load(as_ptrs + kb * M)
                sb = tl.load(bs_ptrs + kb)
                d = tl.dot(a, b)  # fresh accumulator: at most 128 FP8 products per partial sum
                acc += d * (sa * sb)[:, None]
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
        c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _mgrouped_gemm_tma_kernel(a_ptr, ast_ptr, b_ptr, bs_ptr, c_ptr, off_ptr,
                              M, N, K, E, M_HINT, stride_bse, stride_bsn,
                              E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              GROUP_M: tl.constexpr, OCC: tl.constexpr, PROMOTE: tl.constexpr = True):
    """`_mgrouped_gemm_kernel` with the operand tiles moved by TMA (device-side tensor
    descriptors); a [M, K], b [E, N, K], c [M, N] contiguous. Out-of-range rows/columns: TMA
    zero-fills loads and clips stores. BLOCK_N may be 256 (then one b scale per column).
    Persistent over OCC programs per SM: with OCC=2 two co-resident programs let one's FP32
    promotion overlap the other's tensor-core work (a CTA-level ping-pong).
    PROMOTE=False is a speed-of-light diagnostic only (tools/bench_gemm.py): one unscaled
    accumulation over all of K, numerically wrong for the recipe."""
    BLOCK_K: tl.constexpr = 128
    pid = tl.program_id(0)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[E * N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    m_end = tl.load(off_ptr + E)
    ie = tl.arange(0, E_POW2)
    inner = tl.load(off_ptr + 1 + ie, mask=ie < E - 1, other=2147483647)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    n_blocks = tl.cdiv(N, 128)
    k_tiles = K // BLOCK_K
    for tile in tl.range(pid, num_m * num_n, tl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
        row0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if row0 < m_end:
            e = tl.sum((inner <= row0).to(tl.int32), axis=0)
            as_ptrs = ast_ptr + (row0 + tl.arange(0, BLOCK_M)) % M
            if BLOCK_N <= 128:
                bs_ptrs = bs_ptr + e.to(tl.int64) * stride_bse + (n0 // 128) * stride_bsn
            else:  # two 128-column weight blocks per tile: one scale per column
                nb = (n0 + tl.arange(0, BLOCK_N)) // 128
                bs_ptrs = bs_ptr + e.to(tl.int64) * stride_bse + tl.minimum(nb, n_blocks - 1) * stride_bsn
            b_row = e * N + n0
            for kb in tl.range(0, k_tiles):
                a = a_desc.load([row0, kb * BLOCK_K])
                b = b_desc.load([b_row, kb * BLOCK_K])
                if PROMOTE:
                    d = tl.dot(a, b.T)  # fresh accumulator: at most 128 FP8 products per partial sum
                    acc += d * _promo_scale(as_ptrs, bs_ptrs, kb, M, BLOCK_N)
                else:
                    acc = tl.dot(a, b.T, acc)
        c_desc.store([row0, n0], acc.to(c_desc.dtype))


@triton.jit
def _promo_scale(as_ptrs, bs_ptrs, kb, M, BLOCK_N: tl.constexpr):
    """Scale of K block kb for a [BLOCK_M, BLOCK_N] tile: a_scale[row] * b_scale[block]."""
    sa = tl.load(as_ptrs + kb * M)
    sb = tl.load(bs_ptrs + kb)
    if BLOCK_N <= 128:
        return (sa * sb)[:, None]
    else:
        return sa[:, None] * sb[None, :]


@triton.jit
def _kgrouped_gemm_kernel(a_ptr, ast_ptr, b_ptr, bst_ptr, c_ptr, off_ptr,
                          N, K, M_HINT,
                          stride_an, stride_bk, stride_ce, stride_cn,
                          ACCUMULATE: tl.constexpr, MASK_T: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr):
    """Grid (tiles of [N, K], E). a = dY col-wise: data [N, M] (tokens contiguous); b = X
    col-wise: data [K, M]. Scales TRANSPOSED to token-block-major: ast [ceil(M/128), N],
    bst [ceil(M/128), K] (contiguous loads per step). c[e] [N, K] fp32 (+= when ACCUMULATE).
    MASK_T: the segment end may be inside a 128-token tile (dense wgrad, any M)."""
    BLOCK_T: tl.constexpr = 128
    pid = tl.program_id(0)
    e = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    pid_n, pid_k = _tile_coords(pid, num_n, num_k, GROUP_N)
    t_start = tl.load(off_ptr + e)
    t_end = tl.load(off_ptr + e + 1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rt = tl.arange(0, BLOCK_T)
    rn_l = rn % N
    rk_l = rk % K
    a_ptrs = a_ptr + rn_l.to(tl.int64)[:, None] * stride_an + (t_start + rt)[None, :]
    b_ptrs = b_ptr + rk_l.to(tl.int64)[:, None] * stride_bk + (t_start + rt)[None, :]
    as_ptrs = ast_ptr + (t_start // BLOCK_T).to(tl.int64) * N + rn_l
    bs_ptrs = bst_ptr + (t_start // BLOCK_T).to(tl.int64) * K + rk_l
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for t0 in tl.range(t_start, t_end, BLOCK_T):
        if MASK_T:
            t_ok = (t0 + rt) < t_end  # masked tokens load 0: a stray FP8 byte can be NaN
            a = tl.load(a_ptrs, mask=t_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=t_ok[None, :], other=0.0)
        else:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        sa = tl.load(as_ptrs)
        sb = tl.load(bs_ptrs)
        d = tl.dot(a, tl.trans(b))  # both operands token-major (K-major for wgmma)
        acc += d * sa[:, None] * sb[None, :]
        a_ptrs += BLOCK_T
        b_ptrs += BLOCK_T
        as_ptrs += N
        bs_ptrs += K
    c_ptrs = c_ptr + e.to(tl.int64) * stride_ce + rn.to(tl.int64)[:, None] * stride_cn + rk[None, :]
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask, other=0.0)
    tl.store(c_ptrs, acc, mask=mask)


@triton.jit
def _kgrouped_gemm_tma_kernel(a_ptr, ast_ptr, b_ptr, bst_ptr, c_ptr, off_ptr,
                              M, N, K, M_HINT, stride_ce, stride_cn,
                              ACCUMULATE: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
                              PROMOTE: tl.constexpr = True):
    """`_kgrouped_gemm_kernel` with TMA tiles: a [N, M] and b [K, M] contiguous. A partial last
    token tile (dense wgrad, M % 128 != 0) is zero-filled by TMA, so no masks."""
    BLOCK_T: tl.constexpr = 128
    pid = tl.program_id(0)
    e = tl.program_id(1)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[N, M], strides=[M, 1], block_shape=[BLOCK_N, BLOCK_T])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, M], strides=[M, 1], block_shape=[BLOCK_K, BLOCK_T])
    num_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    pid_n, pid_k = _tile_coords(pid, num_n, num_k, GROUP_N)
    t_start = tl.load(off_ptr + e)
    t_end = tl.load(off_ptr + e + 1)
    n0 = pid_n * BLOCK_N
    k0 = pid_k * BLOCK_K
    rn = n0 + tl.arange(0, BLOCK_N)
    rk = k0 + tl.arange(0, BLOCK_K)
    as_ptrs = ast_ptr + (t_start // BLOCK_T).to(tl.int64) * N + rn % N
    bs_ptrs = bst_ptr + (t_start // BLOCK_T).to(tl.int64) * K + rk % K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for t0 in tl.range(t_start, t_end, BLOCK_T):
        a = a_desc.load([n0, t0])
        b = b_desc.load([k0, t0])
        sa = tl.load(as_ptrs)
        sb = tl.load(bs_ptrs)
        if PROMOTE:
            d = tl.dot(a, b.T)
            acc += d * (sa[:, None] * sb[None, :])
        else:  # speed-of-light diagnostic only
            acc = tl.dot(a, b.T, acc)
        as_ptrs += N
        bs_ptrs += K
    c_ptrs = c_ptr + e.to(tl.int64) * stride_ce + rn.to(tl.int64)[:, None] * stride_cn + rk[None, :]
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask, other=0.0)
    tl.store(c_ptrs, acc, mask=mask)


@triton.jit
def _transpose_kernel(x_ptr, y_ptr, R, C, BLOCK: tl.constexpr):
    """x [E, R, C] -> y [E, C, R] (bytes), one BLOCK x BLOCK tile per program."""
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    rr = pid_r * BLOCK + tl.arange(0, BLOCK)
    rc = pid_c * BLOCK + tl.arange(0, BLOCK)
    mask = (rr < R)[:, None] & (rc < C)[None, :]
    x = tl.load(x_ptr + e * R * C + rr[:, None] * C + rc[None, :], mask=mask)
    tl.store(y_ptr + e * R * C + rc[None, :] * R + rr[:, None], x, mask=mask)


# ----------------------------------------------------------------------------------------------
# Launch configurations


def _tune_bench(fn, quantiles):
    """Autotuning timer: short (5 ms warm-up, 25 ms of runs) so a new shape costs ~1 s."""
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


def _cfgs(keys, rows):
    return [triton.Config(dict(zip(keys, r[:-2])), num_warps=r[-2], num_stages=r[-1]) for r in rows]


# Autotuned entry points (GPU). Keys: the GEMM's N and K plus a power-of-two bucket of M, so
# that per-step changes in token counts do not retune. Under the interpreter the plain kernels
# are launched with small fixed blocks.
_mgrouped_tuned = triton.autotune(
    _cfgs(("BLOCK_M", "BLOCK_N", "GROUP_M"), [(128, 128, 8, 8, 4), (128, 128, 8, 4, 4), (64, 128, 8, 4, 5)]),
    key=["N", "K", "M_HINT", "E"], do_bench=_tune_bench)(_mgrouped_gemm_kernel)
_kgrouped_tuned = triton.autotune(
    _cfgs(("BLOCK_N", "BLOCK_K", "GROUP_N"), [(128, 128, 8, 8, 4), (128, 128, 8, 4, 4), (64, 128, 8, 4, 4)]),
    key=["N", "K", "M_HINT", "ACCUMULATE", "MASK_T"], restore_value=["c_ptr"], do_bench=_tune_bench)(
    _kgrouped_gemm_kernel)
# Measured on an H200 (bench/results/gemm-NVIDIA-H200.json, fc1/fc2, E = 8 and 32): the autotuner
# picks 128x128 tiles / 8 warps / one program per SM or 64x128 / 4 warps / two programs per SM
# (about half each, within a few %); 128x256 tiles lost. The same kernel without the promotion
# runs 1.13-1.39x faster (1020-1240 TFLOP/s): the FP32 promotion, serialized with the wgmma,
# is what separates it from cuBLAS. A variant that promoted block kb-1 after issuing the dot
# of block kb ran 7-20% slower and was dropped. k-grouped: 64x128 / 4 warps / 3 stages wins.
_mgrouped_tma_tuned = triton.autotune(
    _cfgs(("BLOCK_M", "BLOCK_N", "GROUP_M", "OCC"), [(128, 128, 8, 1, 8, 4), (128, 128, 8, 1, 8, 5),
                                                    (64, 128, 8, 2, 4, 4), (128, 64, 8, 2, 4, 4),
                                                    (64, 128, 8, 2, 4, 3), (128, 128, 8, 2, 8, 3)]),
    key=["N", "K", "M_HINT", "E"], do_bench=_tune_bench)(_mgrouped_gemm_tma_kernel)
_kgrouped_tma_tuned = triton.autotune(
    _cfgs(("BLOCK_N", "BLOCK_K", "GROUP_N"), [(128, 256, 8, 8, 3), (128, 128, 8, 8, 4), (64, 128, 8, 4, 3),
                                             (64, 128, 8, 4, 4), (128, 64, 8, 4, 4), (128, 64, 8, 4, 3)]),
    key=["N", "K", "M_HINT", "ACCUMULATE"], restore_value=["c_ptr"], do_bench=_tune_bench)(
    _kgrouped_gemm_tma_kernel)

VARIANTS = ("ws", "tma", "ptr")  # GemmPolicy.variant
LOOP_IMPLS = ("triton", "cublas")  # GemmPolicy's *_impl* fields


GEMM_LIBS = ("moefp8", "deepgemm")  # GemmPolicy.mgrouped_lib


@dataclass(frozen=True)
class GemmPolicy:
    """Which FP8 GEMM implementation runs on the GPU, as a value handed to the GEMMs (the MoE layer,
    the dense linears and the tools pass it down; nothing here reads a global). The defaults are
    the measured best on Hopper; `GemmPolicy()` is what training runs. On CPU and under the Triton
    interpreter every field is ignored: the reference twins or the interpreted Triton kernels run.

    variant: the grouped kernels' family (also the dense GEMMs' Triton fallback, one group): "ws"
      (the warp-specialized Gluon kernels of kernels/grouped_gemm_ws.py, on Hopper where they take
      the operands; else "tma"), "tma" (tensor descriptors) or "ptr" (pointer loads). H200: ws
      1.18-1.40x tma (bench/notes/gemm.md, session 14); tma 10-15% faster than ptr for the m-grouped
      GEMM and 10x for the k-grouped one. (On a GPU without the ws kernels, "ws" runs "ptr".)
    wgrad_impl: the k-grouped wgrad without host offsets: "triton" (no host sync) or "cublas" (a loop
      of blockwise cuBLAS GEMMs per expert: one host sync for the offsets). Measured (H200): the
      loop is 1.1-1.25x faster with >= 1000 tokens per expert, slower at 1024 tokens x 32 experts;
      "triton" stays the default because the MoE layer must not sync with the host.
    mgrouped_impl_host, wgrad_impl_host: with `host_offsets` (no sync needed for a loop), "cublas":
      the per-expert loop where `loop_pays`, else the kernels; "triton": the kernels always. The
      m-grouped loop measured faster than the Triton TMA kernels in every DeepSeek-V3 case (tma /
      loop 0.73-0.98), but not than the warp-specialized kernel (ws / loop 0.94-1.18,
      bench/results/gemm-NVIDIA-H200.json, session 14): where that kernel runs (Hopper), the
      m-grouped GEMM never loops. For the wgrad with >= 2048 tokens per expert the loop stays ahead
      (loop / ws 1.02-1.07 at 4096 tokens x 8 experts, session 14; 1.21-1.28x BF16).
    loop_min_macs: below this many multiply-adds per non-empty expert the loop's per-expert launches
      (and scale copies) cost more than the GEMMs: the small training preset (H 1024, I 512, 32
      experts, ~2048 rows each, 2.1e9 MACs) spent 72 ms of a 145 ms step in ~1700 tiny cuBLAS
      calls. The small preset of session 5 (H 2048, I 1024, 8 experts, ~4096 rows each: fc1 1.7e10
      MACs per expert) trained at 168.4k tokens/s with the Triton kernels against 161.2k with the
      loop for fc1 (whole step, H200, host-bound): the bar is above it. DeepSeek-V3 shapes
      (>= 1024 rows x 4096 x 7168 = 3e10) keep the loop. inf: never loop.
    dense_wgrad_cublas: the dense wgrad (`gemm.fp8_gemm` on two "128x1" operands) through cuBLAS
      blockwise 1x128 x 1x128 (FP32 out, then added into `out`) when M % 128 == 0: 938 vs 529
      TFLOP/s for the Triton k-grouped kernel at 8192^3 (H200). False: the Triton kernel.
    sm_reserve: SMs the warp-specialized kernels' persistent grids leave free, for communication
      kernels running at the same time (the two micro-batch overlap sets it from its
      `OverlapPolicy.gemm_sm_reserve` for the GEMMs it runs). 0: all SMs.
    kg_stages: depth of the warp-specialized k-grouped kernel's operand ring.
    mgrouped_lib: the m-grouped GEMMs (experts' fprop and dgrad) on CUDA tensors: "moefp8" (the
      kernels above) or "deepgemm" (DeepGEMM's, kernels/deepgemm.py; where it is built:
      `recipe.gemm=deepgemm`). The k-grouped wgrad stays moefp8's.
    """

    variant: str = "ws"
    wgrad_impl: str = "triton"
    mgrouped_impl_host: str = "cublas"
    wgrad_impl_host: str = "cublas"
    loop_min_macs: float = 3 * 2**33  # 2.6e10
    dense_wgrad_cublas: bool = True
    sm_reserve: int = 0
    kg_stages: int = ws.KG_STAGES
    mgrouped_lib: str = "moefp8"

    def __post_init__(self):
        for name, value, allowed in (("variant", self.variant, VARIANTS), ("wgrad_impl", self.wgrad_impl, LOOP_IMPLS),
                                     ("mgrouped_impl_host", self.mgrouped_impl_host, LOOP_IMPLS),
                                     ("wgrad_impl_host", self.wgrad_impl_host, LOOP_IMPLS),
                                     ("mgrouped_lib", self.mgrouped_lib, GEMM_LIBS)):
            if value not in allowed:
                raise ValueError(f"GemmPolicy: {name}={value!r}, expected one of {allowed}")
        if not isinstance(self.sm_reserve, int) or self.sm_reserve < 0:
            raise ValueError(f"GemmPolicy: sm_reserve={self.sm_reserve!r}, expected an integer >= 0")
        if not isinstance(self.kg_stages, int) or self.kg_stages < 1:
            raise ValueError(f"GemmPolicy: kg_stages={self.kg_stages!r}, expected an integer >= 1")

    def loop_pays(self, h: list, N: int, K: int, min_rows: int = 0) -> bool:
        """Whether the per-expert cuBLAS loop is the faster default at host offsets h (N x K per
        expert): at least `min_rows` rows and `loop_min_macs` multiply-adds per non-empty expert."""
        nonempty = sum(1 for e in range(len(h) - 1) if h[e + 1] > h[e])
        rows = (h[-1] - h[0]) / max(nonempty, 1)
        return rows >= min_rows and rows * N * K >= self.loop_min_macs


def _ws_available(device: torch.device) -> bool:
    """Whether the warp-specialized kernels (kernels/grouped_gemm_ws.py) run on `device`."""
    return not _INTERPRET and device.type == "cuda" and ws.available(device)


def _kernel(variant: str, device: torch.device, ws_takes, tma_takes: bool) -> str:
    """The one place a grouped GEMM's kernel is chosen -> "interp" (CPU tensors or TRITON_INTERPRET:
    the pointer kernel with small fixed blocks), "ws", "tma" or "ptr". variant: the policy's (or a
    caller's); ws_takes(): whether the warp-specialized kernel takes these operands (asked only
    where it runs); tma_takes: whether the TMA kernel does. "ws" falls back to "tma" where the ws
    kernel runs but refuses the operands; on a GPU without it, "ws" runs "ptr"."""
    if _INTERPRET or device.type != "cuda":
        return "interp"
    if variant == "ws" and ws.available(device):
        if ws_takes():
            return "ws"
        variant = "tma"
    return "tma" if variant == "tma" and tma_takes else "ptr"


def _scratch(size: int, align: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator():
    """Device-side tensor descriptors need a global scratch allocator (128 B per descriptor).
    Triton keeps it per thread (a context variable): set it at every launch, since autograd
    runs the backward on its own thread."""
    triton.set_allocator(_scratch)


# ----------------------------------------------------------------------------------------------
# Public wrappers: validate, allocate, launch.



def check_fp8(name: str, q, layout: str, dims: int) -> None:
    """Raises ValueError unless q is an Fp8Tensor of `layout` with `dims`-D data whose contraction
    (last stored) dimension is a multiple of 128 and whose scale has the layout's shape."""
    if not isinstance(q, Fp8Tensor):
        raise ValueError(f"{name}: expected an Fp8Tensor, got {type(q).__name__}")
    if q.layout != layout:
        raise ValueError(f"{name}: expected layout {layout!r}, got {q.layout!r}")
    if q.data.dtype != FP8_DTYPE or q.scale.dtype != torch.float32:
        raise ValueError(f"{name}: expected {FP8_DTYPE} data and float32 scales, got {q.data.dtype}, {q.scale.dtype}")
    if q.data.dim() != dims:
        raise ValueError(f"{name}: expected {dims}-D data, got shape {tuple(q.data.shape)}")
    if q.data.stride(-1) != 1:
        raise ValueError(f"{name}: data must be contiguous along its last dimension, strides {q.data.stride()}")
    *lead, r, c = q.data.shape
    if layout == "1x128":
        want = (*lead, r, -(-c // TILE))
        if c % TILE:
            raise ValueError(f"{name}: contraction dim {c} is not divisible by {TILE}")
    elif layout == "128x1":
        want = (r, -(-c // TILE))  # data [K, M]: tiles of 128 tokens along M, last may be partial
    else:
        want = (*lead, -(-r // TILE), -(-c // TILE))
        if c % TILE:
            raise ValueError(f"{name}: contraction dim {c} is not divisible by {TILE}")
    if tuple(q.scale.shape) != want:
        raise ValueError(f"{name}: scale shape {tuple(q.scale.shape)} does not match data "
                         f"{tuple(q.data.shape)} for layout {layout!r} (expected {want})")


def prepare_offsets(group_offsets, E: int, M: int, device, validate: bool) -> Tensor:
    """group_offsets (tensor or list, [E+1]) -> int32 contiguous tensor on `device`; with
    validate, checks the contract of the module docstring (one host sync)."""
    off = torch.as_tensor(group_offsets)
    if off.dim() != 1 or off.numel() != E + 1:
        raise ValueError(f"group_offsets: expected shape [{E + 1}] (E + 1 for E={E} experts), got {tuple(off.shape)}")
    if off.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"group_offsets: expected int32 or int64, got {off.dtype}")
    if validate:
        h = off.cpu().tolist()
        if h[0] != 0:
            raise ValueError(f"group_offsets[0] = {h[0]}: must be 0")
        for i in range(E):
            if h[i + 1] < h[i]:
                raise ValueError(f"group_offsets not non-decreasing: offsets[{i}]={h[i]} > offsets[{i + 1}]={h[i + 1]}")
        for i, v in enumerate(h):
            if v % TILE:
                raise ValueError(f"group_offsets[{i}] = {v} is not a multiple of {TILE} (segments start 128-aligned)")
        if h[E] > M:
            raise ValueError(f"group_offsets[{E}] = {h[E]} exceeds the {M} rows of the operands")
    return off.to(device=device, dtype=torch.int32).contiguous()


def _m_hint(M: int) -> int:
    return 1 << max(M - 1, 1).bit_length()


def launch_mgrouped(a: Fp8Tensor, b: Fp8Tensor, off: Tensor, out: Tensor, policy: GemmPolicy = GemmPolicy(),
                    variant: str | None = None, _promote: bool = True) -> Tensor:
    """Launches the m-grouped kernel on validated operands: a "1x128" [M, K], b "128x128"
    [E, N, K], off int32 [E+1] on the device, out [M, N] (bf16, or fp32 for tests).
    The kernel: `_kernel` of variant (None: `policy.variant`): "ws" (Hopper, BF16 out; else
    "tma"), "tma" or "ptr"."""
    M, K = a.data.shape
    E, N, _ = b.data.shape
    if M == 0 or N == 0:
        return out
    kernel = _kernel(variant or policy.variant, a.data.device, lambda: _promote and ws.supported(a, b, out),
                     N % 16 == 0 and out.is_contiguous())
    if kernel == "ws":
        return ws.launch_mgrouped_ws(a, b, off, out, policy.sm_reserve)
    a_data, b_data, b_scale = a.data.contiguous(), b.data.contiguous(), b.scale.contiguous()
    ast = a.scale.t().contiguous()  # [K/128, M]: contiguous per-step loads (a few MB, ~us)
    sms = num_sms(a.data.device)
    e_pow2 = max(triton.next_power_of_2(E), 2)
    if kernel == "interp":
        bm, bn = 32, 32
        grid = (min(sms, triton.cdiv(M, bm) * triton.cdiv(N, bn)),)
        _mgrouped_gemm_kernel[grid](a_data, ast, b_data, b_scale, out, off, M, N, K, E, _m_hint(M),
                                    a_data.stride(0), b_scale.stride(0), b_scale.stride(1), out.stride(0),
                                    NUM_SMS=grid[0], E_POW2=e_pow2, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=2)
        return out
    if kernel == "tma":
        _ensure_allocator()
        grid = lambda meta: (min(meta["OCC"] * sms,
                                 triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)
        _mgrouped_tma_tuned[grid](a_data, ast, b_data, b_scale, out, off, M, N, K, E, _m_hint(M),
                                  b_scale.stride(0), b_scale.stride(1), E_POW2=e_pow2, PROMOTE=_promote)
    else:
        grid = lambda meta: (min(sms, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)
        _mgrouped_tuned[grid](a_data, ast, b_data, b_scale, out, off, M, N, K, E, _m_hint(M),
                              a_data.stride(0), b_scale.stride(0), b_scale.stride(1), out.stride(0),
                              NUM_SMS=sms, E_POW2=e_pow2)
    return out


def launch_kgrouped(dy: Fp8Tensor, x: Fp8Tensor, off: Tensor, out: Tensor, accumulate: bool,
                    policy: GemmPolicy = GemmPolicy(), variant: str | None = None, _promote: bool = True) -> Tensor:
    """Launches the k-grouped kernel on validated operands: dy "128x1" data [N, M], x "128x1"
    data [K, M], off int32 [E+1], out [E, N, K] fp32 (accumulated into when `accumulate`).
    The kernel: `_kernel` of variant (None: `policy.variant`): "ws" (Hopper, N and K % 128 == 0;
    else "tma"), "tma" or "ptr"."""
    N, M = dy.data.shape
    K = x.data.shape[0]
    E = off.numel() - 1
    if E == 0 or N == 0 or K == 0:
        return out
    kernel = _kernel(variant or policy.variant, dy.data.device,
                     lambda: _promote and ws.kgrouped_supported(dy, x, out), M % 16 == 0)
    if kernel == "ws":
        return ws.launch_kgrouped_ws(dy, x, off, out, accumulate, policy.sm_reserve, policy.kg_stages)
    a, b = dy.data.contiguous(), x.data.contiguous()
    ast, bst = dy.scale.t().contiguous(), x.scale.t().contiguous()  # [ceil(M/128), N|K]
    if kernel == "interp":
        bn, bk = 32, 32
        grid = (triton.cdiv(N, bn) * triton.cdiv(K, bk), E)
        _kgrouped_gemm_kernel[grid](a, ast, b, bst, out, off, N, K, _m_hint(M), a.stride(0), b.stride(0),
                                    out.stride(0), out.stride(1), ACCUMULATE=accumulate, MASK_T=M % TILE != 0,
                                    BLOCK_N=bn, BLOCK_K=bk, GROUP_N=2)
        return out
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]) * triton.cdiv(K, meta["BLOCK_K"]), E)
    if kernel == "tma":
        _ensure_allocator()
        _kgrouped_tma_tuned[grid](a, ast, b, bst, out, off, M, N, K, _m_hint(M), out.stride(0), out.stride(1),
                                  ACCUMULATE=accumulate, PROMOTE=_promote)
    else:
        _kgrouped_tuned[grid](a, ast, b, bst, out, off, N, K, _m_hint(M), a.stride(0), b.stride(0),
                              out.stride(0), out.stride(1), ACCUMULATE=accumulate, MASK_T=M % TILE != 0)
    return out


def transpose_weight(w: Fp8Tensor, impl: str | None = None) -> Fp8Tensor:
    """ "128x128" W [(E,) N, K] -> "128x128" Wᵀ [(E,) K, N]: FP8 bytes transposed, scale grid
    transposed, no requantization (a 128x128 tile transposed is the same tile). Hopper's FP8
    tensor cores need the contraction dim contiguous, so dgrad (contraction over N) multiplies
    by this copy. Needs N % 128 == 0. Measured on an H200: reading W transposed inside the GEMM
    instead ran at 166 TFLOP/s, the copy costs ~5% of the GEMM."""
    if not isinstance(w, Fp8Tensor) or w.layout != "128x128" or w.data.dim() not in (2, 3):
        raise ValueError("transpose_weight: expected a '128x128' Fp8Tensor [N, K] or [E, N, K]")
    N, K = w.data.shape[-2:]
    if N % TILE:
        raise ValueError(f"transpose_weight: N={N} is not divisible by {TILE}")
    if not use_triton(w.data, impl):
        return transpose_weight_ref(w)
    scale_t = w.scale.transpose(-1, -2).contiguous()
    x = w.data.contiguous().view(torch.uint8)
    x3 = x.unsqueeze(0) if x.dim() == 2 else x
    y = torch.empty(x3.shape[0], K, N, dtype=torch.uint8, device=x.device)
    if x3.numel():
        BLOCK = 64
        _transpose_kernel[(triton.cdiv(K, BLOCK), triton.cdiv(N, BLOCK), x3.shape[0])](x3, y, N, K, BLOCK=BLOCK)
    y = y.view(FP8_DTYPE)
    return Fp8Tensor(y[0] if x.dim() == 2 else y, scale_t, "128x128")


def fp8_grouped_gemm(a: Fp8Tensor, b: Fp8Tensor, group_offsets, *, transpose_b: bool = False,
                     validate: bool = True, impl: str | None = None, host_offsets: list | None = None,
                     policy: GemmPolicy = GemmPolicy()) -> Tensor:
    """m-grouped FP8 GEMM (experts fprop / dgrad) -> BF16 [M, N_out].

    a: "1x128" [M, Kc] (the stacked, 128-aligned segments of all local experts).
    b: "128x128" expert weights, data [E, N, K], scale [E, ceil(N/128), K/128].
    fprop (transpose_b=False): Kc == K, out[m] = a[m] · b[e]ᵀ, N_out = N.
    dgrad (transpose_b=True):  Kc == N (N % 128 == 0), out[m] = a[m] · b[e], N_out = K; multiplies
    by `transpose_weight(b)` (pass that yourself with transpose_b=False to reuse the copy).
    group_offsets: see the module docstring (rows outside every segment come out 0).
    host_offsets: the same offsets as a host list, when the caller has them (the MoE layer does):
    then the GPU default is `policy.mgrouped_impl_host`, which may be the per-expert cuBLAS loop
    (no sync) on GPUs where the warp-specialized kernel does not run.
    impl: None (the policy's choice), "triton", "cublas" (per-expert loop of blockwise
    torch._scaled_mm) or "ref". policy: `GemmPolicy`, which implementation runs on the GPU.
    """
    check_fp8("fp8_grouped_gemm: a", a, "1x128", 2)
    check_fp8("fp8_grouped_gemm: b", b, "128x128", 3)
    M, Kc = a.data.shape
    E, N, K = b.data.shape
    if transpose_b:
        if N % TILE:
            raise ValueError(f"fp8_grouped_gemm: transpose_b needs the weights' N={N} divisible by {TILE}")
        if Kc != N:
            raise ValueError(f"fp8_grouped_gemm: a has {Kc} columns, b[e] has N={N} rows (transpose_b=True)")
    elif Kc != K:
        raise ValueError(f"fp8_grouped_gemm: a has K={Kc} columns, b has K={K}")
    if a.data.device != b.data.device:
        raise ValueError(f"fp8_grouped_gemm: a on {a.data.device}, b on {b.data.device}")
    off = prepare_offsets(group_offsets, E, M, a.data.device, validate)
    if impl is None and a.data.is_cuda and policy.mgrouped_lib == "deepgemm":
        dg = deepgemm.load()
        if dg is None:
            raise ValueError(f"GemmPolicy(mgrouped_lib='deepgemm'): `import deep_gemm` failed. {deepgemm.INSTALL}")
        return deepgemm.m_grouped(a, transpose_weight(b) if transpose_b else b, deepgemm.m_indices(off, M), dg)
    Kb, Nout = (N, K) if transpose_b else (K, N)
    cublas_ok = a.data.is_cuda and (Kb // TILE) % 4 == 0 and Nout % TILE == 0
    if impl == "cublas" and not cublas_ok:
        raise ValueError(f"fp8_grouped_gemm: impl='cublas' needs CUDA, K/128 % 4 == 0 and N % 128 == 0 "
                         f"(K={Kb}, N={Nout})")
    if impl == "cublas" or (impl is None and cublas_ok and policy.mgrouped_impl_host == "cublas"
                            and host_offsets is not None and policy.loop_pays(host_offsets, Nout, Kb)
                            and not _ws_available(a.data.device)):
        if transpose_b:
            b = transpose_weight(b)
        h = host_offsets if host_offsets is not None else off.tolist()
        return _mgrouped_cublas_loop(a, b, h, torch.empty(M, Nout, dtype=torch.bfloat16, device=a.data.device))
    if not use_triton(a.data, impl):
        return fp8_grouped_gemm_ref(a, b, off, transpose_b=transpose_b)
    if transpose_b:
        b = transpose_weight(b, impl)
    out = torch.empty(M, b.data.shape[1], dtype=torch.bfloat16, device=a.data.device)
    return launch_mgrouped(a, b, off, out, policy)


def choose_mgrouped_lib(n_experts: int, rows_per_expert: int, shapes_NK: list[tuple[int, int]], device: torch.device,
                        dg=None, timer=None) -> tuple[str, dict]:
    """`recipe.gemm=auto`: the m-grouped library for the experts' GEMMs on this device. "deepgemm"
    where it imports, gives moefp8's outputs bit for bit on fresh random operands of every shape
    (each (N, K) of `shapes_NK`: the fprop with weights [E, N, K] and the dgrad through their
    transpose; `n_experts` segments of `rows_per_expert` rows, a multiple of 128; activations with
    outliers) and takes less time over all of them; else "moefp8". -> (lib, why: a dict with
    each library's total ms, whether the outputs were identical, or the reason none was timed).
    dg: the deep_gemm module (default `deepgemm.load()`); timer(fn) -> ms (default: triton's
    do_bench median)."""
    from moefp8.kernels.quant import quant_rowwise, quant_weight

    if device.type != "cuda" and dg is None:
        return "moefp8", {"why": f"not a CUDA device ({device.type})"}
    dg = dg if dg is not None else deepgemm.load()
    if dg is None:
        return "moefp8", {"why": "deep_gemm does not import: optional, the README says how to build it"}
    if timer is None:
        from triton.testing import do_bench

        def timer(fn):
            return do_bench(fn, warmup=25, rep=100, return_mode="median")
    g = torch.Generator(device=device).manual_seed(0)
    rows = -(-rows_per_expert // TILE) * TILE
    off = [e * rows for e in range(n_experts + 1)]
    off_dev = torch.tensor(off, dtype=torch.int32).to(device)
    M = off[-1]
    m_idx = deepgemm.m_indices(off_dev, M)
    ms, identical = {"moefp8": 0.0, "deepgemm": 0.0}, True
    for N, K in shapes_NK:
        w8 = quant_weight(torch.randn(n_experts, N, K, generator=g, device=device) * K**-0.5)
        w8_t = transpose_weight(w8)
        for b, Kc in ((w8, K), (w8_t, N)):  # fprop: a [M, K]; dgrad: a [M, N] times the transpose
            x = torch.randn(M, Kc, generator=g, device=device)
            x[::97] *= 100  # outliers: tiles of very different scales
            a = quant_rowwise(x.bfloat16())
            ours = fp8_grouped_gemm(a, b, off_dev, validate=False, host_offsets=off)
            try:  # a DeepGEMM build that fails here (its JIT, a shape it refuses) leaves moefp8's kernels, said why
                theirs = deepgemm.m_grouped(a, b, m_idx, dg)
                ms["deepgemm"] += timer(lambda: deepgemm.m_grouped(a, b, m_idx, dg))
            except Exception as e:  # noqa: BLE001 -- whatever it raised, moefp8 runs the same GEMMs
                return "moefp8", {"why": f"DeepGEMM failed on [{M}, {Kc}] x [{n_experts}, {b.data.shape[1]}, {Kc}]: "
                                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            identical &= torch.equal(ours, theirs)
            ms["moefp8"] += timer(lambda: fp8_grouped_gemm(a, b, off_dev, validate=False, host_offsets=off))
    why = {"ms": {k: round(v, 4) for k, v in ms.items()}, "identical": identical}
    del w8, w8_t, x, a, ours, theirs
    if device.type == "cuda":  # the trial's operands (~1 GB at 16B EP4) back to the device before the model is built
        torch.cuda.empty_cache()
    return ("deepgemm" if identical and ms["deepgemm"] < ms["moefp8"] else "moefp8"), why


def fp8_grouped_gemm_wgrad(dy: Fp8Tensor, x: Fp8Tensor, group_offsets, out: Tensor | None = None, *,
                           validate: bool = True, impl: str | None = None, host_offsets: list | None = None,
                           policy: GemmPolicy = GemmPolicy()) -> Tensor:
    """k-grouped FP8 GEMM (experts wgrad) -> FP32 [E, N, K]: out[e] (+)= dY_eᵀ · X_e.

    dy: "128x1" of dY [M, N] (data [N, M], scale [N, ceil(M/128)]).
    x:  "128x1" of X [M, K]  (data [K, M], scale [K, ceil(M/128)]).
    out: optional FP32 [E, N, K] (contiguous) to accumulate into (a main grad).
    impl: None (GPU: `policy.wgrad_impl`, or with host_offsets the loop where `policy.wgrad_impl_host`
    says it pays), "triton", "cublas" (per-expert loop, CUDA only) or "ref".
    group_offsets [E+1]: see the module docstring; E is len(group_offsets) - 1. Experts with no
    tokens give exact zeros (or leave out unchanged).
    """
    check_fp8("fp8_grouped_gemm_wgrad: dy", dy, "128x1", 2)
    check_fp8("fp8_grouped_gemm_wgrad: x", x, "128x1", 2)
    N, M = dy.data.shape
    K, Mx = x.data.shape
    if M != Mx:
        raise ValueError(f"fp8_grouped_gemm_wgrad: dy has {M} tokens, x has {Mx}")
    E = torch.as_tensor(group_offsets).numel() - 1
    if E < 0:
        raise ValueError("fp8_grouped_gemm_wgrad: group_offsets is empty, expected [E+1] entries")
    off = prepare_offsets(group_offsets, E, M, dy.data.device, validate)
    if out is not None:
        if out.shape != (E, N, K) or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"fp8_grouped_gemm_wgrad: out must be a contiguous float32 [{E}, {N}, {K}], "
                             f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    if impl == "cublas" or (impl is None and dy.data.is_cuda and policy.wgrad_impl == "cublas"):
        return _wgrad_cublas_loop(dy, x, host_offsets if host_offsets is not None else off.tolist(), out)
    if (impl is None and dy.data.is_cuda and host_offsets is not None and policy.wgrad_impl_host == "cublas"
            and policy.loop_pays(host_offsets, N, K, min_rows=2048)):
        return _wgrad_cublas_loop(dy, x, host_offsets, out)
    if not use_triton(dy.data, impl):
        return fp8_grouped_gemm_wgrad_ref(dy, x, off, out)
    accumulate = out is not None
    if out is None:
        out = torch.empty(E, N, K, dtype=torch.float32, device=dy.data.device)
    return launch_kgrouped(dy, x, off, out, accumulate, policy)


def _mgrouped_cublas_loop(a: Fp8Tensor, b: Fp8Tensor, h: list, out: Tensor) -> Tensor:
    """m-grouped GEMM as a loop of blockwise cuBLAS GEMMs, one per non-empty expert, at host
    offsets h. BF16 out; rows past h[-1] are 0."""
    for e in range(len(h) - 1):
        s, t = h[e], h[e + 1]
        if t > s:
            torch._scaled_mm(a.data[s:t], b.data[e].t(), col_major(a.scale[s:t]),
                             b.scale[e].contiguous().t(), out_dtype=torch.bfloat16, out=out[s:t])
    out[h[-1]:].zero_()
    return out


def _wgrad_cublas_loop(dy: Fp8Tensor, x: Fp8Tensor, h: list, out: Tensor | None) -> Tensor:
    """k-grouped wgrad as a loop of cuBLAS blockwise 1x128 x 1x128 GEMMs, one per non-empty
    expert, at host offsets h. FP32 out; empty experts get zeros."""
    N, M = dy.data.shape
    K = x.data.shape[0]
    E = len(h) - 1
    res = out if out is not None else torch.empty(E, N, K, dtype=torch.float32, device=dy.data.device)
    # The scale grids transposed ("128x1" scales are stored column-major, so no copy): an expert's rows
    # of them are contiguous, the column-major [N, T/128] scale_a and the [T/128, K] scale_b cuBLAS reads
    dy_sT, x_sT = dy.scale.t().contiguous(), x.scale.t().contiguous()  # [M/128, N], [M/128, K]
    for e in range(E):
        s, t = h[e], h[e + 1]
        if t == s:
            if out is None:
                res[e].zero_()
            continue
        sa = dy_sT[s // TILE:t // TILE].t()
        sb = x_sT[s // TILE:t // TILE]
        if out is None:
            torch._scaled_mm(dy.data[:, s:t], x.data[:, s:t].t(), sa, sb, out_dtype=torch.float32, out=res[e])
        else:
            res[e] += torch._scaled_mm(dy.data[:, s:t], x.data[:, s:t].t(), sa, sb, out_dtype=torch.float32)
    return res


# ----------------------------------------------------------------------------------------------
# Pure-PyTorch reference twins: dequantize, multiply in fp32.


def fp8_grouped_gemm_ref(a: Fp8Tensor, b: Fp8Tensor, group_offsets, *, transpose_b: bool = False) -> Tensor:
    """Per-expert loop over dequantized operands, fp32 matmul, BF16 out; rows outside every
    segment are 0 (as the kernel)."""
    off = torch.as_tensor(group_offsets).tolist()
    A = a.dequantize(torch.float32)
    B = b.dequantize(torch.float32)
    n_out = B.shape[2] if transpose_b else B.shape[1]
    out = torch.zeros(A.shape[0], n_out, dtype=torch.float32, device=A.device)
    for e in range(len(off) - 1):
        s, t = off[e], off[e + 1]
        if t > s:
            out[s:t] = A[s:t] @ (B[e] if transpose_b else B[e].t())
    return out.to(torch.bfloat16)


def fp8_grouped_gemm_wgrad_ref(dy: Fp8Tensor, x: Fp8Tensor, group_offsets, out: Tensor | None = None) -> Tensor:
    """dW[e] = dY_eᵀ X_e from dequantized operands in fp32; accumulates into out when given."""
    off = torch.as_tensor(group_offsets).tolist()
    DY = dy.dequantize(torch.float32)  # [M, N]
    X = x.dequantize(torch.float32)  # [M, K]
    E = len(off) - 1
    res = torch.zeros(E, DY.shape[1], X.shape[1], dtype=torch.float32, device=DY.device)
    for e in range(E):
        s, t = off[e], off[e + 1]
        if t > s:
            res[e] = DY[s:t].t() @ X[s:t]
    if out is None:
        return res
    out += res
    return out
