"""FP8 quantization kernels (docs/design.md §1): Triton kernel -> public wrapper -> `_ref` twin.

Every public function takes ``impl=None|"triton"|"ref"``: by default CUDA tensors go to the
Triton kernel and CPU tensors to the pure-PyTorch reference (Triton also runs on CPU tensors
under ``TRITON_INTERPRET=1``, which the tests use). The reference follows the kernel's order of
operations in fp32, so on a GPU the two agree bit for bit (FP8 bytes and scales).

Layouts and the scale formats are described in `moefp8.fp8`. All kernels use 128-wide tiles
along the quantized dimension; the other dimension is masked, so M need not be a multiple
of 128 (the last "128x1" tile along M is partial).
"""

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from moefp8.fp8 import AMAX_MIN, FP8_DTYPE, FP8_MAX, TILE, Fp8Tensor, check_scale_fmt, col_major
from moefp8.kernels import num_sms, use_triton

_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Triton kernels read module globals only as constexprs.
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
_FP8_MAX = tl.constexpr(FP8_MAX)
_AMAX_MIN = tl.constexpr(AMAX_MIN)
LOG2E = float(torch.tensor(1.4426950408889634, dtype=torch.float32))  # log2(e) rounded to fp32
_LOG2E = tl.constexpr(LOG2E)


# ----------------------------------------------------------------------------------------------
# Shared Triton helpers


@triton.jit
def _scale_from_amax(amax, POW2: tl.constexpr):
    """amax fp32 (NaN-free) -> (scale, 1/scale); inverse only meaningful for POW2.

    pow2: s = 2**ceil(log2(amax/448)) computed exactly from amax's bits, no division or log:
    with amax = m * 2**ea (m in [1, 2)) and 448 = 1.75 * 2**8, ceil(log2(amax/448)) is
    ea - 8, plus one when m > 1.75 (mantissa bits > 0x600000).
    """
    amax = tl.maximum(amax, _AMAX_MIN)
    if POW2:
        bits = amax.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
        inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    else:
        scale = tl.math.div_rn(amax, tl.full(amax.shape, _FP8_MAX, tl.float32))
        inv = scale  # unused: fp32 scales divide (IEEE), like the reference
    is_inf = amax == float("inf")  # an Inf in the tile: scale Inf, the tile dequantizes to NaN
    scale = tl.where(is_inf, float("inf"), scale)
    inv = tl.where(is_inf, 0.0, inv)
    return scale, inv


@triton.jit
def _abs_nan0(x):
    """|x| with NaN read as 0 for the amax. On GPUs tl.max already skips NaN (max.f32), so only
    the interpreter, whose numpy max propagates NaN, needs the select."""
    if _INTERPRET:
        return tl.where(x == x, tl.abs(x), 0.0)
    return tl.abs(x)


@triton.jit
def _to_fp8(x, scale, inv, POW2: tl.constexpr):
    """x / scale rounded to E4M3 (RNE), saturated to +-448, NaN kept. On GPUs the cast is
    cvt.rn.satfinite, which saturates and keeps NaN; the interpreter's cast does neither."""
    if POW2:
        q = x * inv  # exact: inv is a power of two
    else:
        q = tl.math.div_rn(x, scale)
    if _INTERPRET:
        q = tl.clamp(q, -_FP8_MAX, _FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return q.to(tl.float8e4nv)


@triton.jit
def _quant_rows_store(x, offs_m, offs_k, m_left, q_ptr, s_ptr, stride_qm, stride_sm, POW2: tl.constexpr):
    """x [BLOCK_M, 128] fp32 tile (rows offs_m) -> FP8 rows + one scale per row. q_ptr and s_ptr
    point at the tile's origin; rows at or past m_left are masked. Returns the stored codes
    dequantized in fp32 (what requant_colwise would read back; masked rows of x must be 0 and come
    back as 0); callers that only store leave it unused, and the compiler drops it."""
    amax = tl.max(_abs_nan0(x), axis=1)
    scale, inv = _scale_from_amax(amax, POW2)
    q = _to_fp8(x, scale[:, None], inv[:, None], POW2)
    row_ok = offs_m < m_left
    tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_k[None, :], q, mask=row_ok[:, None])
    tl.store(s_ptr + offs_m * stride_sm, scale, mask=row_ok)
    return q.to(tl.float32) * scale[:, None]


@triton.jit
def _pack4(q0, q1, q2, q3):
    """Four FP8 tiles -> one uint32 tile, q0's byte lowest: four consecutive rows' codes in the
    order they sit in memory once stored transposed (little-endian)."""
    b0 = q0.to(tl.uint8, bitcast=True).to(tl.uint32)
    b1 = q1.to(tl.uint8, bitcast=True).to(tl.uint32)
    b2 = q2.to(tl.uint8, bitcast=True).to(tl.uint32)
    b3 = q3.to(tl.uint8, bitcast=True).to(tl.uint32)
    return b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)


@triton.jit
def _absmax4(a, b, c, d):
    """Elementwise max of |a|, |b|, |c|, |d|, NaN ignored (see _abs_nan0)."""
    return tl.maximum(tl.maximum(_abs_nan0(a), _abs_nan0(b)), tl.maximum(_abs_nan0(c), _abs_nan0(d)))


