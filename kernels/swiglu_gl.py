"""SwiGLU backward with both quantizations, in Gluon for Hopper (sm_90): the GPU default of
`moefp8.kernels.swiglu.swiglu_backward_quant` where Gluon runs, the same contract and the same bits
as that module's Triton kernel (reference twin: `swiglu.swiglu_backward_quant_ref`).

Why a second kernel: dh's "128x1" copy needs each column's amax over 128 rows before any of its
codes can be written, so a program must keep a 128 x 128 fp32 tile until its end. The Triton kernel
keeps it in registers (64 of its 128 per thread: 2 programs per SM, 25% occupancy, latency-bound
at ~0.37 of copy speed; bench/notes/quant.md, session 50). Here the tile waits in shared memory
(64 KB: 3 programs per SM) while registers hold one 16-row chunk at a time:

1. for each 16-row chunk: load g, u (FP8 + row scales) and da (BF16), compute dh in fp32 (the Triton
   kernel's formulas, in its order, no FMA contraction), quantize it row-wise and store ("1x128"),
   fold its |dh| into the column amaxes, and park it in shared memory;
2. the column scales from the amaxes; then for each 16 x 64 block: read the parked tile back
   4 consecutive rows a thread, quantize, store transposed ("128x1": 4-byte stores, whole 32-byte
   sectors).

Programs: (2I / 128 column groups of dh, cdiv(M, 128) row blocks), the gate's groups first, as in
the Triton kernel.
"""

import functools

import torch
import triton

from moefp8.fp8 import AMAX_MIN, FP8_MAX, TILE
from moefp8.kernels import device_index
from moefp8.kernels.quant import LOG2E

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    HAVE_GLUON = True
except ImportError:
    HAVE_GLUON = False

