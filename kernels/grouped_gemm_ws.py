"""The grouped FP8 GEMMs for Hopper (sm_90), warp-specialized, in Gluon (Triton's explicit
dialect): the GPU defaults of `moefp8.kernels.grouped_gemm.launch_mgrouped` (experts fprop and
dgrad) and `launch_kgrouped` (experts wgrad), which choose between these and the Triton kernels
(this module imports nothing of that one). Same contracts and numerics as that module's Triton
kernels, bit for bit; reference twins: `grouped_gemm.fp8_grouped_gemm_ref` and
`fp8_grouped_gemm_wgrad_ref`.

Structure (DeepGEMM's, and cuBLAS's "coop" blockwise kernel's): per CTA one 1-warp TMA producer
and two 4-warp consumer warpgroups. The producer fills a STAGES-slot ring with the 128 x 128 A
tile and the 128 x 128 B tile of each K block of its tiles (persistent over 128 x 128 output
tiles); the two consumers each multiply a 64-row half of the same tile, so B is read from L2
once per 128 rows. A slot is handed back when both consumers have arrived on its `empty`
barrier (count 2). Nothing else joins the warpgroups, so one's FP32 promotion runs while the
other's wgmma keeps the tensor cores busy.

Per-128-K promotion (docs/design.md §1) inside one consumer: K blocks go in pairs, both wgmma in
flight, the first promoted (acc += d * scale) while the second still runs. The pair is the unit
on purpose: a wgmma accumulator that is still in flight must never be copied, and a loop that
carries one across iterations (`p = p_next`) makes the compiler copy it at the loop edges, after
which ptxas serializes every wgmma of the kernel (its advisory C7514, "wgmma.mma_async
instructions are serialized due to non wgmma instructions reading accumulator registers"). That
is what held the earlier warp-specialized attempts (bench/notes/gemm.md, sessions 9 and 13) below
the plain Triton kernel; `tests/kernels/test_grouped_gemm_ws.py` compiles both kernels for sm_90
and fails on that advisory, on its wait-injection twin C7517 and on register spills.

Measured (one H200, bench/results/gemm-NVIDIA-H200.json, DeepSeek-V3 expert shapes): m-grouped
0.94-0.98x cuBLAS dense blockwise on the balanced cases (1.2-1.4x the Triton TMA kernel),
1.06-1.17x torch's row-wise `_scaled_grouped_mm`, 1.55-1.69x BF16 `_grouped_mm`; k-grouped
1.06-1.10x BF16 `_grouped_mm` at 1024 tokens x 32 experts (FP32 dW: twice BF16's output bytes).
"""

import functools

import torch
import triton

from moefp8.fp8 import Fp8Tensor
from moefp8.kernels import device_index, num_sms

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_GLUON = True
except ImportError:  # an older Triton: launch_mgrouped keeps its Triton kernels
    HAVE_GLUON = False

TILE_M, BLOCK_N, STAGES, GROUP_M = 128, 128, 4, 8
CONSUMER_REGS, PRODUCER_REGS, MAXNREG = 232, 40, 168  # 232 + 232 + 40 = 3 x 168: the 12 warps' register file
KG_CONSUMER_REGS, KG_PRODUCER_REGS = 240, 24  # the wgrad's column scales need more: 240 + 240 + 24 = 504
KG_STAGES = 4  # the k-grouped ring's default depth (grouped_gemm.GemmPolicy.kg_stages)