@triton.jit
def _unpack_e4m3x4(w, s):
    """int32 word = four e4m3 codes of one row (byte c: column 4w + c), s fp32 -> four fp32 tiles
    code_c * s. Inline PTX: two cvt.rn.f16x2.e4m3x2 convert the word in place (exact), where
    Triton would first extract each byte (shift / and / prmt). The interpreter runs plain Triton."""
    if _INTERPRET:
        u = w.to(tl.uint32, bitcast=True)
        x0 = (u & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * s
        x1 = ((u >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * s
        x2 = ((u >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * s
        x3 = (u >> 24).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * s
        return x0, x1, x2, x3
    return tl.inline_asm_elementwise(
        "{\n.reg .b16 lo, hi, e<4>;\n.reg .b32 p, q;\n"
        "mov.b32 {lo, hi}, $4;\n"
        "cvt.rn.f16x2.e4m3x2 p, lo;\n"
        "cvt.rn.f16x2.e4m3x2 q, hi;\n"
        "mov.b32 {e0, e1}, p;\nmov.b32 {e2, e3}, q;\n"
        "cvt.f32.f16 $0, e0;\ncvt.f32.f16 $1, e1;\ncvt.f32.f16 $2, e2;\ncvt.f32.f16 $3, e3;\n"
        "mul.rn.f32 $0, $0, $5;\nmul.rn.f32 $1, $1, $5;\nmul.rn.f32 $2, $2, $5;\nmul.rn.f32 $3, $3, $5;\n}",
        "=f,=f,=f,=f,r,f", [w, s], dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _pack_e4m3x4(y0, y1, y2, y3):
    """Four fp32 tiles (already scaled) -> int32 word of their e4m3 codes, y0's byte lowest (rows
    4i..4i+3 of one column in the transposed output's memory order). RNE, saturated to +-448, NaN
    kept: cvt.rn.satfinite.e4m3x2.f32 d, hi, lo, the instruction Triton's own fp32 -> e4m3 cast
    emits on sm_90, here writing two codes at once into place (no byte shifts / ors)."""
    if _INTERPRET:  # _to_fp8 with scale 1: the interpreter's clamp + cast
        b0 = _to_fp8(y0, 1.0, 1.0, True).to(tl.uint8, bitcast=True).to(tl.uint32)
        b1 = _to_fp8(y1, 1.0, 1.0, True).to(tl.uint8, bitcast=True).to(tl.uint32)
        b2 = _to_fp8(y2, 1.0, 1.0, True).to(tl.uint8, bitcast=True).to(tl.uint32)
        b3 = _to_fp8(y3, 1.0, 1.0, True).to(tl.uint8, bitcast=True).to(tl.uint32)
        return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.int32, bitcast=True)
    return tl.inline_asm_elementwise(
        "{\n.reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
        "mov.b32 $0, {lo, hi};\n}",
        "=r,f,f,f,f", [y0, y1, y2, y3], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _quant_cols4_store(x0, x1, x2, x3, offs_i, offs_k, m_left, k_left, q_ptr, s_ptr, stride_qk, stride_sk,
                       POW2: tl.constexpr, PACK: tl.constexpr):
    """One 128-row group as four [32, BLOCK_K] fp32 tiles, x_j holding rows 4i + j (masked rows
    must be 0) -> one scale per column, FP8 stored transposed (q[k, m]); q_ptr and s_ptr point at
    the tile's origin.

    PACK (needs M % 16 == 0): the four rows' codes go into one uint32, so the transposing
    layout conversion moves 32-bit words; Triton moves a transposed FP8 tile through shared
    memory one byte per instruction, which made the col-wise kernels instruction-bound
    (bench/notes/quant.md). Without PACK each x_j is stored transposed on its own, byte-wise."""
    amax = tl.max(_absmax4(x0, x1, x2, x3), axis=0)
    scale, inv = _scale_from_amax(amax, POW2)
    q0 = _to_fp8(x0, scale[None, :], inv[None, :], POW2)
    q1 = _to_fp8(x1, scale[None, :], inv[None, :], POW2)
    q2 = _to_fp8(x2, scale[None, :], inv[None, :], POW2)
    q3 = _to_fp8(x3, scale[None, :], inv[None, :], POW2)
    col_ok = offs_k < k_left
    if PACK:
        words = tl.trans(_pack4(q0, q1, q2, q3))  # [BLOCK_K, 32] uint32 = [BLOCK_K, 128] bytes
        q32 = q_ptr.to(tl.pointer_type(tl.uint32))
        mask = col_ok[:, None] & (offs_i < m_left // 4)[None, :]
        tl.store(q32 + offs_k[:, None] * (stride_qk // 4) + offs_i[None, :], words, mask=mask)
    else:
        rows = 4 * offs_i
        ptrs = q_ptr + offs_k[:, None] * stride_qk + rows[None, :]
        tl.store(ptrs, tl.trans(q0), mask=col_ok[:, None] & (rows < m_left)[None, :])
        tl.store(ptrs + 1, tl.trans(q1), mask=col_ok[:, None] & (rows + 1 < m_left)[None, :])
        tl.store(ptrs + 2, tl.trans(q2), mask=col_ok[:, None] & (rows + 2 < m_left)[None, :])
        tl.store(ptrs + 3, tl.trans(q3), mask=col_ok[:, None] & (rows + 3 < m_left)[None, :])
    tl.store(s_ptr + offs_k * stride_sk, scale, mask=col_ok)


@triton.jit
def _sigmoid_denom(g):
    """1 + exp(-g), the denominator of sigmoid and silu, as 1 + exp2(g * -log2 e): one MUFU.EX2
    where libdevice's expf takes ~9 instructions (dequant_swiglu_quant_colwise was issue-bound
    with it, bench/notes/quant.md). torch's CUDA exp2 is ex2.approx.f32, so `sigmoid_denom_ref` gives the
    same bits; the ftz form used here differs from it only where exp2 is subnormal, which the
    added 1 absorbs (that is why this helper returns 1 + exp(-g), not exp(-g))."""
    x = g * -_LOG2E
    if _INTERPRET:
        return 1.0 + tl.exp2(x)
    return 1.0 + tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                           is_pure=True, pack=1)


@triton.jit
def _swiglu(g, u):
    """silu(g) * u in fp32: g / (1 + exp(-g)) (IEEE division) * u, as `swiglu_ref`."""
    return tl.math.div_rn(g, _sigmoid_denom(g)) * u


# ----------------------------------------------------------------------------------------------
# Kernels. Each program handles one tile; 64-bit arithmetic only for the tile's base offsets.


@triton.jit
def _quant_rowwise_kernel(x_ptr, q_ptr, s_ptr, M, stride_xm, stride_qm, stride_sm, stride_sg,
                          POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_g = tl.program_id(0)  # 128-wide column group: fastest, neighbours read neighbouring bytes
    m0 = tl.program_id(1).to(tl.int64) * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, 128)
    m_left = M - m0
    x = tl.load(x_ptr + m0 * stride_xm + pid_g * 128 + offs_m[:, None] * stride_xm + offs_k[None, :],
                mask=(offs_m < m_left)[:, None], other=0.0)
    _quant_rows_store(x.to(tl.float32), offs_m, offs_k, m_left, q_ptr + m0 * stride_qm + pid_g * 128,
                      s_ptr + m0 * stride_sm + pid_g * stride_sg, stride_qm, stride_sm, POW2)


@triton.jit
def _load_rows(ptr, rows, offs_k, m_left, k_left, stride_m):
    """[len(rows), BLOCK_K] tile of a row-major input as fp32; rows at or past m_left read 0."""
    mask = (rows < m_left)[:, None] & (offs_k < k_left)[None, :]
    return tl.load(ptr + rows[:, None] * stride_m + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _dequant_rows(q_ptr, s_ptr, rows, offs_k, m_left, stride_qm, stride_sm):
    """[len(rows), BLOCK_K] tile of a "1x128" FP8 input (BLOCK_K <= 128, one scale per row),
    dequantized to fp32; rows at or past m_left read 0."""
    row_ok = rows < m_left
    q = tl.load(q_ptr + rows[:, None] * stride_qm + offs_k[None, :], mask=row_ok[:, None], other=0.0)
    return q.to(tl.float32) * tl.load(s_ptr + rows * stride_sm, mask=row_ok, other=0.0)[:, None]


@triton.jit
def _quant_colwise_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qk, stride_sk, stride_sg,
                          POW2: tl.constexpr, PACK: tl.constexpr, BLOCK_K: tl.constexpr):
    k0 = tl.program_id(0) * BLOCK_K
    pid_m = tl.program_id(1)
    m0 = pid_m.to(tl.int64) * 128
    r = 4 * tl.arange(0, 32)  # the tile's rows as four interleaved quarters, rows r + j
    offs_k = tl.arange(0, BLOCK_K)
    m_left, k_left = M - m0, K - k0
    x = x_ptr + m0 * stride_xm + k0
    _quant_cols4_store(_load_rows(x, r, offs_k, m_left, k_left, stride_xm),
                       _load_rows(x, r + 1, offs_k, m_left, k_left, stride_xm),
                       _load_rows(x, r + 2, offs_k, m_left, k_left, stride_xm),
                       _load_rows(x, r + 3, offs_k, m_left, k_left, stride_xm),
                       tl.arange(0, 32), offs_k, m_left, k_left, q_ptr + k0.to(tl.int64) * stride_qk + m0,
                       s_ptr + k0 * stride_sk + pid_m * stride_sg, stride_qk, stride_sk, POW2, PACK)


@triton.jit
def _quant_weight_kernel(w_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, N, K, stride_we, stride_wn, stride_se, stride_sn,
                         POW2: tl.constexpr, TRANS: tl.constexpr):
    """One 128x128 block of W [E, N, K] -> its codes and scale; TRANS (N % 128 == 0): also the block
    transposed into Wᵀ [E, K, N] and its scale into the transposed grid [E, K/128, N/128] (dgrad's copy,
    `grouped_gemm.transpose_weight`, without a second pass over the codes)."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_e = tl.program_id(2).to(tl.int64)
    offs_n = tl.arange(0, 128)
    offs_k = tl.arange(0, 128)
    base = pid_e * stride_we + pid_n.to(tl.int64) * 128 * stride_wn + pid_k * 128
    offs = offs_n[:, None] * stride_wn + offs_k[None, :]
    mask = (offs_n < N - pid_n * 128)[:, None]
    w = tl.load(w_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(_abs_nan0(w), axis=1), axis=0)
    scale, inv = _scale_from_amax(amax, POW2)
    q = _to_fp8(w, scale, inv, POW2)
    tl.store(q_ptr + base + offs, q, mask=mask)
    tl.store(s_ptr + pid_e * stride_se + pid_n * stride_sn + pid_k, scale)
    if TRANS:  # Wᵀ[e, k, n] = W[e, n, k]; contiguous [E, K, N], grid [E, K/128, N/128]
        base_t = pid_e * N * K + pid_k.to(tl.int64) * 128 * N + pid_n * 128
        # the block read again as [k, n] (from L2) and cast with the same scale: the same codes. Not
        # tl.trans: with pow2 scales, tl.trans of the block (e4m3 codes, uint8 bits or the fp32 values)
        # wrote ~37% wrong bytes on an H200 (Triton 3.6, 4 and 8 warps; the interpreter was right)
        wt = tl.load(w_ptr + base + offs_k[:, None] + offs_n[None, :] * stride_wn).to(tl.float32)
        tl.store(qt_ptr + base_t + offs_k[:, None] * N + offs_n[None, :], _to_fp8(wt, scale, inv, POW2))
        tl.store(st_ptr + pid_e * (K // 128) * (N // 128) + pid_k * (N // 128) + pid_n, scale)


@triton.jit
def _colwise_program(pid, num_kb, num_mb, GROUP_K: tl.constexpr):
    """Program pid of a col-wise words or strips kernel -> (its BLOCK_K column block, its 128-row group).
    Row groups run fastest within bands of GROUP_K column blocks, so that the programs resident
    together read GROUP_K x BLOCK_K-byte runs of each input row and write runs of many 128-row
    groups into each output row (K-fastest order writes 128 bytes per output row: 2-5% slower,
    bench/notes/quant.md, session 13)."""
    per_band = GROUP_K * num_mb
    first_k = (pid // per_band) * GROUP_K
    band = tl.minimum(num_kb - first_k, GROUP_K)
    return first_k + (pid % per_band) % band, (pid % per_band) // band


@triton.jit
def _words_tile(tile, num_kb, num_mb, q_ptr, s_ptr, o_ptr, os_ptr, M16, stride_qw, stride_sm, stride_sg, stride_ow,
                stride_osk, stride_osm, rows, offs_w, BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr):
    """Tile `tile` of a col-wise words kernel -> (its input word pointers [32, BLOCK_K/4] for rows
    4i, its row-scale pointers [32], its output word and column-scale origins, the rows left in its
    128-row group and the output words per column left: m_left / 4, kept visibly a multiple of 4)."""
    pid_k, pid_m = _colwise_program(tile, num_kb, num_mb, GROUP_K)
    k0 = pid_k * BLOCK_K
    m0 = pid_m.to(tl.int64) * 128
    p = q_ptr + m0 * stride_qw + k0 // 4 + rows[:, None] * stride_qw + offs_w[None, :]
    ps = s_ptr + m0 * stride_sm + (k0 // 128) * stride_sg + rows * stride_sm
    po = o_ptr + k0.to(tl.int64) * stride_ow + m0 // 4
    pso = os_ptr + k0 * stride_osk + pid_m * stride_osm
    return p, ps, po, pso, M16 * 16 - pid_m * 128, M16 * 4 - pid_m * 32


@triton.jit
def _load_words4(p, ps, stride_w, stride_sm, rows, m_left, EVEN: tl.constexpr):
    """The four interleaved word tiles (rows 4i + j) of a 128-row group and their row-wise scales;
    rows past m_left read code 0 and scale 0: value 0, which leaves every amax alone."""
    if EVEN:
        w0, w1, w2, w3 = tl.load(p), tl.load(p + stride_w), tl.load(p + 2 * stride_w), tl.load(p + 3 * stride_w)
        s0, s1, s2, s3 = tl.load(ps), tl.load(ps + stride_sm), tl.load(ps + 2 * stride_sm), tl.load(ps + 3 * stride_sm)
    else:
        w0 = tl.load(p, mask=(rows < m_left)[:, None], other=0)
        w1 = tl.load(p + stride_w, mask=(rows + 1 < m_left)[:, None], other=0)
        w2 = tl.load(p + 2 * stride_w, mask=(rows + 2 < m_left)[:, None], other=0)
        w3 = tl.load(p + 3 * stride_w, mask=(rows + 3 < m_left)[:, None], other=0)
        s0 = tl.load(ps, mask=rows < m_left, other=0.0)
        s1 = tl.load(ps + stride_sm, mask=rows + 1 < m_left, other=0.0)
        s2 = tl.load(ps + 2 * stride_sm, mask=rows + 2 < m_left, other=0.0)
        s3 = tl.load(ps + 3 * stride_sm, mask=rows + 3 < m_left, other=0.0)
    return w0, w1, w2, w3, s0, s1, s2, s3


@triton.jit
def _quant_words4_store(x00, x01, x02, x03, x10, x11, x12, x13, x20, x21, x22, x23, x30, x31, x32, x33,
                        offs_i, offs_w, n_left, po, pso, stride_ow, stride_osk, EVEN: tl.constexpr):
    """x_jc [32, BLOCK_K/4] fp32: row 4i + j, column 4w + c of a 128-row group -> one pow2 scale
    per column and the output words (column 4w + c, rows 4i..4i+3) at po + (4w + c) * stride_ow
    + i; scales at pso + (4w + c) * stride_osk. n_left: the group's output words per column."""
    sc0, i0 = _scale_from_amax(tl.max(_absmax4(x00, x10, x20, x30), axis=0), True)
    sc1, i1 = _scale_from_amax(tl.max(_absmax4(x01, x11, x21, x31), axis=0), True)
    sc2, i2 = _scale_from_amax(tl.max(_absmax4(x02, x12, x22, x32), axis=0), True)
    sc3, i3 = _scale_from_amax(tl.max(_absmax4(x03, x13, x23, x33), axis=0), True)
    i0, i1, i2, i3 = i0[None, :], i1[None, :], i2[None, :], i3[None, :]
    po = po + (4 * offs_w)[None, :] * stride_ow + offs_i[:, None]
    words = (_pack_e4m3x4(x00 * i0, x10 * i0, x20 * i0, x30 * i0), _pack_e4m3x4(x01 * i1, x11 * i1, x21 * i1, x31 * i1),
             _pack_e4m3x4(x02 * i2, x12 * i2, x22 * i2, x32 * i2), _pack_e4m3x4(x03 * i3, x13 * i3, x23 * i3, x33 * i3))
    for c in tl.static_range(4):
        if EVEN:
            tl.store(po + c * stride_ow, words[c])
        else:
            tl.store(po + c * stride_ow, words[c], mask=(offs_i < n_left)[:, None])
    pso = pso + 4 * offs_w * stride_osk
    scales = (sc0, sc1, sc2, sc3)
    for c in tl.static_range(4):
        tl.store(pso + c * stride_osk, scales[c])


@triton.jit(do_not_specialize=["M16", "q_row16", "o_row16"])
def _requant_colwise_words_kernel(q_ptr, s_ptr, o_ptr, os_ptr, M16, q_row16, stride_sm, stride_sg, o_row16,
                                  stride_osk, stride_osm, num_kb, num_mb, BLOCK_K: tl.constexpr,
                                  GROUP_K: tl.constexpr, STAGES: tl.constexpr, EVEN: tl.constexpr):
    """pow2 scales, M % 16 == 0. q_ptr: the "1x128" data as int32 words [M, K/4]; o_ptr: the
    output as int32 words [K, M/4]. Persistent: each program requantizes tiles (one 128-row group
    of BLOCK_K columns each) in `_colwise_program` order, with the loads of the next STAGES - 1
    tiles in flight (Triton pipelines the loop's loads through shared memory): the one-tile-per-
    program kernel idled on its loads (without its stores it still took 1.1x a full copy's time).

    A tile is read as four interleaved word tiles [32, BLOCK_K/4] (rows 4i + j), so a thread
    holds word w of rows 4i..4i+3: a 4x4 byte block. Unpacking the four rows and packing each
    column's four values back (_unpack_e4m3x4 / _pack_e4m3x4) transposes that block in
    registers: the output word of column 4w + c holds rows 4i..4i+3. Only int32 words then move
    through shared memory (Triton's store layout), none of the byte-wise traffic of the generic
    kernel. M and the row strides come in 16-byte units (M16 = M/16, q_row16 = K/16, o_row16 =
    M/16): the compiler knows 16-byte accesses stay aligned (vector loads / stores, masked ones
    too) without specialising on the shape. EVEN: M % 128 == 0, no masks."""
    stride_qw = q_row16 * 4
    stride_ow = o_row16 * 4
    offs_i = tl.arange(0, 32)
    offs_w = tl.arange(0, BLOCK_K // 4)
    rows = 4 * offs_i
    for tile in tl.range(tl.program_id(0), num_kb * num_mb, tl.num_programs(0), num_stages=STAGES):
        p, ps, po, pso, m_left, n_left = _words_tile(tile, num_kb, num_mb, q_ptr, s_ptr, o_ptr, os_ptr, M16, stride_qw,
                                                     stride_sm, stride_sg, stride_ow, stride_osk, stride_osm, rows,
                                                     offs_w, BLOCK_K, GROUP_K)
        w0, w1, w2, w3, s0, s1, s2, s3 = _load_words4(p, ps, stride_qw, stride_sm, rows, m_left, EVEN)
        # x_jc [32, BLOCK_K/4]: row 4i + j, column 4w + c, dequantized
        x00, x01, x02, x03 = _unpack_e4m3x4(w0, s0[:, None])
        x10, x11, x12, x13 = _unpack_e4m3x4(w1, s1[:, None])
        x20, x21, x22, x23 = _unpack_e4m3x4(w2, s2[:, None])
        x30, x31, x32, x33 = _unpack_e4m3x4(w3, s3[:, None])
        _quant_words4_store(x00, x01, x02, x03, x10, x11, x12, x13, x20, x21, x22, x23, x30, x31, x32, x33,
                            offs_i, offs_w, n_left, po, pso, stride_ow, stride_osk, EVEN)


@triton.jit
def _requant_colwise_kernel(q_ptr, s_ptr, o_ptr, os_ptr, M, K, stride_qm, stride_sm, stride_sg, stride_ok,
                            stride_osk, stride_osm, POW2: tl.constexpr, PACK: tl.constexpr, BLOCK_K: tl.constexpr):
    """Generic requant (fp32 scales, or M % 16 != 0); pow2 with M % 16 == 0 takes the words kernel."""
    k0 = tl.program_id(0) * BLOCK_K  # BLOCK_K <= 128 columns: one row-wise scale per row
    pid_m = tl.program_id(1)
    m0 = pid_m.to(tl.int64) * 128
    r = 4 * tl.arange(0, 32)
    offs_k = tl.arange(0, BLOCK_K)
    m_left = M - m0
    q = q_ptr + m0 * stride_qm + k0
    s = s_ptr + m0 * stride_sm + (k0 // 128) * stride_sg
    _quant_cols4_store(_dequant_rows(q, s, r, offs_k, m_left, stride_qm, stride_sm),
                       _dequant_rows(q, s, r + 1, offs_k, m_left, stride_qm, stride_sm),
                       _dequant_rows(q, s, r + 2, offs_k, m_left, stride_qm, stride_sm),
                       _dequant_rows(q, s, r + 3, offs_k, m_left, stride_qm, stride_sm),
                       tl.arange(0, 32), offs_k, m_left, K - k0, o_ptr + k0.to(tl.int64) * stride_ok + m0,
                       os_ptr + k0 * stride_osk + pid_m * stride_osm, stride_ok, stride_osk, POW2, PACK)


@triton.jit
def _swiglu_quant_kernel(h_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, M, I, stride_hm, stride_qm, stride_sm, stride_sg,
                         stride_hqm, stride_hsm, stride_hsg, POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                         STORE_H: tl.constexpr):
    """a = silu(gate) * up quantized "1x128"; STORE_H: h itself too ("1x128": quant_rowwise(h)
    from the same loads)."""
    pid_g = tl.program_id(0)
    m0 = tl.program_id(1).to(tl.int64) * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, 128)
    m_left = M - m0
    ptrs = h_ptr + m0 * stride_hm + pid_g * 128 + offs_m[:, None] * stride_hm + offs_k[None, :]
    mask = (offs_m < m_left)[:, None]
    g = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(ptrs + I, mask=mask, other=0.0).to(tl.float32)
    if STORE_H:
        hq = hq_ptr + m0 * stride_hqm + pid_g * 128
        hs = hs_ptr + m0 * stride_hsm + pid_g * stride_hsg
        _quant_rows_store(g, offs_m, offs_k, m_left, hq, hs, stride_hqm, stride_hsm, POW2)
        _quant_rows_store(u, offs_m, offs_k, m_left, hq + I, hs + (I // 128) * stride_hsg, stride_hqm, stride_hsm,
                          POW2)
    _quant_rows_store(_swiglu(g, u), offs_m, offs_k, m_left, q_ptr + m0 * stride_qm + pid_g * 128,
                      s_ptr + m0 * stride_sm + pid_g * stride_sg, stride_qm, stride_sm, POW2)


@triton.jit
def _dequant_swiglu_rows(h_ptr, hs_ptr, rows, offs_k, m_left, I, stride_hm, stride_hsm, stride_hsg):
    """silu(gate) * up for rows of a "1x128" FP8 h [M, 2I] (BLOCK_K <= 128 columns of a; h_ptr
    and hs_ptr at the tile's gate columns). Masked rows load as 0 and give silu(0) * 0 = 0: they
    leave the amax alone."""
    g = _dequant_rows(h_ptr, hs_ptr, rows, offs_k, m_left, stride_hm, stride_hsm)
    u = _dequant_rows(h_ptr + I, hs_ptr + (I // 128) * stride_hsg, rows, offs_k, m_left, stride_hm, stride_hsm)
    return _swiglu(g, u)


@triton.jit
def _dequant_swiglu_quant_colwise_kernel(h_ptr, hs_ptr, q_ptr, s_ptr, M, I, stride_hm, stride_hsm, stride_hsg,
                                         stride_qk, stride_sk, stride_sg, POW2: tl.constexpr, PACK: tl.constexpr,
                                         BLOCK_K: tl.constexpr):
    k0 = tl.program_id(0) * BLOCK_K  # BLOCK_K <= 128 columns of a: one row-wise scale per row for gate and up
    pid_m = tl.program_id(1)
    m0 = pid_m.to(tl.int64) * 128
    r = 4 * tl.arange(0, 32)
    offs_k = tl.arange(0, BLOCK_K)
    m_left = M - m0
    h = h_ptr + m0 * stride_hm + k0
    hs = hs_ptr + m0 * stride_hsm + (k0 // 128) * stride_hsg
    _quant_cols4_store(_dequant_swiglu_rows(h, hs, r, offs_k, m_left, I, stride_hm, stride_hsm, stride_hsg),
                       _dequant_swiglu_rows(h, hs, r + 1, offs_k, m_left, I, stride_hm, stride_hsm, stride_hsg),
                       _dequant_swiglu_rows(h, hs, r + 2, offs_k, m_left, I, stride_hm, stride_hsm, stride_hsg),
                       _dequant_swiglu_rows(h, hs, r + 3, offs_k, m_left, I, stride_hm, stride_hsm, stride_hsg),
                       tl.arange(0, 32), offs_k, m_left, I - k0, q_ptr + k0.to(tl.int64) * stride_qk + m0,
                       s_ptr + k0 * stride_sk + pid_m * stride_sg, stride_qk, stride_sk, POW2, PACK)


@triton.jit
def _strip_groups(T: tl.constexpr):
    """Row i of a [32, W] word tile of `_dequant_swiglu_quant_colwise_strips_kernel` -> its 4-row group
    g in the 128-row tile: with T threads along the rows, thread t holds rows i = k T + t (k < R =
    32 / T), which become the consecutive groups g = t R + k."""
    i = tl.arange(0, 32)
    return (i % T) * (32 // T) + i // T


@triton.jit(do_not_specialize=["M16", "h_row16", "I16", "o_row16"], do_not_specialize_on_alignment=["h_ptr"])
def _dequant_swiglu_quant_colwise_strips_kernel(h_ptr, hs_ptr, o_ptr, os_ptr, M16, h_row16, I16, stride_sm, stride_sg,
                                                o_row16, stride_osk, stride_osm, num_kb, num_mb,
                                                BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr, NW: tl.constexpr,
                                                EVEN: tl.constexpr):
    """dequant_swiglu_quant_colwise for pow2 scales and M % 16 == 0, each thread owning strips of
    consecutive rows. h_ptr: "1x128" h as int32 words [M, 2I/4] (gate columns, then up); o_ptr: a
    as int32 words [I, M/4]. One program per (BLOCK_K columns, 128-row group), in
    `_colwise_program` order; NW = num_warps; I16 = I/16.

    The tile is read as four word tiles [32, W] per operand (W = BLOCK_K / 4 words; tile j, row i
    holds memory row 4 g(i) + j). Triton's default layout gives such a tile one word per thread
    (h_ptr is not specialized on its 16-byte alignment, so the loads are not widened to vectors), the W words
    of a row on consecutive lanes, the rows on the other lanes and the warps (T threads along the
    rows), repeated in registers: thread t holds rows i = k T + t, which `_strip_groups` maps to
    consecutive groups. So a thread holds 4R consecutive rows (R = 32 / T) of 4 columns: it reduces
    most of each column's amax itself, packs each column's output words in registers and writes its
    R consecutive words with one vector store, with no layout conversion (the words kernel before
    it moved 4x4 byte blocks through a transposing store; ~20% more instructions per element,
    bench/notes/quant.md, session 30)."""
    W: tl.constexpr = BLOCK_K // 4
    T: tl.constexpr = (32 // W) * NW
    R: tl.constexpr = 32 // T
    tl.static_assert(W <= 32 and T <= 32, "strips kernel: needs BLOCK_K <= 128 and (128 / BLOCK_K) * num_warps <= 32")
    stride_hw = h_row16 * 4
    stride_ow = o_row16 * 4
    rows = 4 * _strip_groups(T)
    p, ps, po, pso, m_left, n_left = _words_tile(tl.program_id(0), num_kb, num_mb, h_ptr, hs_ptr, o_ptr, os_ptr, M16,
                                                 stride_hw, stride_sm, stride_sg, stride_ow, stride_osk, stride_osm,
                                                 rows, tl.arange(0, W), BLOCK_K, GROUP_K)
    pu, psu = p + I16 * 4, ps + (I16 // 8) * stride_sg  # up: I/4 words and I/128 scale groups on
    # every load first (the math after them would delay the later ones)
    gate = _load_words4(p, ps, stride_hw, stride_sm, rows, m_left, EVEN)  # 4 word tiles, then their 4 scales
    up = _load_words4(pu, psu, stride_hw, stride_sm, rows, m_left, EVEN)
    a = ()  # a[4 j + c] [32, W]: rows 4 g + j, columns 4 w + c
    for j in tl.static_range(4):
        g0, g1, g2, g3 = _unpack_e4m3x4(gate[j], gate[4 + j][:, None])
        u0, u1, u2, u3 = _unpack_e4m3x4(up[j], up[4 + j][:, None])
        a = a + (_swiglu(g0, u0), _swiglu(g1, u1), _swiglu(g2, u2), _swiglu(g3, u3))
    col = 4 * tl.arange(0, W)
    word = (tl.arange(0, T) * R)[None, :, None] + tl.arange(0, R)[None, None, :]  # [1, T, R]: word g of the group
    for c in tl.static_range(4):
        scale, inv = _scale_from_amax(tl.max(_absmax4(a[c], a[4 + c], a[8 + c], a[12 + c]), axis=0), True)
        inv = inv[None, :]
        words = _pack_e4m3x4(a[c] * inv, a[4 + c] * inv, a[8 + c] * inv, a[12 + c] * inv)  # [32, W]
        words = tl.permute(tl.reshape(words, (R, T, W)), (2, 1, 0))  # [W, T, R]: each thread's R words last
        ptrs = po + ((col + c) * stride_ow)[:, None, None] + word
        if EVEN:
            tl.store(ptrs, words)
        else:
            tl.store(ptrs, words, mask=word < n_left)
        tl.store(pso + (col + c) * stride_osk, scale)


# ----------------------------------------------------------------------------------------------
# Public wrappers: validate, allocate, launch. Kernels assume valid input.

# Launch configurations, as data: read, never written. A wrapper's `launch=` replaces its kernel's
# entry for that call (`tools/bench_quant.py --sweep` times alternatives on the GPU so).
# BLOCK_M: rows per program (row-wise kernels); BLOCK_K: columns per program (col-wise).
LAUNCH = {  # fastest of tools/bench_quant.py --sweep on an H200 (runs and tables: bench/notes/quant.md)
    "rowwise": dict(BLOCK_M=32, num_warps=8),
    "colwise": dict(BLOCK_K=64, num_warps=4),
    "weight": dict(num_warps=8),
    # col-wise words kernels: GROUP_K column blocks per band of the program order (_colwise_program)
    # requant (persistent): PROGS_PER_SM programs per SM, STAGES tiles' loads in flight; 168 registers
    # let two 4-warp programs share an SM (bench/notes/quant.md, session 13)
    "requant_colwise": dict(BLOCK_K=128, num_warps=4, GROUP_K=8, STAGES=4, PROGS_PER_SM=2, maxnreg=168),
    # kernels/permute.py's requant with its rows gathered (the fc1 wgrad's x): three programs an SM, three
    # tiles in flight (tools/bench_quant.py --sweep --only permute_requant_colwise, H200, 131072x2048: 0.209 ms
    # against 0.261 with requant_colwise's config; bench/notes/scale.md, session 56)
    "permute_requant_colwise": dict(BLOCK_K=128, num_warps=4, GROUP_K=8, STAGES=3, PROGS_PER_SM=3, maxnreg=168),
    "requant_colwise_generic": dict(BLOCK_K=64, num_warps=2),  # fp32 scales or M % 16 != 0; BLOCK_K <= 128
    "swiglu_backward_quant": dict(BLOCK_M=16, num_warps=4),  # its row kernel (kernels/swiglu.py); the col-wise
                                                             # copy takes "requant_colwise"
    "swiglu_quant": dict(BLOCK_M=8, num_warps=2),
    # strips kernel: (32 / (BLOCK_K / 4)) * num_warps <= 32 threads along the rows, BLOCK_K <= 128;
    # 32 / 4 the fastest of seven configs on an H100 (bench/notes/quant.md, session 30)
    "dequant_swiglu_quant_colwise": dict(BLOCK_K=32, num_warps=4, GROUP_K=8),
    "dequant_swiglu_quant_colwise_generic": dict(BLOCK_K=32, num_warps=4),  # fp32 scales or M % 16 != 0
}



def _scales(rows: int, groups: int, device, colmajor: bool) -> Tensor:
    """An fp32 scale grid [rows, groups], stored column-major (memory [groups, rows]) if asked."""
    if colmajor:
        return torch.empty(groups, rows, dtype=torch.float32, device=device).t()
    return torch.empty(rows, groups, dtype=torch.float32, device=device)


def _packs(M: int) -> bool:
    """Col-wise kernels store 4 tokens' codes per 32-bit word when rows of the [K, M] output
    stay 16-byte aligned; other M take the byte-wise store (same result, slower)."""
    return M % 16 == 0


def _words_ok(data: Tensor, pow2: bool) -> bool:
    """Whether the col-wise words and strips kernels take this "1x128" input: they multiply by inverse scales
    (pow2 only) and read it as int32 words with 16-byte aligned rows (M % 16 == 0 keeps the
    transposed output's rows aligned too)."""
    return (pow2 and data.shape[0] % 16 == 0 and data.stride(1) == 1 and data.stride(0) % 16 == 0
            and data.data_ptr() % 16 == 0)


def _check_input(name: str, x: Tensor, k_multiple_of_128: bool = True) -> None:
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"{name}: dtype {x.dtype} not supported, expected one of {_IN_DTYPES}")
    if x.dim() < 1:
        raise ValueError(f"{name}: expected at least 1 dimension, got a scalar")
    if k_multiple_of_128 and x.shape[-1] % TILE:
        raise ValueError(
            f"{name}: last dimension {x.shape[-1]} is not divisible by {TILE} "
            f"(the FP8 recipe quantizes in 1x{TILE} tiles along it)")


def _check_fp8(name: str, q: Fp8Tensor, layout: str) -> None:
    if not isinstance(q, Fp8Tensor) or q.layout != layout:
        got = q.layout if isinstance(q, Fp8Tensor) else type(q).__name__
        raise ValueError(f"{name}: expected an Fp8Tensor with layout {layout!r}, got {got!r}")
    if q.data.dim() != 2 or q.data.shape[-1] % TILE:
        raise ValueError(f"{name}: expected data [M, K] with K % {TILE} == 0, got {tuple(q.data.shape)}")


def quant_rowwise(x: Tensor, scale_fmt: str = "pow2", impl: str | None = None, *,
                  colmajor_scale: bool = False, launch: dict | None = None) -> Fp8Tensor:
    """x [..., K] bf16|fp16|fp32, K % 128 == 0 -> "1x128": q [..., K] e4m3, s [..., K/128] fp32
    (stored column-major with colmajor_scale: what the GEMMs read, no transposing copy)."""
    _check_input("quant_rowwise", x)
    pow2 = check_scale_fmt(scale_fmt)
    if not use_triton(x, impl):
        return quant_rowwise_ref(x, scale_fmt, colmajor_scale=colmajor_scale)
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    q = torch.empty(M, K, dtype=FP8_DTYPE, device=x.device)
    s = _scales(M, K // TILE, x.device, colmajor_scale)
    if M:
        cfg = launch or LAUNCH["rowwise"]
        grid = (K // TILE, triton.cdiv(M, cfg["BLOCK_M"]))
        _quant_rowwise_kernel[grid](x2, q, s, M, x2.stride(0), q.stride(0), s.stride(0), s.stride(1), POW2=pow2,
                                    **cfg)
    return Fp8Tensor(q.view(x.shape), s.view(*x.shape[:-1], K // TILE), "1x128")


def quant_colwise(x: Tensor, scale_fmt: str = "pow2", impl: str | None = None, *,
                  launch: dict | None = None) -> Fp8Tensor:
    """x [M, K] -> "128x1" (128 tokens per tile along M): q = [K, M] e4m3 (transposed, M
    contiguous, the K-major operand of the wgrad GEMM), s [K, ceil(M/128)] fp32 (column-major,
    as every "128x1" scale grid). Any M."""
    _check_input("quant_colwise", x, k_multiple_of_128=False)  # tiles run along M; K is free
    if x.dim() != 2:
        raise ValueError(f"quant_colwise: expected x [M, K], got shape {tuple(x.shape)}")
    pow2 = check_scale_fmt(scale_fmt)
    # One token (M == 1): the reference; Triton 3.6's ptxas crashed (error -11) compiling the
    # kernel specialised for M = stride = 1 with pow2 scales (H200, test_triton_gpu_bit_exact).
    if not use_triton(x, impl) or x.shape[0] == 1:
        return quant_colwise_ref(x, scale_fmt)
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    q = torch.empty(K, M, dtype=FP8_DTYPE, device=x.device)
    s = _scales(K, triton.cdiv(M, TILE), x.device, True)
    if M:
        cfg = launch or LAUNCH["colwise"]
        grid = (triton.cdiv(K, cfg["BLOCK_K"]), triton.cdiv(M, TILE))
        _quant_colwise_kernel[grid](x, q, s, M, K, x.stride(0), q.stride(0), s.stride(0), s.stride(1), POW2=pow2,
                                    PACK=_packs(M), **cfg)
    return Fp8Tensor(q, s, "128x1")


def quant_weight(w: Tensor, scale_fmt: str = "pow2", impl: str | None = None, *, transposed: bool = False,
                 launch: dict | None = None):
    """w [N, K] or a stack [E, N, K], K % 128 == 0 -> "128x128": q like w (e4m3),
    s [(E,) ceil(N/128), K/128] fp32. The same blocks serve fprop and dgrad.
    transposed (N % 128 == 0): -> (that, its transpose `grouped_gemm.transpose_weight` would make:
    Wᵀ [(E,) K, N] with the scale grid transposed), both from one pass over w."""
    _check_input("quant_weight", w)
    if w.dim() not in (2, 3):
        raise ValueError(f"quant_weight: expected w [N, K] or [E, N, K], got shape {tuple(w.shape)}")
    if transposed and w.shape[-2] % TILE:
        raise ValueError(f"quant_weight: transposed needs N % {TILE} == 0, got N={w.shape[-2]}")
    pow2 = check_scale_fmt(scale_fmt)
    if not use_triton(w, impl):
        q8 = quant_weight_ref(w, scale_fmt)
        return (q8, transpose_weight_ref(q8)) if transposed else q8
    w3 = w.unsqueeze(0) if w.dim() == 2 else w
    if w3.stride(-1) != 1 or w3.stride(0) != w3.shape[1] * w3.stride(1):
        w3 = w3.contiguous()
    E, N, K = w3.shape
    q = torch.empty(E, N, K, dtype=FP8_DTYPE, device=w.device)
    s = torch.empty(E, triton.cdiv(N, TILE), K // TILE, dtype=torch.float32, device=w.device)
    qt = torch.empty(E, K, N, dtype=FP8_DTYPE, device=w.device) if transposed else q
    st = torch.empty(E, K // TILE, N // TILE, dtype=torch.float32, device=w.device) if transposed else s
    if E and N:
        grid = (K // TILE, triton.cdiv(N, TILE), E)
        _quant_weight_kernel[grid](w3, q, s, qt, st, N, K, w3.stride(0), w3.stride(1), s.stride(0), s.stride(1),
                                   POW2=pow2, TRANS=transposed, **(launch or LAUNCH["weight"]))
    if w.dim() == 2:
        q, s, qt, st = q[0], s[0], qt[0], st[0]
    q8 = Fp8Tensor(q, s, "128x128")
    return (q8, Fp8Tensor(qt, st, "128x128")) if transposed else q8


def requant_colwise(q: Fp8Tensor, scale_fmt: str = "pow2", impl: str | None = None, *,
                    launch: dict | None = None) -> Fp8Tensor:
    """"1x128" [M, K] -> "128x1" ([K, M] data) in one pass: dequantize in registers, requantize
    along M. With pow2 scales this equals `quant_colwise` of the original except where a value
    was subnormal in one of the two quantizations (tested)."""
    _check_fp8("requant_colwise", q, "1x128")
    pow2 = check_scale_fmt(scale_fmt)
    if not use_triton(q.data, impl):
        return requant_colwise_ref(q, scale_fmt)
    data, sc = q.data, q.scale
    M, K = data.shape
    out = torch.empty(K, M, dtype=FP8_DTYPE, device=data.device)
    out_s = _scales(K, triton.cdiv(M, TILE), data.device, True)
    if not M:
        return Fp8Tensor(out, out_s, "128x1")
    if _words_ok(data, pow2):
        cfg = dict(launch or LAUNCH["requant_colwise"])
        num_kb, num_mb = K // cfg["BLOCK_K"], triton.cdiv(M, TILE)
        grid = min(num_kb * num_mb, cfg.pop("PROGS_PER_SM") * num_sms(data.device))
        _requant_colwise_words_kernel[(grid,)](
            data.view(torch.int32), sc, out.view(torch.int32), out_s, M // 16, data.stride(0) // 16, sc.stride(0),
            sc.stride(1), M // 16, out_s.stride(0), out_s.stride(1), num_kb, num_mb, EVEN=M % TILE == 0, **cfg)
    else:
        cfg = LAUNCH["requant_colwise_generic"]
        grid = (K // cfg["BLOCK_K"], triton.cdiv(M, TILE))
        _requant_colwise_kernel[grid](data, sc, out, out_s, M, K, data.stride(0), sc.stride(0), sc.stride(1),
                                      out.stride(0), out_s.stride(0), out_s.stride(1), POW2=pow2, PACK=_packs(M),
                                      **cfg)
    return Fp8Tensor(out, out_s, "128x1")


def quant_rowwise_colwise(x: Tensor, scale_fmt: str = "pow2", impl: str | None = None) -> tuple[Fp8Tensor, Fp8Tensor]:
    """x [M, K] -> ("1x128" [M, K] with column-major scales, "128x1" [K, M] data): ``r =
    quant_rowwise(x, colmajor_scale=True)`` and ``requant_colwise(r)``, the col-wise copy made from
    the row-wise FP8 values (the recipe's backward requantization). For a linear layer's input
    (fprop + wgrad operands) and its output gradient (dgrad + wgrad). Two kernels: the fused one
    (x read once, the codes not read back) held a 128 x 128 tile in registers and took 1.06-1.09x
    their time at every 3B shape (one H200, bench/notes/quant.md session 52)."""
    _check_input("quant_rowwise_colwise", x)
    if x.dim() != 2:
        raise ValueError(f"quant_rowwise_colwise: expected x [M, K], got shape {tuple(x.shape)}")
    r = quant_rowwise(x, scale_fmt, impl, colmajor_scale=True)
    return r, requant_colwise(r, scale_fmt, impl)


def swiglu_quant(h: Tensor, scale_fmt: str = "pow2", impl: str | None = None, *,
                 colmajor_scale: bool = False, launch: dict | None = None) -> Fp8Tensor:
    """h [M, 2I] = [gate | up], I % 128 == 0 -> a = silu(gate) * up as "1x128" FP8 [M, I]
    (scales column-major with colmajor_scale: fc2's GEMM operand)."""
    _check_input("swiglu_quant", h)
    if h.dim() != 2 or h.shape[1] % (2 * TILE):
        raise ValueError(f"swiglu_quant: expected h [M, 2I] with I % {TILE} == 0, got shape {tuple(h.shape)}")
    pow2 = check_scale_fmt(scale_fmt)
    if not use_triton(h, impl):
        return swiglu_quant_ref(h, scale_fmt, colmajor_scale=colmajor_scale)
    return _swiglu_quant(h, pow2, colmajor_scale, store_h=False, launch=launch)[1]


def swiglu_quant_cache(h: Tensor, scale_fmt: str = "pow2", impl: str | None = None, *,
                       colmajor_scale: bool = False, launch: dict | None = None) -> tuple[Fp8Tensor, Fp8Tensor]:
    """The expert MLP's forward in one pass over h [M, 2I]: (h8 = quant_rowwise(h), the cache
    backward recomputes SwiGLU from; a8 = swiglu_quant(h), fc2's input), both with column-major
    scales if asked (h8's are read by the col-wise dequant_swiglu_quant_colwise: 128 consecutive
    rows' scales in one run instead of one sector each, bench/notes/quant.md, session 30). launch:
    replaces LAUNCH["swiglu_quant"], the kernel it shares with `swiglu_quant`."""
    _check_input("swiglu_quant_cache", h)
    if h.dim() != 2 or h.shape[1] % (2 * TILE):
        raise ValueError(f"swiglu_quant_cache: expected h [M, 2I] with I % {TILE} == 0, got shape {tuple(h.shape)}")
    pow2 = check_scale_fmt(scale_fmt)
    if not use_triton(h, impl):
        return (quant_rowwise_ref(h, scale_fmt, colmajor_scale=colmajor_scale),
                swiglu_quant_ref(h, scale_fmt, colmajor_scale=colmajor_scale))
    return _swiglu_quant(h, pow2, colmajor_scale, store_h=True, launch=launch)


def _swiglu_quant(h: Tensor, pow2: bool, colmajor_scale: bool, store_h: bool,
                  launch: dict | None) -> tuple[Fp8Tensor | None, Fp8Tensor]:
    if h.stride(-1) != 1:
        h = h.contiguous()
    M, I = h.shape[0], h.shape[1] // 2
    q = torch.empty(M, I, dtype=FP8_DTYPE, device=h.device)
    s = _scales(M, I // TILE, h.device, colmajor_scale)
    hq = torch.empty(M, 2 * I, dtype=FP8_DTYPE, device=h.device) if store_h else q
    hs = _scales(M, 2 * I // TILE, h.device, colmajor_scale) if store_h else s
    if M:
        cfg = launch or LAUNCH["swiglu_quant"]
        grid = (I // TILE, triton.cdiv(M, cfg["BLOCK_M"]))
        _swiglu_quant_kernel[grid](h, q, s, hq, hs, M, I, h.stride(0), q.stride(0), s.stride(0), s.stride(1),
                                   hq.stride(0), hs.stride(0), hs.stride(1), POW2=pow2, STORE_H=store_h, **cfg)
    return (Fp8Tensor(hq, hs, "1x128") if store_h else None), Fp8Tensor(q, s, "1x128")


def dequant_swiglu_quant_colwise(h8: Fp8Tensor, scale_fmt: str = "pow2", impl: str | None = None, *,
                                 launch: dict | None = None) -> Fp8Tensor:
    """Backward recompute: cached "1x128" h [M, 2I] -> a = silu(gate) * up -> "128x1" FP8
    ([I, M] data, for the fc2 wgrad), in one pass."""
    _check_fp8("dequant_swiglu_quant_colwise", h8, "1x128")
    if h8.data.shape[1] % (2 * TILE):
        raise ValueError(f"dequant_swiglu_quant_colwise: 2I={h8.data.shape[1]} is not divisible by {2 * TILE}")
    pow2 = check_scale_fmt(scale_fmt)
    if not use_triton(h8.data, impl):
        return dequant_swiglu_quant_colwise_ref(h8, scale_fmt)
    data, sc = h8.data, h8.scale
    M, I = data.shape[0], data.shape[1] // 2
    q = torch.empty(I, M, dtype=FP8_DTYPE, device=data.device)
    s = _scales(I, triton.cdiv(M, TILE), data.device, True)
    if M and _words_ok(data, pow2):
        cfg = launch or LAUNCH["dequant_swiglu_quant_colwise"]
        num_kb, num_mb = I // cfg["BLOCK_K"], triton.cdiv(M, TILE)
        _dequant_swiglu_quant_colwise_strips_kernel[(num_kb * num_mb,)](
            data.view(torch.int32), sc, q.view(torch.int32), s, M // 16, data.stride(0) // 16, I // 16, sc.stride(0),
            sc.stride(1), M // 16, s.stride(0), s.stride(1), num_kb, num_mb, NW=cfg["num_warps"], EVEN=M % TILE == 0,
            **cfg)
    elif M:
        cfg = LAUNCH["dequant_swiglu_quant_colwise_generic"]
        grid = (I // cfg["BLOCK_K"], triton.cdiv(M, TILE))
        _dequant_swiglu_quant_colwise_kernel[grid](data, sc, q, s, M, I, data.stride(0), sc.stride(0), sc.stride(1),
                                                   q.stride(0), s.stride(0), s.stride(1), POW2=pow2,
                                                   PACK=_packs(M), **cfg)
    return Fp8Tensor(q, s, "128x1")


# ----------------------------------------------------------------------------------------------
# Pure-PyTorch reference twins: same clamp and order of operations as the kernels, in fp32.


def scale_from_amax_ref(amax: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    """amax fp32 (NaN-free) -> (scale, inverse scale), as `_scale_from_amax`."""
    amax = amax.float().clamp_min(AMAX_MIN)
    if pow2:
        bits = amax.view(torch.int32)
        e = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
        scale = ((e + 127) << 23).view(torch.float32)
        inv = ((127 - e) << 23).view(torch.float32)
    else:
        scale = amax / torch.full_like(amax, FP8_MAX)  # a tensor divisor: IEEE division on CUDA too
        inv = scale                                     # (torch multiplies by 1/448 for a scalar)
    is_inf = torch.isinf(amax)
    scale = torch.where(is_inf, torch.full_like(scale, float("inf")), scale)
    inv = torch.where(is_inf, torch.zeros_like(inv), inv)
    return scale, inv


def to_fp8_ref(x32: Tensor, scale: Tensor, inv: Tensor, pow2: bool) -> Tensor:
    q = x32 * inv if pow2 else x32 / scale
    return q.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # clamp keeps NaN


def _quant_lastdim_ref(x: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    """x [..., L] (any L) -> q [..., L] e4m3, s [..., ceil(L/128)]: 1x128 tiles, last one zero-padded."""
    L = x.shape[-1]
    G = -(-L // TILE)
    x32 = torch.nn.functional.pad(x.float(), (0, G * TILE - L)).reshape(*x.shape[:-1], G, TILE)
    amax = torch.where(torch.isnan(x32), 0.0, x32.abs()).amax(dim=-1)
    scale, inv = scale_from_amax_ref(amax, pow2)
    q = to_fp8_ref(x32, scale[..., None], inv[..., None], pow2)
    return q.reshape(*x.shape[:-1], G * TILE)[..., :L], scale


def _store_scales(s: Tensor, colmajor: bool) -> Tensor:
    """s [..., G] -> the same values laid out as the kernels store them (rows of all leading dims
    flattened; column-major if asked)."""
    return col_major(s.reshape(-1, s.shape[-1])).view(s.shape) if colmajor else s.contiguous()


def quant_rowwise_ref(x: Tensor, scale_fmt: str = "pow2", *, colmajor_scale: bool = False) -> Fp8Tensor:
    _check_input("quant_rowwise", x)
    q, s = _quant_lastdim_ref(x, check_scale_fmt(scale_fmt))
    return Fp8Tensor(q, _store_scales(s, colmajor_scale), "1x128")


def quant_colwise_ref(x: Tensor, scale_fmt: str = "pow2") -> Fp8Tensor:
    q, s = _quant_lastdim_ref(x.t(), check_scale_fmt(scale_fmt))
    return Fp8Tensor(q.contiguous(), col_major(s), "128x1")


def transpose_weight_ref(w8: Fp8Tensor) -> Fp8Tensor:
    """A "128x128" W [(E,) N, K] as Wᵀ [(E,) K, N]: the codes and the scale grid transposed (a
    transposed 128x128 tile is the same tile: no requantization)."""
    return Fp8Tensor(w8.data.transpose(-1, -2).contiguous(), w8.scale.transpose(-1, -2).contiguous(), "128x128")


def quant_weight_ref(w: Tensor, scale_fmt: str = "pow2") -> Fp8Tensor:
    pow2 = check_scale_fmt(scale_fmt)
    N, K = w.shape[-2:]
    Nb = -(-N // TILE)
    w32 = torch.nn.functional.pad(w.float(), (0, 0, 0, Nb * TILE - N))
    blocks = w32.reshape(*w.shape[:-2], Nb, TILE, K // TILE, TILE)
    amax = torch.where(torch.isnan(blocks), 0.0, blocks.abs()).amax(dim=(-3, -1))  # [..., Nb, K/128]
    scale, inv = scale_from_amax_ref(amax, pow2)
    q = to_fp8_ref(blocks, scale[..., :, None, :, None], inv[..., :, None, :, None], pow2)
    return Fp8Tensor(q.reshape(w32.shape)[..., :N, :], scale, "128x128")


def requant_colwise_ref(q: Fp8Tensor, scale_fmt: str = "pow2") -> Fp8Tensor:
    return quant_colwise_ref(q.dequantize(torch.float32), scale_fmt)


def quant_rowwise_colwise_ref(x: Tensor, scale_fmt: str = "pow2") -> tuple[Fp8Tensor, Fp8Tensor]:
    r = quant_rowwise_ref(x, scale_fmt, colmajor_scale=True)
    return r, requant_colwise_ref(r, scale_fmt)


def sigmoid_denom_ref(g: Tensor) -> Tensor:
    """1 + exp(-g) for fp32 g as the kernels' `_sigmoid_denom` computes it (exp2 of g * -log2 e)."""
    return 1.0 + torch.exp2(g * -LOG2E)


def swiglu_ref(h: Tensor) -> Tensor:
    """h [M, 2I] -> silu(h[:, :I]) * h[:, I:] in fp32, as the kernels compute it."""
    g, u = h.float().chunk(2, dim=-1)
    return g / sigmoid_denom_ref(g) * u


def swiglu_quant_ref(h: Tensor, scale_fmt: str = "pow2", *, colmajor_scale: bool = False) -> Fp8Tensor:
    q, s = _quant_lastdim_ref(swiglu_ref(h), check_scale_fmt(scale_fmt))
    return Fp8Tensor(q, _store_scales(s, colmajor_scale), "1x128")


def dequant_swiglu_quant_colwise_ref(h8: Fp8Tensor, scale_fmt: str = "pow2") -> Fp8Tensor:
    return quant_colwise_ref(swiglu_ref(h8.dequantize(torch.float32)), scale_fmt)
