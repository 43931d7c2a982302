"""Permute tokens into per-expert segments (FP8) and combine expert outputs back (BF16).

Shapes (legend in `moefp8/__init__.py`): T tokens, K top-k slots, H hidden, E experts (local to
this rank), M permuted rows (every routed (token, slot) pair once, each expert's segment padded
to a multiple of 128 rows, the grouped GEMMs' block).

* `build_layout(topk_idx_TK, E)` -> `PermuteLayout`: where each (token, slot) goes. Within an
  expert, rows are in ascending (token, slot) order, so the layout is deterministic. On the GPU:
  two Triton passes over blocks of pairs around one read-back of the counts (the only host sync);
  with `bound=True` (EP = 1) none: the rows are sized by their static bound instead.
* `permute_fp8(x8_TH, layout)`: gathers FP8 rows and their scales into the layout; padding
  rows are zeros with scale 1 (`permute_rows`: the same for rows of any dtype, no scales). Optionally multiplies each row's scales by a per-(token, slot)
  factor (the routing weight in the backward pass: the gradient stays FP8).
* `permute_requant_colwise(x8_TH, layout)`: the permuted rows' "128x1" copy straight from the
  unpermuted "1x128" rows (the fc1 wgrad operand), without writing the permuted row-wise copy.
* `unpermute_combine(y_MH, layout, w_TK)`: out[t] = sum_k w[t, k] * y[row[t, k]] in fp32 ->
  BF16; `combine_backward` gives dw exactly (fp32 dot of dout and y) and, if asked, dy in BF16.

Each Triton kernel has its `_ref` twin; the default picks Triton on CUDA and the reference on CPU.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from moefp8.fp8 import FP8_DTYPE, TILE, Fp8Tensor, check_scale_fmt, col_major
from moefp8.kernels import num_sms, use_triton
from moefp8.kernels.quant import (LAUNCH, _colwise_program, _quant_words4_store, _scales, _unpack_e4m3x4,
                                  requant_colwise, requant_colwise_ref)

ALIGN = 128  # expert segments start at multiples of the grouped GEMMs' row block


def segment_offsets(counts: list[int]) -> list[int]:
    """Per-expert row counts -> the grouped GEMMs' offsets [E+1] (host ints), each expert's
    segment padded to ALIGN rows."""
    out = [0]
    for c in counts:
        out.append(out[-1] + -(-c // ALIGN) * ALIGN)
    return out


def rows_bound(n_pairs: int, num_experts: int) -> int:
    """The most rows a layout of n_pairs (token, slot) pairs over num_experts experts can take: each
    non-empty expert's segment pads at most ALIGN - 1 rows. A multiple of ALIGN."""
    return -(-(n_pairs + min(num_experts, n_pairs) * (ALIGN - 1)) // ALIGN) * ALIGN


@dataclass(frozen=True)
class PermuteLayout:
    """Where each routed (token, slot) pair lives in the permuted tensor.

    row_TK:  int32 [T, K]  destination row of each pair; -1 where the slot is not routed here
    src_M:   int32 [M]     pair index t*K + k of each row; -1 for padding rows (and rows past offsets[E])
    offsets: int32 [E+1]   segment starts on the device, multiples of 128 (grouped GEMM contract)
    counts:  list[int]     tokens per expert, on the host; None for a layout built without reading them
                           back (`build_layout(bound=True)` or `cap=`)
    M:       int           rows including padding: offsets[E], or the static bound `rows_bound` past it,
                           or the given cap
    overflow: int32 [1]    (`build_layout(cap=)` only, else None) 1 where the pairs needed more rows than M:
                           the pairs past M then have no row (as if not routed here) and the layout is wrong
    """

    row_TK: Tensor
    src_M: Tensor
    offsets: Tensor
    counts: list | None
    M: int
    overflow: Tensor | None = None

    @property
    def num_experts(self) -> int:
        return len(self.counts) if self.counts is not None else self.offsets.numel() - 1

    @property
    def offsets_host(self) -> list[int] | None:
        """`offsets` on the host (from the counts: no device sync); None where the counts are not on the host."""
        return segment_offsets(self.counts) if self.counts is not None else None


# ----------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _layout_count_kernel(idx_ptr, cnt_ptr, N, E, NB, BLOCK: tl.constexpr, E_CHUNK: tl.constexpr):
    """Per block b of BLOCK pairs: cnt[e, b] = its pairs on expert e, cnt[E, b] = its ids >= E
    (expert-major, so that the scan over blocks runs along the contiguous dimension)."""
    b = tl.program_id(0)
    p = b * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(idx_ptr + p, mask=p < N, other=-1)  # int32 or int64: compared before any cast
    e = tl.where((ids >= 0) & (ids < E), ids, -1).to(tl.int32)
    for e0 in range(0, E, E_CHUNK):  # one-hot [BLOCK, E_CHUNK] summed over the block
        e_c = e0 + tl.arange(0, E_CHUNK)
        n_c = tl.sum((e[:, None] == e_c[None, :]).to(tl.int32), axis=0)
        tl.store(cnt_ptr + e_c * NB + b, n_c, mask=e_c < E)
    n_bad = tl.sum((ids >= E).to(tl.int32), axis=0)
    one = tl.arange(0, 1)  # the interpreter wants tensor masks
    tl.store(cnt_ptr + E * NB + b + one, n_bad + one * 0)


@triton.jit
def _layout_place_kernel(idx_ptr, cnt_ptr, csum_ptr, row_ptr, src_ptr, off_ptr, over_ptr, N, E, NB, M,
                         BLOCK: tl.constexpr, E_CHUNK: tl.constexpr, ALIGN: tl.constexpr):
    """Per block: each pair's row = offsets[e] + (pairs of e in earlier blocks) + (pairs of e
    earlier in this block). csum = the inclusive cumsum of cnt [E + 1, NB] over blocks, its last
    column the counts. Every program rebuilds offsets from the counts; program 0 stores them, and chunk c
    of experts writes its padding rows (-1) in program c % NB. M: the rows src has (from the host's
    counts, their static bound or a cap): nothing is written past them, whatever the device's counts say;
    the offsets stored are clamped to M, and over[0] (program 0) says whether the counts needed more."""
    b = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    p = b * BLOCK + j
    ids = tl.load(idx_ptr + p, mask=p < N, other=-1)
    ok = (ids >= 0) & (ids < E)  # ids >= E: raised by the host (or ruled out by the dispatch's checks)
    e = tl.where(ok, ids, 0).to(tl.int32)
    rank = tl.sum(((e[:, None] == e[None, :]) & ok[None, :] & (j[None, :] < j[:, None])).to(tl.int32), axis=1)
    before = tl.load(csum_ptr + e * NB + b) - tl.load(cnt_ptr + e * NB + b)
    seg = tl.zeros((BLOCK,), tl.int32)  # offsets[e]
    run = tl.zeros((1,), tl.int32)
    for e0 in range(0, E, E_CHUNK):  # offsets: exclusive cumsum of the padded counts, chunk by chunk
        e_c = e0 + tl.arange(0, E_CHUNK)
        c = tl.load(csum_ptr + e_c * NB + NB - 1, mask=e_c < E, other=0)
        padded = (c + ALIGN - 1) // ALIGN * ALIGN
        start_c = run + tl.cumsum(padded, axis=0) - padded
        tl.store(off_ptr + e_c, tl.minimum(start_c, M), mask=(e_c < E) & (e_c * 0 + b == 0))  # tensor masks: the interpreter
        seg += tl.sum(tl.where(e[:, None] == e_c[None, :], start_c[None, :], 0), axis=1)
        run += tl.sum(padded, axis=0)
        if (e0 // E_CHUNK) % NB == b:
            pad = (start_c + c)[:, None] + tl.arange(0, ALIGN)[None, :]
            tl.store(src_ptr + pad, -1, mask=(pad < (start_c + padded)[:, None]) & (pad < M))
    one = tl.arange(0, 1)
    tl.store(off_ptr + E + one, tl.minimum(run, M), mask=one * 0 + b == 0)
    tl.store(over_ptr + one, (run > M).to(tl.int32), mask=one * 0 + b == 0)
    dest = seg + before + rank
    ok = ok & (dest < M)  # (past M: a pair the given counts did not count; no row, so no later read past M)
    tl.store(row_ptr + p, tl.where(ok, dest, -1), mask=p < N)
    tl.store(src_ptr + dest, p, mask=ok)


@triton.jit
def _permute_kernel(x_ptr, xs_ptr, w_ptr, src_ptr, o_ptr, os_ptr, H, K, stride_x, stride_xs, stride_xsg, stride_o,
                    stride_os, stride_osg, G, G_PAD: tl.constexpr, HAS_S: tl.constexpr, HAS_W: tl.constexpr, BLOCK_H: tl.constexpr):
    m = tl.program_id(0)  # one output row per program, all of H
    src = tl.load(src_ptr + m)
    ok = src >= 0
    t = tl.where(ok, src // K, 0).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        v = tl.load(x_ptr + t * stride_x + offs, mask=(offs < H) & (offs * 0 + src >= 0), other=0.0)
        tl.store(o_ptr + m.to(tl.int64) * stride_o + offs, v, mask=offs < H)
    if HAS_S:  # FP8 rows carry their 1x128 scales
        offs_g = tl.arange(0, G_PAD)
        g_ok = (offs_g * 0 + src >= 0) & (offs_g < G)  # the interpreter wants tensor masks
        s = tl.load(xs_ptr + t * stride_xs + offs_g * stride_xsg, mask=g_ok, other=1.0)
        if HAS_W:
            s = s * tl.load(w_ptr + tl.where(ok, src, 0) + offs_g * 0, mask=g_ok, other=1.0)
        tl.store(os_ptr + m.to(tl.int64) * stride_os + offs_g * stride_osg, s, mask=offs_g < G)


@triton.jit
def _gather_words(x_ptr, s_ptr, src_ptr, rows, M, K, w_off, s_off, offs_w, stride_xw, stride_st):
    """Words [len(rows), BLOCK_K/4] (int32, four e4m3 codes each) of the permuted rows `rows` and their
    row-wise scales, gathered from the unpermuted rows; padding rows (src -1) and rows past M read code
    0 with scale 0: value 0, which leaves every amax alone."""
    src = tl.load(src_ptr + rows, mask=rows < M, other=-1)
    ok = src >= 0
    t = tl.where(ok, src // K, 0).to(tl.int64)
    w = tl.load(x_ptr + t[:, None] * stride_xw + w_off + offs_w[None, :], mask=ok[:, None], other=0)
    return w, tl.load(s_ptr + t * stride_st + s_off, mask=ok, other=0.0)


@triton.jit(do_not_specialize=["M16", "x_row16", "o_row16"])
def _permute_requant_colwise_kernel(x_ptr, s_ptr, src_ptr, o_ptr, os_ptr, M16, K, x_row16, stride_st, stride_sg,
                                    o_row16, stride_osk, stride_osm, num_kb, num_mb, BLOCK_K: tl.constexpr,
                                    GROUP_K: tl.constexpr, STAGES: tl.constexpr, EVEN: tl.constexpr):
    """`quant._requant_colwise_words_kernel` with its rows gathered through src_M: tile (BLOCK_K
    columns, one 128-row group of the layout) read as four interleaved word tiles (rows 4i + j),
    transposed in registers, stored as the "128x1" words. Same numerics, bit for bit."""
    stride_xw = x_row16 * 4
    stride_ow = o_row16 * 4
    M = M16 * 16
    offs_i = tl.arange(0, 32)
    offs_w = tl.arange(0, BLOCK_K // 4)
    for tile in tl.range(tl.program_id(0), num_kb * num_mb, tl.num_programs(0), num_stages=STAGES):
        pid_k, pid_m = _colwise_program(tile, num_kb, num_mb, GROUP_K)
        k0 = pid_k * BLOCK_K
        m0 = pid_m.to(tl.int64) * 128
        rows = m0 + 4 * offs_i
        w_off, s_off = k0 // 4, (k0 // 128) * stride_sg
        w0, s0 = _gather_words(x_ptr, s_ptr, src_ptr, rows, M, K, w_off, s_off, offs_w, stride_xw, stride_st)
        w1, s1 = _gather_words(x_ptr, s_ptr, src_ptr, rows + 1, M, K, w_off, s_off, offs_w, stride_xw, stride_st)
        w2, s2 = _gather_words(x_ptr, s_ptr, src_ptr, rows + 2, M, K, w_off, s_off, offs_w, stride_xw, stride_st)
        w3, s3 = _gather_words(x_ptr, s_ptr, src_ptr, rows + 3, M, K, w_off, s_off, offs_w, stride_xw, stride_st)
        x00, x01, x02, x03 = _unpack_e4m3x4(w0, s0[:, None])
        x10, x11, x12, x13 = _unpack_e4m3x4(w1, s1[:, None])
        x20, x21, x22, x23 = _unpack_e4m3x4(w2, s2[:, None])
        x30, x31, x32, x33 = _unpack_e4m3x4(w3, s3[:, None])
        _quant_words4_store(x00, x01, x02, x03, x10, x11, x12, x13, x20, x21, x22, x23, x30, x31, x32, x33,
                            offs_i, offs_w, M16 * 4 - pid_m * 32, o_ptr + k0.to(tl.int64) * stride_ow + m0 // 4,
                            os_ptr + k0 * stride_osk + pid_m * stride_osm, stride_ow, stride_osk, EVEN)


@triton.jit
def _combine_kernel(y_ptr, row_ptr, w_ptr, o_ptr, a_ptr, H, stride_y, stride_o, stride_a, K: tl.constexpr,
                    ADD: tl.constexpr, BLOCK_H: tl.constexpr):
    """ADD: out = bf16(bf16(sum) + add) in fp32, the bits of a separate `sum + add` in BF16."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(K):  # slot order, one rounding per product and per sum (no FMA): as the reference
        r = tl.load(row_ptr + t * K + k)
        w = tl.load(w_ptr + t * K + k)
        mask = (offs_h < H) & (offs_h * 0 + r >= 0)
        y = tl.load(y_ptr + tl.maximum(r, 0).to(tl.int64) * stride_y + offs_h, mask=mask, other=0.0)
        acc += tl.where(mask, w * y.to(tl.float32), 0.0)
    if ADD:
        a = tl.load(a_ptr + t * stride_a + offs_h, mask=offs_h < H, other=0.0)
        acc = acc.to(tl.bfloat16).to(tl.float32) + a.to(tl.float32)
    tl.store(o_ptr + t * stride_o + offs_h, acc, mask=offs_h < H)


@triton.jit
def _combine_bwd_kernel(dz_ptr, s_ptr, y_ptr, row_ptr, w_ptr, dw_ptr, dy_ptr, src_ptr, T, M, H, stride_dz, stride_st,
                        stride_sc, stride_y, stride_dy, K: tl.constexpr, K_PAD: tl.constexpr, WANT_DW: tl.constexpr,
                        WANT_DY: tl.constexpr, DZ_FP8: tl.constexpr, BLOCK_H: tl.constexpr, PAD_ROWS: tl.constexpr):
    """DZ_FP8: dz is "1x128" FP8 with scales s [T, H/128] (any strides), dequantized here to the BF16
    value `Fp8Tensor.dequantize(bf16)` gives (q x s in fp32, rounded to bf16): no pass of its own.
    Programs past T (WANT_DY) write the zeros of dy's padding rows (src -1), PAD_ROWS rows each: dy
    needs no zeroing pass over all M rows."""
    if tl.program_id(0) >= T:
        offs_m = (tl.program_id(0) - T).to(tl.int64) * PAD_ROWS + tl.arange(0, PAD_ROWS)
        pad = tl.load(src_ptr + offs_m, mask=offs_m < M, other=0) < 0
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            tl.store(dy_ptr + offs_m[:, None] * stride_dy + offs_h[None, :],
                     tl.zeros((PAD_ROWS, BLOCK_H), dtype=dy_ptr.dtype.element_ty),
                     mask=pad[:, None] & (offs_h < H)[None, :])
        return
    t = tl.program_id(0).to(tl.int64)  # one token per program: dw needs all of H
    offs_k = tl.arange(0, K_PAD)
    rows = tl.load(row_ptr + t * K + offs_k, mask=offs_k < K, other=-1)
    ok = rows >= 0
    w = tl.load(w_ptr + t * K + offs_k, mask=ok, other=0.0)
    acc = tl.zeros((K_PAD, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        dz = tl.load(dz_ptr + t * stride_dz + offs_h, mask=offs_h < H, other=0.0).to(tl.float32)
        if DZ_FP8:
            s = tl.load(s_ptr + t * stride_st + (offs_h // 128) * stride_sc, mask=offs_h < H, other=0.0)
            dz = (dz * s).to(tl.bfloat16).to(tl.float32)
        mask = ok[:, None] & (offs_h < H)[None, :]
        if WANT_DW:
            y = tl.load(y_ptr + rows.to(tl.int64)[:, None] * stride_y + offs_h[None, :], mask=mask, other=0.0)
            acc += y.to(tl.float32) * dz[None, :]
        if WANT_DY:
            tl.store(dy_ptr + rows.to(tl.int64)[:, None] * stride_dy + offs_h[None, :], w[:, None] * dz[None, :],
                     mask=mask)
    if WANT_DW:
        tl.store(dw_ptr + t * K + offs_k, tl.sum(acc, axis=1), mask=offs_k < K)


# ----------------------------------------------------------------------------------------------
# Wrappers


def build_layout(topk_idx_TK: Tensor, num_experts: int, impl: str | None = None,
                 counts: list[int] | None = None, bound: bool = False, cap: int | None = None) -> PermuteLayout:
    """topk_idx_TK int [T, K], values in [0, E) or negative (not routed here) -> PermuteLayout.

    One host sync: the per-expert counts (and the number of ids >= E) in one read-back, which
    sizes src_M. Triton: 4 launches (count per block, cumsum over blocks, the read-back, place);
    ids >= E raise after the read-back (the message's max id costs a second sync, only then).
    counts: the per-expert counts, where the caller has them on the host already (an EP dispatch
    that exchanged them with its row counts, `Dispatched.counts`): no read-back, and the ids are
    taken as checked (the dispatch raised on bad ones). They must be the ids' counts: the reference
    raises where they are not; the Triton path writes nothing past the rows they size.
    bound: no read-back at all: M is the static `rows_bound(T * K, E)`, the rows past offsets[E]
    are padding (src -1; the m-grouped GEMMs write them as zeros, the k-grouped ones skip them) and
    `counts` is None. For ids known valid (the router's, at EP = 1): the Triton path does not check
    them (an id >= E would get no row), the reference still raises.
    cap (a multiple of ALIGN): no read-back either, M = cap rows, which may be too few (an EP rank's
    received pairs have no tight static bound): the pairs past them get no row, the offsets are
    clamped to M and `overflow` (on the device) says so; the caller must then not use the result
    (the training loop runs such a step again with exact layouts, dispatch.rows_factor). The ids are
    taken as valid as with bound."""
    _check_topk_idx(topk_idx_TK)
    if counts is not None and len(counts) != num_experts:
        raise ValueError(f"build_layout: {len(counts)} counts for {num_experts} experts")
    sizing = [name for name, given in (("counts", counts is not None), ("bound=True", bound), ("cap", cap is not None))
              if given]
    if len(sizing) > 1:
        raise ValueError(f"build_layout: {' and '.join(sizing)} each size the rows: give one")
    if cap is not None and (not isinstance(cap, int) or cap < 0 or cap % ALIGN):
        raise ValueError(f"build_layout: cap={cap!r}, expected a multiple of {ALIGN} rows >= 0")
    if not use_triton(topk_idx_TK, impl):
        return build_layout_ref(topk_idx_TK, num_experts, counts, bound, cap)
    T, K = topk_idx_TK.shape
    E, N, dev = num_experts, T * K, topk_idx_TK.device
    static = bound or cap is not None  # no read-back
    if N == 0:
        empty = torch.empty(0, dtype=torch.int32, device=dev)
        return PermuteLayout(empty.view(0, K), torch.full((cap or 0,), -1, dtype=torch.int32, device=dev),
                             torch.zeros(E + 1, dtype=torch.int32, device=dev), None if static else [0] * E, cap or 0,
                             torch.zeros(1, dtype=torch.int32, device=dev) if cap is not None else None)
    flat = topk_idx_TK.contiguous().view(-1)
    BLOCK, E_CHUNK = 128, min(64, triton.next_power_of_2(max(E, 1)))
    NB = triton.cdiv(N, BLOCK)
    cnt_EB = torch.empty(E + 1, NB, dtype=torch.int32, device=dev)  # row E: ids >= E
    _layout_count_kernel[(NB,)](flat, cnt_EB, N, E, NB, BLOCK=BLOCK, E_CHUNK=E_CHUNK, num_warps=4)
    csum_EB = torch.cumsum(cnt_EB, 1, dtype=torch.int32)  # along the contiguous dim (the outer-dim scan took 0.44 ms)
    if counts is None and not static:
        *counts, n_bad = csum_EB[:, -1].tolist()  # the host sync
        if n_bad:
            bad = int(flat.max())
            raise ValueError(f"build_layout: topk_idx holds expert {bad}, but there are only {E} experts")
    M = cap if cap is not None else rows_bound(N, E) if bound else segment_offsets(counts)[-1]
    row_TK = torch.empty(T, K, dtype=torch.int32, device=dev)
    # every row written (pairs and padding), but for the rows past offsets[E] that only a static size has
    src_M = torch.empty(M, dtype=torch.int32, device=dev)
    if static:
        src_M.fill_(-1)
    offsets = torch.empty(E + 1, dtype=torch.int32, device=dev)
    over = torch.empty(1, dtype=torch.int32, device=dev)
    _layout_place_kernel[(NB,)](flat, cnt_EB, csum_EB, row_TK, src_M, offsets, over, N, E, NB, M, BLOCK=BLOCK,
                                E_CHUNK=E_CHUNK, ALIGN=ALIGN, num_warps=4)
    return PermuteLayout(row_TK, src_M, offsets, None if static else counts, M, over if cap is not None else None)


def _check_topk_idx(topk_idx_TK: Tensor) -> None:
    if topk_idx_TK.dim() != 2 or topk_idx_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"build_layout: expected integer topk_idx [T, K], got {topk_idx_TK.dtype} "
                         f"{tuple(topk_idx_TK.shape)}")


def permute_fp8(x8: Fp8Tensor, layout: PermuteLayout, scale_by_TK: Tensor | None = None,
                impl: str | None = None, *, colmajor_scale: bool = False) -> Fp8Tensor:
    """x8 "1x128" [T, H] -> "1x128" [M, H] in the layout; padding rows: data 0, scale 1. The
    output's scales are stored column-major with colmajor_scale (for the grouped GEMMs).

    scale_by_TK (fp32 [T, K], optional) multiplies row (t, k)'s scales: y = w * x stays FP8 and
    exact up to the fp32 product of the scales (which are then no longer powers of two)."""
    if not isinstance(x8, Fp8Tensor) or x8.layout != "1x128" or x8.data.dim() != 2:
        raise ValueError("permute_fp8: expected an Fp8Tensor [T, H] with layout '1x128'")
    T, H = x8.data.shape
    if layout.row_TK.shape[0] != T:
        raise ValueError(f"permute_fp8: x8 has {T} tokens but the layout was built for {layout.row_TK.shape[0]}")
    if not use_triton(x8.data, impl):
        return permute_fp8_ref(x8, layout, scale_by_TK, colmajor_scale=colmajor_scale)
    G = H // TILE
    out = torch.empty(layout.M, H, dtype=FP8_DTYPE, device=x8.data.device)
    out_s = _scales(layout.M, G, x8.data.device, colmajor_scale)
    if layout.M:
        w = scale_by_TK.float().contiguous() if scale_by_TK is not None else out_s
        xs = x8.scale  # any strides
        _permute_kernel[(layout.M,)](x8.data, xs, w, layout.src_M, out, out_s, H, layout.row_TK.shape[1],
                                     x8.data.stride(0), xs.stride(0), xs.stride(1), out.stride(0), out_s.stride(0),
                                     out_s.stride(1), G, G_PAD=triton.next_power_of_2(G), HAS_S=True,
                                     HAS_W=scale_by_TK is not None, BLOCK_H=min(2048, triton.next_power_of_2(H)), num_warps=4)
    return Fp8Tensor(out, out_s, "1x128")


def permute_requant_colwise(x8: Fp8Tensor, layout: PermuteLayout, scale_fmt: str = "pow2",
                            impl: str | None = None, *, launch: dict | None = None) -> Fp8Tensor:
    """x8 "1x128" [T, H] -> "128x1" ([H, M] data) of its rows in the layout: `requant_colwise(
    permute_fp8(x8, layout))` in one pass, the permuted "1x128" copy never written (the fc1 wgrad
    reads only this one). The words kernel's conditions (pow2, M % 16 == 0, 16-byte rows) or else
    those two functions. launch: `LAUNCH["permute_requant_colwise"]`'s keys."""
    if not isinstance(x8, Fp8Tensor) or x8.layout != "1x128" or x8.data.dim() != 2:
        raise ValueError("permute_requant_colwise: expected an Fp8Tensor [T, H] with layout '1x128'")
    T, H = x8.data.shape
    if layout.row_TK.shape[0] != T:
        raise ValueError(f"permute_requant_colwise: x8 has {T} tokens but the layout was built for "
                         f"{layout.row_TK.shape[0]}")
    pow2 = check_scale_fmt(scale_fmt)
    if not use_triton(x8.data, impl):
        return permute_requant_colwise_ref(x8, layout, scale_fmt)
    data, M = x8.data, layout.M
    if not (pow2 and M % 16 == 0 and data.stride(1) == 1 and data.stride(0) % 16 == 0 and data.data_ptr() % 16 == 0):
        return requant_colwise(permute_fp8(x8, layout, impl=impl, colmajor_scale=True), scale_fmt, impl)
    out = torch.empty(H, M, dtype=FP8_DTYPE, device=data.device)
    out_s = _scales(H, triton.cdiv(M, TILE), data.device, True)
    if M:
        cfg = dict(launch or LAUNCH["permute_requant_colwise"])
        num_kb, num_mb = H // cfg["BLOCK_K"], triton.cdiv(M, TILE)
        grid = min(num_kb * num_mb, cfg.pop("PROGS_PER_SM") * num_sms(data.device))
        _permute_requant_colwise_kernel[(grid,)](
            data.view(torch.int32), x8.scale, layout.src_M, out.view(torch.int32), out_s, M // 16,
            layout.row_TK.shape[1], data.stride(0) // 16, x8.scale.stride(0), x8.scale.stride(1), M // 16,
            out_s.stride(0), out_s.stride(1), num_kb, num_mb, EVEN=M % TILE == 0, **cfg)
    return Fp8Tensor(out, out_s, "128x1")


def permute_rows(x_TH: Tensor, layout: PermuteLayout, impl: str | None = None) -> Tensor:
    """x [T, H] (any dtype, e.g. the BF16 recipe's rows) -> [M, H] in the layout, padding rows 0."""
    T, H = x_TH.shape
    if layout.row_TK.shape[0] != T:
        raise ValueError(f"permute_rows: x has {T} tokens but the layout was built for {layout.row_TK.shape[0]}")
    if not use_triton(x_TH, impl):
        return permute_rows_ref(x_TH, layout)
    out = torch.empty(layout.M, H, dtype=x_TH.dtype, device=x_TH.device)
    if layout.M:
        x = x_TH if x_TH.stride(-1) == 1 else x_TH.contiguous()
        _permute_kernel[(layout.M,)](x, x, x, layout.src_M, out, out, H, layout.row_TK.shape[1], x.stride(0), 0, 0,
                                     out.stride(0), 0, 0, 1, G_PAD=1, HAS_S=False, HAS_W=False,
                                     BLOCK_H=min(2048, triton.next_power_of_2(H)), num_warps=4)
    return out


def unpermute_combine(y_MH: Tensor, layout: PermuteLayout, w_TK: Tensor, impl: str | None = None,
                      out: Tensor | None = None, add_TH: Tensor | None = None) -> Tensor:
    """y [M, H] (bf16) -> out [T, H] bf16, out[t] = sum_k w[t, k] * y[row[t, k]] summed in fp32
    in slot order. Padding rows are never read. out: a bf16 [T, H] with unit column stride to write
    into (e.g. a transport's send slot), else a new tensor. add_TH: a bf16 [T, H] (unit column
    stride) added to the BF16 sum in the same pass: the bits of `unpermute_combine(...) + add_TH`
    (the shared experts' output at EP=1, one [T, H] pass fewer each way)."""
    T, K = layout.row_TK.shape
    H = y_MH.shape[1]
    if out is not None and (out.shape != (T, H) or out.dtype != torch.bfloat16 or (T and H and out.stride(1) != 1)):
        raise ValueError(f"unpermute_combine: out must be bf16 [{T}, {H}] with unit column stride, got {out.dtype} "
                         f"{tuple(out.shape)} strides {out.stride()}")
    if add_TH is not None and (add_TH.shape != (T, H) or add_TH.dtype != torch.bfloat16
                               or (T and H and add_TH.stride(1) != 1)):
        raise ValueError(f"unpermute_combine: add_TH must be bf16 [{T}, {H}] with unit column stride, got "
                         f"{add_TH.dtype} {tuple(add_TH.shape)} strides {add_TH.stride()}")
    if not use_triton(y_MH, impl):
        ref = unpermute_combine_ref(y_MH, layout, w_TK, add_TH)
        return ref if out is None else out.copy_(ref)
    if out is None:
        out = torch.empty(T, H, dtype=torch.bfloat16, device=y_MH.device)
    if T:
        BLOCK_H = min(1024, triton.next_power_of_2(H))
        add = add_TH if add_TH is not None else out  # (not read without ADD)
        _combine_kernel[(T, triton.cdiv(H, BLOCK_H))](y_MH, layout.row_TK, w_TK.float().contiguous(), out, add, H,
                                                    y_MH.stride(0), out.stride(0), add.stride(0), K=K,
                                                    ADD=add_TH is not None, BLOCK_H=BLOCK_H, num_warps=4,
                                                    enable_fp_fusion=False)
    return out


def combine_backward(dz_TH: Tensor, y_MH: Tensor | None, layout: PermuteLayout, w_TK: Tensor, want_dy: bool = True,
                     impl: str | None = None) -> tuple[Tensor | None, Tensor | None]:
    """Gradients of `unpermute_combine`: dw [T, K] fp32 (dw[t, k] = <dz[t], y[row]> in fp32, 0 for
    unrouted slots; None when y is None) and, if want_dy, dy [M, H] bf16 (w * dz at each routed
    row, 0 on padding). dz_TH: bf16 [T, H], or "1x128" FP8 (the gradient as the EP dispatch
    delivers it: rows may be views into its receive buffer), read as `dz_TH.dequantize(bf16)`
    without making that copy (at the 16B preset's EP4: four passes over [T_recv, H], ~30 ms a step)."""
    T, K = layout.row_TK.shape
    fp8 = isinstance(dz_TH, Fp8Tensor)
    if fp8 and dz_TH.layout != "1x128":
        raise ValueError(f"combine_backward: an FP8 dz must be '1x128' (row-wise tiles), got {dz_TH.layout!r}")
    H = dz_TH.data.shape[1] if fp8 else dz_TH.shape[1]
    if not use_triton(dz_TH.data if fp8 else dz_TH, impl):
        return combine_backward_ref(dz_TH, y_MH, layout, w_TK, want_dy)
    want_dw = y_MH is not None
    dev = w_TK.device
    dw = torch.empty(T, K, dtype=torch.float32, device=dev) if want_dw else None
    # dy's padding rows: zeros from the kernel's programs past T (no zeroing pass over all M rows)
    dy = (torch.empty if T else torch.zeros)(layout.M, H, dtype=torch.bfloat16, device=dev) if want_dy else None
    pad_rows = 32
    grid = 0 if not T else T + (triton.cdiv(layout.M, pad_rows) if want_dy else 0)
    if grid:
        if fp8:  # rows with any stride (the receive buffer's), elements contiguous
            dz = dz_TH.data if dz_TH.data.stride(1) == 1 else dz_TH.data.contiguous()
            s = dz_TH.scale
        else:
            dz = dz_TH.contiguous()
            s = dz
        y = y_MH if want_dw else dz
        _combine_bwd_kernel[(grid,)](dz, s, y, layout.row_TK, w_TK.float().contiguous(), dw if want_dw else dz,
                                     dy if want_dy else dz, layout.src_M, T, layout.M, H, dz.stride(0), s.stride(0),
                                     s.stride(1) if fp8 else 0, y.stride(0), dy.stride(0) if want_dy else 0, K=K,
                                     K_PAD=triton.next_power_of_2(K), WANT_DW=want_dw, WANT_DY=want_dy, DZ_FP8=fp8,
                                     BLOCK_H=min(512, triton.next_power_of_2(H)), PAD_ROWS=pad_rows, num_warps=4)
    return dy, dw


# ----------------------------------------------------------------------------------------------
# References


def build_layout_ref(topk_idx_TK: Tensor, num_experts: int, given: list[int] | None = None,
                     bound: bool = False, cap: int | None = None) -> PermuteLayout:
    """bincount, a stable sort, scatters: ~60 small ops and 3-4 host syncs on a GPU. given: the
    counts the caller expects (`build_layout`'s counts): a ValueError where the ids disagree.
    bound: `build_layout`'s (rows up to `rows_bound`, padding past offsets[E], no counts kept).
    cap: `build_layout`'s (M = cap rows; the pairs past them dropped, offsets clamped, `overflow`)."""
    _check_topk_idx(topk_idx_TK)
    dev = topk_idx_TK.device
    T, K = topk_idx_TK.shape
    flat = topk_idx_TK.reshape(-1).long()
    valid = flat >= 0
    counts_dev = torch.bincount(flat[valid], minlength=num_experts)
    counts = counts_dev.tolist()  # the host sync
    if len(counts) > num_experts:
        bad = int(flat.max())
        raise ValueError(f"build_layout: topk_idx holds expert {bad}, but there are only {num_experts} experts")
    if given is not None and [int(c) for c in given] != counts:
        raise ValueError(f"build_layout: the given counts {list(given)} are not the ids' {counts}")
    offsets_host = segment_offsets(counts)
    M = offsets_host[-1]
    offsets = torch.tensor(offsets_host, dtype=torch.int32, device=dev)
    n = sum(counts)
    key = torch.where(valid, flat, num_experts)  # unrouted slots sort last
    order = torch.sort(key, stable=True).indices[:n]  # pair ids, by expert then (token, slot)
    e_sorted = key[order]
    start = torch.cumsum(counts_dev, 0) - counts_dev  # unpadded segment starts
    dest = offsets.long()[e_sorted] + torch.arange(n, device=dev) - start[e_sorted]
    overflow = None
    if cap is not None:
        overflow = torch.tensor([int(M > cap)], dtype=torch.int32, device=dev)
        keep = dest < cap
        order, dest, M, counts = order[keep], dest[keep], cap, None
        offsets = offsets.clamp(max=cap)
    row_TK = torch.full((T * K,), -1, dtype=torch.int32, device=dev)
    row_TK[order] = dest.int()
    if bound:
        M, counts = rows_bound(T * K, num_experts), None
    src_M = torch.full((M,), -1, dtype=torch.int32, device=dev)
    src_M[dest] = order.int()
    return PermuteLayout(row_TK.view(T, K), src_M, offsets, counts, M, overflow)


def permute_fp8_ref(x8: Fp8Tensor, layout: PermuteLayout, scale_by_TK: Tensor | None = None, *,
                    colmajor_scale: bool = False) -> Fp8Tensor:
    T, H = x8.data.shape
    K = layout.row_TK.shape[1]
    src = layout.src_M.long()
    ok = src >= 0
    t = torch.where(ok, src // K, 0)
    data = torch.where(ok[:, None], x8.data.view(torch.uint8)[t], 0).view(FP8_DTYPE)
    s = x8.scale.float()[t]
    if scale_by_TK is not None:
        s = s * scale_by_TK.float().reshape(-1)[torch.where(ok, src, 0)][:, None]
    s = torch.where(ok[:, None], s, 1.0)
    return Fp8Tensor(data, col_major(s) if colmajor_scale else s, "1x128")


def permute_requant_colwise_ref(x8: Fp8Tensor, layout: PermuteLayout, scale_fmt: str = "pow2") -> Fp8Tensor:
    return requant_colwise_ref(permute_fp8_ref(x8, layout), scale_fmt)


def permute_rows_ref(x_TH: Tensor, layout: PermuteLayout) -> Tensor:
    src = layout.src_M.long()
    ok = src >= 0
    rows = x_TH[torch.where(ok, src // layout.row_TK.shape[1], 0)]
    return torch.where(ok[:, None], rows, torch.zeros((), dtype=x_TH.dtype, device=x_TH.device))


def unpermute_combine_ref(y_MH: Tensor, layout: PermuteLayout, w_TK: Tensor, add_TH: Tensor | None = None) -> Tensor:
    T, K = layout.row_TK.shape
    out = torch.zeros(T, y_MH.shape[1], dtype=torch.float32, device=y_MH.device)
    if y_MH.shape[0] != 0:  # (no row at all, every slot -1: nothing to gather)
        for k in range(K):  # slot order, as the kernel sums
            r = layout.row_TK[:, k].long()
            ok = r >= 0
            out += torch.where(ok[:, None], w_TK[:, k, None].float() * y_MH[r.clamp(min=0)].float(), 0.0)
    return out.bfloat16() if add_TH is None else out.bfloat16() + add_TH


def combine_backward_ref(dz_TH, y_MH: Tensor | None, layout: PermuteLayout, w_TK: Tensor,
                         want_dy: bool = True):
    if isinstance(dz_TH, Fp8Tensor):
        dz_TH = dz_TH.dequantize(torch.bfloat16)
    T, K = layout.row_TK.shape
    r = layout.row_TK.long()
    ok = r >= 0
    dw = dy = None
    if y_MH is not None and y_MH.shape[0] == 0:  # no row at all (every slot -1)
        dw = torch.zeros(T, K, dtype=torch.float32, device=dz_TH.device)
    elif y_MH is not None:
        yg = y_MH[r.clamp(min=0)].float()  # [T, K, H]
        dw = torch.where(ok, (yg * dz_TH.float()[:, None, :]).sum(-1), 0.0)
    if want_dy:
        dy = torch.zeros(layout.M, dz_TH.shape[1], dtype=torch.bfloat16, device=dz_TH.device)
        val = (w_TK.float()[:, :, None] * dz_TH.float()[:, None, :]).bfloat16()
        dy[r[ok]] = val[ok]
    return dy, dw