if HAVE_GLUON:
    # Triton 3.6 (the device's) names the TMA copies async_copy_*; 3.9 renamed them async_load / async_store.
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    _tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global

    @gluon.jit
    def _tile_of(t, num_m, num_n, inner, N, GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """Work tile t (GROUP_M row tiles sweep the column tiles together) -> (row0, n0, expert,
        first row of its B tile in the [E*N, K] view). Tiles never straddle experts: segments are
        128-aligned."""
        per_group = GROUP_M * num_n
        first_m = (t // per_group) * GROUP_M
        size_m = gl.minimum(num_m - first_m, GROUP_M)
        row0 = (first_m + (t % per_group) % size_m) * BLOCK_M
        n0 = ((t % per_group) // size_m) * BLOCK_N
        e = gl.sum((inner <= row0).to(gl.int32), axis=0)
        return row0, n0, e, e * N + n0

    @gluon.jit
    def _work(off_ptr, N, E, E_POW2: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              nw: gl.constexpr):
        """-> (row tiles holding expert rows, column tiles, the inner offsets, this CTA's tile count)."""
        e_layout: gl.constexpr = gl.BlockedLayout([1], [32], [nw], [0])
        num_m = gl.cdiv(gl.load(off_ptr + E), BLOCK_M)
        num_n = gl.cdiv(N, BLOCK_N)
        ie = gl.arange(0, E_POW2, layout=e_layout)
        inner = gl.load(off_ptr + 1 + ie, mask=ie < E - 1, other=2147483647)
        my_tiles = gl.maximum(gl.cdiv(num_m * num_n - gl.program_id(0), gl.num_programs(0)), 0)
        return num_m, num_n, inner, my_tiles

    @gluon.jit
    def _producer(a_desc, b_desc, a_s, b_s, ready, empty, off_ptr, N, K, E, E_POW2: gl.constexpr,
                  GROUP_M: gl.constexpr):
        """1 warp: the A and B tiles of every K block of this CTA's tiles into the ring."""
        STAGES: gl.constexpr = a_s.type.shape[0]
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        num_m, num_n, inner, my_tiles = _work(off_ptr, N, E, E_POW2, BLOCK_M, BLOCK_N, 1)
        k_tiles = K // 128
        i = 0
        for j in range(my_tiles):
            row0, n0, e, b_row = _tile_of(gl.program_id(0) + j * gl.num_programs(0), num_m, num_n, inner, N,
                                          GROUP_M, BLOCK_M, BLOCK_N)
            for kb in range(k_tiles):
                s = i % STAGES
                mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
                mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                _tma_load(a_desc, [row0, kb * 128], ready.index(s), a_s.index(s))
                _tma_load(b_desc, [b_row, kb * 128], ready.index(s), b_s.index(s))
                i += 1

    @gluon.jit
    def _issue(a_s, b_s, ready, q, SUB: gl.constexpr, zero):
        """wgmma (async, fresh accumulator) of ring position q on this consumer's 64 rows."""
        STAGES: gl.constexpr = a_s.type.shape[0]
        s = q % STAGES
        mbarrier.wait(ready.index(s), (q // STAGES) & 1)
        return warpgroup_mma(a_s.index(s).slice(SUB, 64), b_s.index(s).permute((1, 0)), zero, use_acc=False,
                             is_async=True)

    @gluon.jit
    def _promote(acc, p, empty, q, scale, OUTSTANDING: gl.constexpr):
        """Waits for the wgmma p (leaving OUTSTANDING groups in flight), frees its ring slot q,
        adds its partial product times the K block's scale (broadcastable to the tile) into acc."""
        STAGES: gl.constexpr = empty.type.shape[0]
        d = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(p, ))
        mbarrier.arrive(empty.index(q % STAGES), count=1)
        return acc + d * scale

    @gluon.jit
    def _store_tile(c_desc, c_s, acc, row, col):
        """acc -> c_s -> global at [row, col] (TMA store left in flight)."""
        tma.store_wait(pendings=0)  # the previous store has left c_s
        c_s.store(acc.to(c_desc.dtype))
        fence_async_shared()
        _tma_store(c_desc, [row, col], c_s)

    @gluon.jit
    def _consumer(c_desc, a_s, b_s, c_s, ready, empty, ast_ptr, bs_ptr, off_ptr, M, N, K, E, stride_bse,
                  stride_bsn, SUB: gl.constexpr, E_POW2: gl.constexpr, GROUP_M: gl.constexpr,
                  num_warps: gl.constexpr):
        """4 warps: rows [SUB, SUB + 64) of every tile; epilogue through c_s and a TMA store."""
        BLOCK_M: gl.constexpr = a_s.type.shape[1]
        BLOCK_N: gl.constexpr = b_s.type.shape[1]
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, mma_layout))
        zero = gl.zeros((64, BLOCK_N), gl.float32, layout=mma_layout)
        num_m, num_n, inner, my_tiles = _work(off_ptr, N, E, E_POW2, BLOCK_M, BLOCK_N, num_warps)
        k_tiles = K // 128
        i = 0  # ring position of the tile's first K block
        for j in range(my_tiles):
            row0, n0, e, b_row = _tile_of(gl.program_id(0) + j * gl.num_programs(0), num_m, num_n, inner, N,
                                          GROUP_M, BLOCK_M, BLOCK_N)
            as_ptrs = ast_ptr + (row0 + SUB + rows) % M  # a scales [K/128, M]: row kb holds K block kb
            bs_ptr_t = bs_ptr + e.to(gl.int64) * stride_bse + (n0 // 128) * stride_bsn
            acc = zero
            for kb in range(0, k_tiles - 1, 2):
                sx = gl.load(as_ptrs + kb * M) * gl.load(bs_ptr_t + kb)
                sy = gl.load(as_ptrs + (kb + 1) * M) * gl.load(bs_ptr_t + kb + 1)
                px = _issue(a_s, b_s, ready, i + kb, SUB, zero)
                py = _issue(a_s, b_s, ready, i + kb + 1, SUB, zero)
                acc = _promote(acc, px, empty, i + kb, gl.expand_dims(sx, 1), 1)  # under py's wgmma
                acc = _promote(acc, py, empty, i + kb + 1, gl.expand_dims(sy, 1), 0)
            if k_tiles % 2 == 1:
                sx = gl.load(as_ptrs + (k_tiles - 1) * M) * gl.load(bs_ptr_t + k_tiles - 1)
                px = _issue(a_s, b_s, ready, i + k_tiles - 1, SUB, zero)
                acc = _promote(acc, px, empty, i + k_tiles - 1, gl.expand_dims(sx, 1), 0)
            i += k_tiles
            _store_tile(c_desc, c_s, acc, row0 + SUB, n0)
        # row tiles past the last expert's rows: zeros
        zero_tiles = (gl.cdiv(M, BLOCK_M) - num_m) * num_n
        if zero_tiles > 0:
            tma.store_wait(pendings=0)
            c_s.store(zero.to(c_desc.dtype))
            fence_async_shared()
            for t in range(gl.program_id(0), zero_tiles, gl.num_programs(0)):
                _tma_store(c_desc, [(num_m + t // num_n) * BLOCK_M + SUB, (t % num_n) * BLOCK_N], c_s)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _mgrouped_ws_kernel(a_desc, b_desc, c_desc, ast_ptr, bs_ptr, off_ptr, M, N, K, E, stride_bse, stride_bsn,
                            E_POW2: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """a [M, K] FP8 (TMA), ast [K/128, M] fp32; b [E*N, K] FP8 (TMA), bs [E, N/128, K/128];
        off int32 [E+1]; c [M, N] BF16 (TMA, 64-row boxes). num_warps = 4: the default partition
        is the first consumer."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        a_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, 128], a_desc.layout)
        b_s = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, 128], b_desc.layout)
        c_s0 = gl.allocate_shared_memory(c_desc.dtype, [64, BLOCK_N], c_desc.layout)
        c_s1 = gl.allocate_shared_memory(c_desc.dtype, [64, BLOCK_N], c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for q in gl.static_range(STAGES):
            mbarrier.init(ready.index(q), count=1)
            mbarrier.init(empty.index(q), count=2)  # both consumers
        gl.warp_specialize([
            (_consumer, (c_desc, a_s, b_s, c_s0, ready, empty, ast_ptr, bs_ptr, off_ptr, M, N, K, E, stride_bse,
                         stride_bsn, 0, E_POW2, GROUP_M, 4)),
            (_consumer, (c_desc, a_s, b_s, c_s1, ready, empty, ast_ptr, bs_ptr, off_ptr, M, N, K, E, stride_bse,
                         stride_bsn, 64, E_POW2, GROUP_M, 4)),
            (_producer, (a_desc, b_desc, a_s, b_s, ready, empty, off_ptr, N, K, E, E_POW2, GROUP_M)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        for q in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(q))
            mbarrier.invalidate(empty.index(q))

    # ------------------------------------------------------------------------------------------
    # k-grouped (experts wgrad): dW[e] [N, K] (+)= dY_e^T X_e over expert e's 128-token blocks. Tiles
    # are 128 x 128 blocks of dW[e] (expert-major, then GROUP_M row tiles sweep the column tiles), the
    # "K" loop runs over the expert's token blocks; A = dY "128x1" data [N, M], B = X "128x1" data
    # [K, M] (tokens contiguous: K-major for wgmma); scales per (token block, row) of each operand,
    # so the promotion multiplies by an outer product of the two scale vectors.

    @gluon.jit
    def _kg_tile(t, num_r, num_c, off_ptr, GROUP_M: gl.constexpr):
        """Work tile t -> (expert, row0 in N, col0 in K, first token, token blocks)."""
        per_e = num_r * num_c
        e = t // per_e
        u = t % per_e
        per_group = GROUP_M * num_c
        first_r = (u // per_group) * GROUP_M
        size_r = gl.minimum(num_r - first_r, GROUP_M)
        r0 = (first_r + (u % per_group) % size_r) * 128
        c0 = ((u % per_group) // size_r) * 128
        t0 = gl.load(off_ptr + e)  # (keeping all offsets in registers instead, picked by a reduction,
        t1 = gl.load(off_ptr + e + 1)  # measured 20% slower at 8 experts: bench/notes/gemm.md, session 14)
        return e, r0, c0, t0, gl.cdiv(t1 - t0, 128)

    @gluon.jit
    def _outer(sa, sb):
        """Row scales x column scales: a dW tile's per-element scale of one token block."""
        return gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0)

    @gluon.jit
    def _kg_producer(a_desc, b_desc, a_s, b_s, ready, empty, off_ptr, N, K, E, GROUP_M: gl.constexpr):
        STAGES: gl.constexpr = a_s.type.shape[0]
        num_r = N // 128
        num_c = K // 128
        i = 0
        for t in range(gl.program_id(0), E * num_r * num_c, gl.num_programs(0)):
            e, r0, c0, t0, k_tiles = _kg_tile(t, num_r, num_c, off_ptr, GROUP_M)
            for kb in range(k_tiles):
                s = i % STAGES
                mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                _tma_load(a_desc, [r0, t0 + kb * 128], ready.index(s), a_s.index(s))
                _tma_load(b_desc, [c0, t0 + kb * 128], ready.index(s), b_s.index(s))
                i += 1

    @gluon.jit
    def _kg_consumer(c_desc, a_s, b_s, c_s, ready, empty, cbar, ast_ptr, bst_ptr, off_ptr, N, K, E,
                     SUB: gl.constexpr, ACCUMULATE: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
        """4 warps: rows [SUB, SUB + 64) of every dW tile. ACCUMULATE: the tile's previous values come
        into c_s by TMA (barrier cbar) while its K loop runs, and are added to it in the epilogue."""
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, 128, 32])
        col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        flat: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])  # one column per thread
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, mma_layout))
        cols = gl.arange(0, 128, layout=flat)
        zero = gl.zeros((64, 128), gl.float32, layout=mma_layout)
        num_r = N // 128
        num_c = K // 128
        i = 0
        for t in range(gl.program_id(0), E * num_r * num_c, gl.num_programs(0)):
            e, r0, c0, t0, k_tiles = _kg_tile(t, num_r, num_c, off_ptr, GROUP_M)
            if ACCUMULATE:  # every tile's (cbar's phase: the tile's parity), stored back where the expert has tokens
                tma.store_wait(pendings=0)  # the previous tile's store has left c_s
                mbarrier.expect(cbar, c_desc.block_type.nbytes)
                _tma_load(c_desc, [e * N + r0 + SUB, c0], cbar, c_s)
            as_ptrs = ast_ptr + (t0 // 128).to(gl.int64) * N + r0 + SUB + rows  # ast [T/128, N]
            # bst [T/128, K]: loaded one column per thread, then spread to the accumulator's column
            # layout (32 values per thread there: 32 pointers would cost 64 registers)
            bs_ptrs = bst_ptr + (t0 // 128).to(gl.int64) * K + c0 + cols
            acc = zero
            for kb in range(0, k_tiles - 1, 2):
                sax = gl.load(as_ptrs + kb * N)
                say = gl.load(as_ptrs + (kb + 1) * N)
                sbx = gl.load(bs_ptrs + kb * K)
                sby = gl.load(bs_ptrs + (kb + 1) * K)
                px = _issue(a_s, b_s, ready, i + kb, SUB, zero)
                py = _issue(a_s, b_s, ready, i + kb + 1, SUB, zero)
                acc = _promote(acc, px, empty, i + kb, _outer(sax, gl.convert_layout(sbx, col_layout)), 1)
                acc = _promote(acc, py, empty, i + kb + 1, _outer(say, gl.convert_layout(sby, col_layout)), 0)
            if k_tiles % 2 == 1:
                sax = gl.load(as_ptrs + (k_tiles - 1) * N)
                sbx = gl.load(bs_ptrs + (k_tiles - 1) * K)
                px = _issue(a_s, b_s, ready, i + k_tiles - 1, SUB, zero)
                acc = _promote(acc, px, empty, i + k_tiles - 1, _outer(sax, gl.convert_layout(sbx, col_layout)), 0)
            i += k_tiles
            row = e * N + r0 + SUB  # dW viewed [E*N, K]
            if ACCUMULATE:
                mbarrier.wait(cbar, ((t - gl.program_id(0)) // gl.num_programs(0)) & 1)
                if k_tiles > 0:  # (an expert with no tokens leaves its dW alone)
                    acc = acc + c_s.load(mma_layout)  # (each thread reads, then overwrites, its own elements)
                    c_s.store(acc)
                    fence_async_shared()
                    _tma_store(c_desc, [row, c0], c_s)
            else:
                _store_tile(c_desc, c_s, acc, row, c0)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _kgrouped_ws_kernel(a_desc, b_desc, c_desc, ast_ptr, bst_ptr, off_ptr, N, K, E,
                            ACCUMULATE: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """a [N, M] and b [K, M] FP8 (TMA, 128 x 128 boxes), ast [T/128, N] and bst [T/128, K] fp32,
        c [E*N, K] fp32 (TMA, 64-row boxes, read by TMA too when ACCUMULATE). N, K multiples of 128."""
        a_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES, 128, 128], a_desc.layout)
        b_s = gl.allocate_shared_memory(b_desc.dtype, [STAGES, 128, 128], b_desc.layout)
        c_s0 = gl.allocate_shared_memory(c_desc.dtype, [64, 128], c_desc.layout)
        c_s1 = gl.allocate_shared_memory(c_desc.dtype, [64, 128], c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        cbar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # a consumer's c_s load
        for q in gl.static_range(STAGES):
            mbarrier.init(ready.index(q), count=1)
            mbarrier.init(empty.index(q), count=2)
        for q in gl.static_range(2):
            mbarrier.init(cbar.index(q), count=1)
        gl.warp_specialize([
            (_kg_consumer, (c_desc, a_s, b_s, c_s0, ready, empty, cbar.index(0), ast_ptr, bst_ptr, off_ptr, N, K,
                            E, 0, ACCUMULATE, GROUP_M, 4)),
            (_kg_consumer, (c_desc, a_s, b_s, c_s1, ready, empty, cbar.index(1), ast_ptr, bst_ptr, off_ptr, N, K,
                            E, 64, ACCUMULATE, GROUP_M, 4)),
            (_kg_producer, (a_desc, b_desc, a_s, b_s, ready, empty, off_ptr, N, K, E, GROUP_M)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        for q in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(q))
            mbarrier.invalidate(empty.index(q))
        for q in gl.static_range(2):
            mbarrier.invalidate(cbar.index(q))

    # The shared-memory layouts of the descriptors' blocks, made once (made per launch they were
    # ~20 ms of Python per step of the 16B preset, bench/notes/scale.md)
    @functools.cache
    def _kg_layouts():
        return (gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv),
                gl.NVMMASharedLayout.get_default_for([64, 128], gl.float32))

    @functools.cache
    def _mg_layouts():
        return (gl.NVMMASharedLayout.get_default_for([TILE_M, 128], gl.float8e4nv),
                gl.NVMMASharedLayout.get_default_for([BLOCK_N, 128], gl.float8e4nv),
                gl.NVMMASharedLayout.get_default_for([64, BLOCK_N], gl.bfloat16))

    def kg_descriptors(a_data: torch.Tensor, b_data: torch.Tensor, out: torch.Tensor):
        """Host TMA descriptors: a [N, M] and b [K, M] FP8, out [E, N, K] fp32 (all contiguous)."""
        N, M = a_data.shape
        K = b_data.shape[0]
        E = out.shape[0]
        l8, c_l = _kg_layouts()
        return (TensorDescriptor(a_data, [N, M], [M, 1], [128, 128], l8),
                TensorDescriptor(b_data, [K, M], [M, 1], [128, 128], l8),
                TensorDescriptor(out.view(E * N, K), [E * N, K], [K, 1], [64, 128], c_l))

    def descriptors(a_data: torch.Tensor, b_data: torch.Tensor, out: torch.Tensor):
        """Host TMA descriptors: a [M, K] and b [E, N, K] FP8, out [M, N] BF16 (all contiguous)."""
        M, K = a_data.shape
        E, N, _ = b_data.shape
        a_l, b_l, c_l = _mg_layouts()
        return (TensorDescriptor(a_data, [M, K], [K, 1], [TILE_M, 128], a_l),
                TensorDescriptor(b_data.view(E * N, K), [E * N, K], [K, 1], [BLOCK_N, 128], b_l),
                TensorDescriptor(out, [M, N], [N, 1], [64, BLOCK_N], c_l))


def _grid_sms(device: torch.device, reserved: int) -> int:
    """Programs of a persistent grid that leaves `reserved` SMs free: a CTA of these kernels fills an
    SM (227 KB of shared memory, the whole register file), so a collective launched while one runs
    finds no SM to start on (the two micro-batch overlap's all-to-alls). Never below one."""
    return max(1, num_sms(device) - reserved)


def available(device: torch.device) -> bool:
    """Gluon present and `device` a Hopper (sm_90) GPU."""
    return HAVE_GLUON and device.type == "cuda" and _is_sm90(device_index(device))


@functools.cache
def _is_sm90(index: int) -> bool:  # asked per launch: the device's properties read once
    return torch.cuda.get_device_capability(index) == (9, 0)



def supported(a: Fp8Tensor, b: Fp8Tensor, out: torch.Tensor) -> bool:
    """Whether the kernel runs here: Gluon present, a Hopper (sm_90) GPU, BF16 out, and the TMA
    descriptors' rules (no empty tensor, N % 8 == 0 for 16-byte output rows, 16-byte aligned bases)."""
    if not (available(out.device) and out.dtype == torch.bfloat16 and out.is_contiguous()):
        return False
    M, K = a.data.shape
    N = b.data.shape[1]
    return M > 0 and K > 0 and N % 8 == 0 and all(t.data_ptr() % 16 == 0 for t in (a.data, b.data, out))


def launch_mgrouped_ws(a: Fp8Tensor, b: Fp8Tensor, off: torch.Tensor, out: torch.Tensor,
                       reserved_sms: int = 0) -> torch.Tensor:
    """Validated operands (as `grouped_gemm.launch_mgrouped`, where `supported`): a "1x128"
    [M, K], b "128x128" [E, N, K], off int32 [E+1] on the device, out BF16 [M, N]; the persistent
    grid leaves `reserved_sms` SMs free."""
    M, K = a.data.shape
    E, N, _ = b.data.shape
    a_data, b_data, b_scale = a.data.contiguous(), b.data.contiguous(), b.scale.contiguous()
    ast = a.scale.t().contiguous()  # [K/128, M]; free when the scales are stored column-major
    a_d, b_d, c_d = descriptors(a_data, b_data, out)
    tiles = triton.cdiv(M, TILE_M) * triton.cdiv(N, BLOCK_N)
    grid = (max(1, min(_grid_sms(out.device, reserved_sms), tiles)),)
    _mgrouped_ws_kernel[grid](a_d, b_d, c_d, ast, b_scale, off, M, N, K, E, b_scale.stride(0), b_scale.stride(1),
                              E_POW2=max(triton.next_power_of_2(E), 2), GROUP_M=GROUP_M, STAGES=STAGES,
                              CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4,
                              maxnreg=MAXNREG)
    return out


def kgrouped_supported(dy: Fp8Tensor, x: Fp8Tensor, out: torch.Tensor) -> bool:
    """Whether the k-grouped kernel runs here: Gluon, sm_90, N and K multiples of 128 (a dW tile
    never crosses experts in the [E*N, K] view), tokens 0 < M, M % 16 == 0 (TMA: no empty
    descriptors, 16-byte row strides), fp32 out."""
    if not (available(out.device) and out.dtype == torch.float32 and out.is_contiguous()):
        return False
    N, M = dy.data.shape
    K = x.data.shape[0]
    return N % 128 == 0 and K % 128 == 0 and M > 0 and M % 16 == 0 and all(
        t.data_ptr() % 16 == 0 for t in (dy.data, x.data, out))


def launch_kgrouped_ws(dy: Fp8Tensor, x: Fp8Tensor, off: torch.Tensor, out: torch.Tensor, accumulate: bool,
                       reserved_sms: int = 0, stages: int = KG_STAGES) -> torch.Tensor:
    """Validated operands (as `grouped_gemm.launch_kgrouped`, where `kgrouped_supported`): dy
    "128x1" data [N, M], x "128x1" data [K, M], off int32 [E+1], out fp32 [E, N, K]; the persistent
    grid leaves `reserved_sms` SMs free; `stages`: the depth of the operand ring."""
    N, M = dy.data.shape
    K = x.data.shape[0]
    E = off.numel() - 1
    a, b = dy.data.contiguous(), x.data.contiguous()
    ast, bst = dy.scale.t().contiguous(), x.scale.t().contiguous()  # [ceil(M/128), N | K]
    a_d, b_d, c_d = kg_descriptors(a, b, out)
    grid = (max(1, min(_grid_sms(out.device, reserved_sms), E * (N // 128) * (K // 128))),)
    _kgrouped_ws_kernel[grid](a_d, b_d, c_d, ast, bst, off, N, K, E, ACCUMULATE=accumulate, GROUP_M=GROUP_M,
                              STAGES=stages,
                              CONSUMER_REGS=KG_CONSUMER_REGS, PRODUCER_REGS=KG_PRODUCER_REGS, num_warps=4,
                              maxnreg=MAXNREG)
    return out