if HAVE_GLUON:
    # Gluon kernels read module globals only as constexprs
    ROWS = gl.constexpr(16)  # rows per chunk (8 values a thread at 8 warps: 32 needed ~120 registers)
    COLS = gl.constexpr(64)  # columns per block of step 2
    _AMAX_MIN = gl.constexpr(AMAX_MIN)
    _FP8_MAX = gl.constexpr(FP8_MAX)
    _LOG2E = gl.constexpr(LOG2E)
    # Triton 3.6 (the device's) calls the CTA barrier thread_barrier; 3.9 renamed it barrier
    _cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

    @gluon.jit
    def _scale_inv(amax, POW2: gl.constexpr):
        """quant._scale_from_amax: (scale, 1/scale) of an amax, pow2 from its bits."""
        amax = gl.maximum(amax, _AMAX_MIN)
        if POW2:
            bits = amax.to(gl.int32, bitcast=True)
            e = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(gl.int32)
            scale = ((e + 127) << 23).to(gl.float32, bitcast=True)
            inv = ((127 - e) << 23).to(gl.float32, bitcast=True)
        else:
            scale = gl.div_rn(amax, gl.full(amax.shape, _FP8_MAX, gl.float32, amax.type.layout))
            inv = scale
        is_inf = amax == float("inf")
        scale = gl.where(is_inf, float("inf"), scale)
        inv = gl.where(is_inf, 0.0, inv)
        return scale, inv

    @gluon.jit
    def _fp8(x, scale, inv, POW2: gl.constexpr):
        """quant._to_fp8 on the GPU: x / scale, RNE, saturated (the cast is cvt.rn.satfinite)."""
        if POW2:
            q = x * inv
        else:
            q = gl.div_rn(x, scale)
        return q.to(gl.float8e4nv)

    @gluon.jit
    def _dh_chunk(h, hs, da, I, rows, cols, m_left, stride_hm, stride_hsm, stride_hsg, stride_dam,
                  GATE: gl.constexpr):
        """dh for `rows` (fp32 [ROWS, 128]): swiglu._swiglu_grad_rows' loads and formulas."""
        ok = gl.expand_dims(rows < m_left, 1)
        r2 = gl.expand_dims(rows, 1)
        c2 = gl.expand_dims(cols, 0)
        g = gl.load(h + r2 * stride_hm + c2, mask=ok, other=0.0).to(gl.float32)
        g = g * gl.expand_dims(gl.load(hs + rows * stride_hsm, mask=rows < m_left, other=0.0), 1)
        u = gl.load(h + I + r2 * stride_hm + c2, mask=ok, other=0.0).to(gl.float32)
        hs_u = hs + (I // 128) * stride_hsg
        u = u * gl.expand_dims(gl.load(hs_u + rows * stride_hsm, mask=rows < m_left, other=0.0), 1)
        d = gl.load(da + r2 * stride_dam + c2, mask=ok, other=0.0).to(gl.float32)
        x = g * -_LOG2E
        den = 1.0 + gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32,
                                               is_pure=True, pack=1)
        sig = gl.div_rn(gl.full(g.shape, 1.0, gl.float32, g.type.layout), den)
        if GATE:
            return d * u * sig * (1.0 + g * (1.0 - sig))
        return d * (g * sig)

    @gluon.jit
    def _swiglu_bwd_quant_gl_kernel(h_ptr, hs_ptr, da_ptr, q_ptr, qs_ptr, c_ptr, cs_ptr, M, I, stride_hm,
                                    stride_hsm, stride_hsg, stride_dam, stride_qm, stride_qsm, stride_qsg,
                                    stride_ck, stride_csk, stride_csm, POW2: gl.constexpr,
                                    num_warps: gl.constexpr):
        # step 1: [ROWS, 128] chunks, a thread 4 contiguous columns
        row_l: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
        # step 2: [ROWS, COLS] blocks, a thread 4 consecutive rows of a column
        col_l: gl.constexpr = gl.BlockedLayout([4, 1], [ROWS // 4, 128 // ROWS], [1, num_warps], [0, 1])
        # the parked tile as 128 / ROWS chunks, swizzled per element by row (step 2's lanes, rows
        # 4i + r and columns c0 + j, spread over the banks)
        tile_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 32, [1, 0])
        vec_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        col = gl.program_id(0)  # this program's 128-column group of dh [M, 2I]
        pid_m = gl.program_id(1)
        G = I // 128
        gate = col < G
        pid_k = gl.where(gate, col, col - G)
        m0 = pid_m.to(gl.int64) * 128
        m_left = M - m0
        h = h_ptr + m0 * stride_hm + pid_k * 128
        hs = hs_ptr + m0 * stride_hsm + pid_k * stride_hsg
        da = da_ptr + m0 * stride_dam + pid_k * 128
        q = q_ptr + m0 * stride_qm + col * 128
        qs = qs_ptr + m0 * stride_qsm + col * stride_qsg
        tile = gl.allocate_shared_memory(gl.float32, [128 // ROWS, ROWS, 128], tile_l)
        amax_s = gl.allocate_shared_memory(gl.float32, [128], vec_l)
        rows0 = gl.arange(0, ROWS, layout=gl.SliceLayout(1, row_l))
        cols = gl.arange(0, 128, layout=gl.SliceLayout(0, row_l))
        amax = gl.zeros([128], gl.float32, layout=gl.SliceLayout(0, row_l))
        for j in range(128 // ROWS):
            rows = rows0 + j * ROWS
            if gate:
                d = _dh_chunk(h, hs, da, I, rows, cols, m_left, stride_hm, stride_hsm, stride_hsg, stride_dam, True)
            else:
                d = _dh_chunk(h, hs, da, I, rows, cols, m_left, stride_hm, stride_hsm, stride_hsg, stride_dam,
                              False)
            a = gl.abs(d)
            s, inv = _scale_inv(gl.max(a, axis=1), POW2)
            ok = rows < m_left
            gl.store(q + gl.expand_dims(rows, 1) * stride_qm + gl.expand_dims(cols, 0),
                     _fp8(d, gl.expand_dims(s, 1), gl.expand_dims(inv, 1), POW2), mask=gl.expand_dims(ok, 1))
            gl.store(qs + rows * stride_qsm, s, mask=ok)
            amax = gl.maximum(amax, gl.max(a, axis=0))
            tile.index(j).store(d)
        amax_s.store(amax)
        _cta_barrier()
        # step 2
        rr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, col_l))
        cc = gl.arange(0, COLS, layout=gl.SliceLayout(0, col_l))
        c = c_ptr + (col * 128).to(gl.int64) * stride_ck + m0
        cs = cs_ptr + col * 128 * stride_csk + pid_m * stride_csm
        for jc in gl.static_range(128 // COLS):
            s, inv = _scale_inv(amax_s.slice(jc * COLS, COLS).load(gl.SliceLayout(0, col_l)), POW2)
            ck = gl.expand_dims(cc + jc * COLS, 0).to(gl.int64) * stride_ck
            for jr in range(128 // ROWS):
                x = tile.index(jr).slice(jc * COLS, COLS, dim=1).load(col_l)
                rows = rr + jr * ROWS
                gl.store(c + ck + gl.expand_dims(rows, 1), _fp8(x, gl.expand_dims(s, 0), gl.expand_dims(inv, 0), POW2),
                         mask=gl.expand_dims(rows < m_left, 1))
            gl.store(cs + (cc + jc * COLS) * stride_csk, s)

def available(device: torch.device) -> bool:
    """Gluon present and `device` a Hopper (sm_90) GPU."""
    return HAVE_GLUON and device.type == "cuda" and _is_sm90(device_index(device))


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def launch(h8_data, h8_scale, da, q, qs, c, cs, pow2: bool, num_warps: int = 8, maxnreg: int | None = None) -> None:
    """The operands as `swiglu.swiglu_backward_quant` makes them (M > 0)."""
    M, I2 = h8_data.shape
    opts = dict(num_warps=num_warps, enable_fp_fusion=False)
    if maxnreg:
        opts["maxnreg"] = maxnreg
    _swiglu_bwd_quant_gl_kernel[(I2 // TILE, triton.cdiv(M, TILE))](
        h8_data, h8_scale, da, q, qs, c, cs, M, I2 // 2, h8_data.stride(0), h8_scale.stride(0), h8_scale.stride(1),
        da.stride(0), q.stride(0), qs.stride(0), qs.stride(1), c.stride(0), cs.stride(0), cs.stride(1), POW2=pow2,
        **opts)
