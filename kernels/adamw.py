"""Fused AdamW update (moefp8.optim.AdamW.step): Triton kernel -> public wrapper -> `_ref` twin.

One pass per parameter: read p (fp32 master), g (fp32|bf16), m and v (bf16|fp32), write p, m, v,
which replaces the reference's dozen elementwise passes. An optional gradient multiplier (a device
scalar: the clipping factor times 1/world where the gradients hold sums over the ranks) is applied
as g is read, so neither the mean nor the clipping costs a pass over the gradients of its own.
Math in fp32, in the reference's order: torch.lerp for m, addcmul for v, the moments stored rounded
but the update made from the fp32 values, then decay and addcdiv with IEEE division and sqrt. The FMAs
are written out (`tl.fma` where the reference's lerp, addcmul and addcdiv make one) and the compiler's
own contraction is off: the products it fused depended on how the gradient was loaded (a BF16 gradient
2 bytes off a 16-byte boundary moved v by an ulp), so now an update is the same bits at any alignment.
Against the CUDA reference (torch 2.11) m agrees bit for bit, p in 99.6% and v in 85% of the elements,
the rest within the tests' few-ulp tolerance (bench/notes/scale.md, session 59). With `low=` the same
pass also writes the weight's BF16 copy (moefp8.weight_copy: 2 bytes more per weight instead of a cast
that reads the masters again).

`adamw_quant_step_` is the update of a weight that keeps a persistent FP8 copy for the GEMMs
(moefp8.weight_copy): the same update (one formula, `_adam`), then the block's "128x128" codes and
scale from the values just written, read back from L2 (one program per 128x128 block), so the copy
costs the optimizer 1-2 bytes written per weight instead of a quantization pass that reads the 4-byte
masters again. Its codes are `quant_weight`'s of the updated weight, bit for bit.
`adamw_quant_multi_step_` runs it on several weights of one shape in one launch (the kernel reads their
addresses from a table): a [2048, 2048] weight alone is 256 blocks, one wave of latency-bound programs
(27 such weights: 0.64 ms in one launch against 0.89 ms one launch each, one H200, bench/notes/scale.md
session 58), the same bits.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.graph import increment_version

from moefp8.fp8 import FP8_DTYPE, TILE, Fp8Tensor, check_scale_fmt
from moefp8.kernels import use_triton
from moefp8.kernels.quant import _abs_nan0, _scale_from_amax, _to_fp8, quant_weight_ref, transpose_weight_ref

_MOMENT_DTYPES = (torch.bfloat16, torch.float32)
# 8 elements per thread: 128-bit loads and stores, two per fp32 tensor and one per bf16 one, when
# numel % 16 == 0 (Triton specializes on it; all tensors of the small model) and scalar ones
# otherwise. Not tuned on a GPU: the kernel is bandwidth-bound at any sane setting.
BLOCK, NUM_WARPS = 1024, 4
# The fused update + quantization: a 128x128 block per program, ROWS rows of it per pass (ROWS = 128: the
# whole block in registers, its codes made from them). One H200, 3B expert weight [32, 2048, 2048]: 0.739 ms
# against 0.839 for adamw_step_ + quant_weight (plain update 0.630; ROWS/warps 16/8 0.889, 64/16 0.864,
# 128/16 1.266 (spills), 128/32 1.185; bench/notes/scale.md, session 57).
QUANT_LAUNCH = dict(ROWS=64, num_warps=32)


@triton.jit
def _adam(p, g, m, v, w1, beta2, w2, eps, decay, step_size, bc2):
    """The update in fp32 -> (new p, m, v): both kernels' one formula."""
    m = tl.fma(w1, g - m, m)  # torch.lerp's formula for w1 < 0.5 (beyond, g - (g - m) * (1 - w1): an ulp apart)
    v = tl.fma(w2 * g, g, v * beta2)  # v.mul(beta2).addcmul_(g, g, value=w2)
    denom = tl.sqrt_rn(tl.math.div_rn(v, bc2)) + eps
    return tl.fma(step_size, tl.math.div_rn(m, denom), p * decay), m, v  # p.mul_(decay).addcdiv_(m, denom)


@triton.jit
def _adam_rows(p_ptr, g_ptr, m_ptr, v_ptr, gs_ptr, offs, mask, w1, beta2, w2, eps, decay, step_size, bc2,
               SCALED: tl.constexpr):
    """The update of the elements at offs (masked: read as 0, not stored) -> their new p (stored)."""
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        g = g * tl.load(gs_ptr)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p, m, v = _adam(p, g, m, v, w1, beta2, w2, eps, decay, step_size, bc2)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
    tl.store(p_ptr + offs, p, mask=mask)
    return p


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, gs_ptr, lo_ptr, n, w1, beta2, w2, eps, decay, step_size, bc2,
                  SCALED: tl.constexpr, LOW: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    p = _adam_rows(p_ptr, g_ptr, m_ptr, v_ptr, gs_ptr, offs, offs < n, w1, beta2, w2, eps, decay, step_size, bc2,
                   SCALED)
    if LOW:  # the weight's BF16 copy (moefp8.weight_copy)
        tl.store(lo_ptr + offs, p.to(lo_ptr.dtype.element_ty), mask=offs < n)


@triton.jit
def _adamw_quant_kernel(p_ptr, g_ptr, m_ptr, v_ptr, gs_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, N, K, w1, beta2, w2, eps,
                        decay, step_size, bc2, SCALED: tl.constexpr, POW2: tl.constexpr, TRANS: tl.constexpr,
                        ROWS: tl.constexpr):
    """One 128x128 block of p [E, N, K] (contiguous, as g, m and v) a program (`_adamw_quant_block`)."""
    _adamw_quant_block(p_ptr, g_ptr, m_ptr, v_ptr, gs_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, tl.program_id(0),
                       tl.program_id(1), tl.program_id(2).to(tl.int64), N, K, w1, beta2, w2, eps, decay, step_size,
                       bc2, SCALED, POW2, TRANS, ROWS)


@triton.jit
def _typed(tab_ptr, i, dtype: tl.constexpr):
    """Entry i of a pointer table row: an int64 address -> a pointer to dtype (16-byte aligned: torch's
    allocations and the wrapper's check)."""
    return tl.multiple_of(tl.load(tab_ptr + i).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _adamw_quant_multi_kernel(tab_ptr, gs_ptr, N, K, w1, beta2, w2, eps, decay, step_size, bc2,
                              G_DTYPE: tl.constexpr, M_DTYPE: tl.constexpr, SCALED: tl.constexpr,
                              POW2: tl.constexpr, TRANS: tl.constexpr, ROWS: tl.constexpr):
    """`_adamw_quant_kernel` over T weights of one shape [N, K] in one launch: program (k, n, t) takes
    block (n, k) of weight t, whose eight addresses (p, g, m, v, codes, scales, transposed codes and
    scales) are row t of the int64 table [T, 8]. One launch fills the GPU where a small weight's own
    grid is a single wave of latency-bound programs ([2048, 2048]: 256 blocks)."""
    row = tab_ptr + tl.program_id(2).to(tl.int64) * 8
    _adamw_quant_block(_typed(row, 0, tl.float32), _typed(row, 1, G_DTYPE), _typed(row, 2, M_DTYPE),
                       _typed(row, 3, M_DTYPE), gs_ptr, _typed(row, 4, tl.float8e4nv), _typed(row, 5, tl.float32),
                       _typed(row, 6, tl.float8e4nv), _typed(row, 7, tl.float32), tl.program_id(0), tl.program_id(1),
                       tl.full([], 0, tl.int64), N, K, w1, beta2, w2, eps, decay, step_size, bc2, SCALED, POW2, TRANS,
                       ROWS)


@triton.jit
def _adamw_quant_block(p_ptr, g_ptr, m_ptr, v_ptr, gs_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, pid_k, pid_n, pid_e, N, K,
                       w1, beta2, w2, eps, decay, step_size, bc2, SCALED: tl.constexpr, POW2: tl.constexpr,
                       TRANS: tl.constexpr, ROWS: tl.constexpr):
    """Block (pid_n, pid_k) of p[pid_e]: the update, ROWS rows at a time, then the new block's codes
    and scale as `quant._quant_weight_kernel` makes them from the stored values (read back from L2);
    TRANS (N % 128 == 0): the transposed block and scale too."""
    base = pid_e * N * K + pid_n.to(tl.int64) * 128 * K + pid_k * 128
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, 128)
    n_left = N - pid_n * 128
    Kb = K // 128
    s_at = s_ptr + pid_e * tl.cdiv(N, 128) * Kb + pid_n * Kb + pid_k
    if ROWS == 128:  # the whole block at once: its codes from the registers
        offs = rows[:, None] * K + cols[None, :]
        mask = (rows < n_left)[:, None]
        p = _adam_rows(p_ptr, g_ptr, m_ptr, v_ptr, gs_ptr, base + offs, mask, w1, beta2, w2, eps, decay, step_size,
                       bc2, SCALED)
        scale, inv = _scale_from_amax(tl.max(tl.max(_abs_nan0(p), axis=1), axis=0), POW2)
        tl.store(q_ptr + base + offs, _to_fp8(p, scale, inv, POW2), mask=mask)
    else:  # ROWS at a time, then the codes from the stored values (read back from L2)
        amax = tl.zeros((ROWS, 128), tl.float32)
        for r0 in range(0, 128, ROWS):
            offs = (r0 + rows)[:, None] * K + cols[None, :]
            mask = (r0 + rows < n_left)[:, None]
            p = _adam_rows(p_ptr, g_ptr, m_ptr, v_ptr, gs_ptr, base + offs, mask, w1, beta2, w2, eps, decay,
                           step_size, bc2, SCALED)
            amax = tl.maximum(amax, _abs_nan0(p))  # masked rows are 0: the amax is the block's
        scale, inv = _scale_from_amax(tl.max(tl.max(amax, axis=1), axis=0), POW2)
        tl.debug_barrier()  # every thread's stores of the new block made visible to the reads below
        for r0 in range(0, 128, ROWS):
            offs = (r0 + rows)[:, None] * K + cols[None, :]
            mask = (r0 + rows < n_left)[:, None]
            p = tl.load(p_ptr + base + offs, mask=mask, other=0.0)
            tl.store(q_ptr + base + offs, _to_fp8(p, scale, inv, POW2), mask=mask)
    tl.store(s_at, scale)
    if TRANS:  # as the quantization kernel: the block read again as [k, n], the same scale
        tl.debug_barrier()  # (the stores of other threads)
        Nb = N // 128
        base_t = pid_e * N * K + pid_k.to(tl.int64) * 128 * N + pid_n * 128
        for r0 in range(0, 128, ROWS):
            pt = tl.load(p_ptr + base + (r0 + rows)[:, None] + cols[None, :] * K)
            tl.store(qt_ptr + base_t + (r0 + rows)[:, None] * N + cols[None, :], _to_fp8(pt, scale, inv, POW2))
        tl.store(st_ptr + pid_e * Kb * Nb + pid_k * Nb + pid_n, scale)


def _check(p: Tensor, g: Tensor, m: Tensor, v: Tensor, grad_scale: Tensor | None) -> None:
    if grad_scale is not None and (grad_scale.numel() != 1 or grad_scale.dtype != torch.float32
                                   or grad_scale.device != p.device):
        raise ValueError(f"adamw_step_: grad_scale must be one float32 value on {p.device}, got "
                         f"{grad_scale.dtype} {tuple(grad_scale.shape)} on {grad_scale.device}")
    if p.dtype != torch.float32 or g.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"adamw_step_: expected p float32 and g float32|bfloat16, got {p.dtype} and {g.dtype}")
    if m.dtype != v.dtype or m.dtype not in _MOMENT_DTYPES:
        raise TypeError(f"adamw_step_: expected m and v both bfloat16 or both float32, got {m.dtype} and {v.dtype}")
    for name, t in (("p", p), ("g", g), ("m", m), ("v", v)):
        if t.shape != p.shape:
            raise ValueError(f"adamw_step_: {name} has shape {tuple(t.shape)}, expected p's {tuple(p.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"adamw_step_: {name} is not contiguous (shape {tuple(t.shape)}, "
                             f"stride {t.stride()}); the kernel updates flat buffers in place")


def adamw_step_(p: Tensor, g: Tensor, m: Tensor, v: Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, bc1: float, bc2: float, grad_scale: Tensor | None = None,
                impl: str | None = None, low: Tensor | None = None) -> None:
    """One AdamW update in place: p fp32 (contiguous), its gradient g fp32|bf16, moments m, v
    (bf16 or fp32, both alike), all of p's shape. bc1, bc2: the bias corrections 1 - beta**step;
    weight_decay 0 for parameters that do not decay. grad_scale: a float32 scalar tensor on p's
    device the update uses g * grad_scale for (g itself is not changed); None: g. low: the weight's
    BF16 copy (moefp8.weight_copy, contiguous, p's shape), written with the updated p rounded to BF16."""
    _check(p, g, m, v, grad_scale)
    if low is not None and (low.dtype != torch.bfloat16 or low.shape != p.shape or not low.is_contiguous()):
        raise ValueError(f"adamw_step_: low must be a contiguous bfloat16 tensor of p's shape {tuple(p.shape)}, "
                         f"got {low.dtype} {tuple(low.shape)} (contiguous: {low.is_contiguous()})")
    if not use_triton(p, impl):
        adamw_step_ref(p, g, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                       bc1=bc1, bc2=bc2, grad_scale=grad_scale)
        if low is not None:
            low.copy_(p)
        return
    n = p.numel()
    if n:  # scalars as fp32 arguments, not constexprs: a new lr does not recompile
        _adamw_kernel[(triton.cdiv(n, BLOCK),)](
            p, g, m, v, grad_scale if grad_scale is not None else p, low if low is not None else p, n, 1 - beta1,
            beta2, 1 - beta2, eps, 1 - lr * weight_decay, -lr / bc1, bc2, SCALED=grad_scale is not None,
            LOW=low is not None, BLOCK=BLOCK,
            num_warps=NUM_WARPS, enable_fp_fusion=False)  # the FMAs are `_adam`'s own (module docstring)
    for t in (p, m, v, *((low,) if low is not None else ())):  # Triton's stores are invisible to autograd
        increment_version(t)


def _check_copy(p: Tensor, w8: Fp8Tensor, w8t: Fp8Tensor | None) -> None:
    if p.dim() not in (2, 3) or p.shape[-1] % TILE:
        raise ValueError(f"adamw_quant_step_: p must be [N, K] or [E, N, K] with K % {TILE} == 0, got {tuple(p.shape)}")
    N, K = p.shape[-2:]
    lead = tuple(p.shape[:-2])
    want = [("w8", w8, (*lead, N, K), (*lead, -(-N // TILE), K // TILE))]
    if w8t is not None:
        if N % TILE:
            raise ValueError(f"adamw_quant_step_: a transposed copy needs N % {TILE} == 0, got N={N}")
        want.append(("w8t", w8t, (*lead, K, N), (*lead, K // TILE, N // TILE)))
    for name, c, shape, sshape in want:
        if (c.layout != "128x128" or c.data.dtype != FP8_DTYPE or tuple(c.data.shape) != shape
                or c.scale.dtype != torch.float32 or tuple(c.scale.shape) != sshape
                or not (c.data.is_contiguous() and c.scale.is_contiguous())):
            raise ValueError(f"adamw_quant_step_: {name} must be a contiguous \"128x128\" FP8 copy with data {shape} "
                             f"and fp32 scales {sshape}, got {c.layout} {c.data.dtype} {tuple(c.data.shape)}, "
                             f"scales {c.scale.dtype} {tuple(c.scale.shape)}")


def adamw_quant_step_(p: Tensor, g: Tensor, m: Tensor, v: Tensor, w8: Fp8Tensor, w8t: Fp8Tensor | None, *,
                      scale_fmt: str, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                      bc1: float, bc2: float, grad_scale: Tensor | None = None, impl: str | None = None,
                      launch: dict | None = None) -> None:
    """`adamw_step_` on a weight p [N, K] or [E, N, K] (K % 128 == 0), and its FP8 copy refreshed
    in the same pass: w8 (and w8t, where given) get what `quant.quant_weight(p, scale_fmt,
    transposed=w8t is not None)` of the updated p returns, written into their buffers
    (moefp8.weight_copy: the GEMMs' persistent copies). On the GPU the copy is made from the
    values just stored, instead of a second pass over the masters. launch: replaces QUANT_LAUNCH."""
    _check(p, g, m, v, grad_scale)
    _check_copy(p, w8, w8t)
    pow2 = check_scale_fmt(scale_fmt)
    if not use_triton(p, impl):
        adamw_step_ref(p, g, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, bc1=bc1,
                       bc2=bc2, grad_scale=grad_scale)
        q8 = quant_weight_ref(p, scale_fmt)
        for dst, src in ((w8, q8), (w8t, transpose_weight_ref(q8) if w8t is not None else None)):
            if dst is not None:
                dst.data.copy_(src.data)
                dst.scale.copy_(src.scale)
        return
    N, K = p.shape[-2:]
    E = p.shape[0] if p.dim() == 3 else 1
    if p.numel():
        t = w8t if w8t is not None else w8
        _adamw_quant_kernel[(K // TILE, triton.cdiv(N, TILE), E)](
            p, g, m, v, grad_scale if grad_scale is not None else p, w8.data, w8.scale, t.data, t.scale, N, K,
            1 - beta1, beta2, 1 - beta2, eps, 1 - lr * weight_decay, -lr / bc1, bc2, SCALED=grad_scale is not None,
            POW2=pow2, TRANS=w8t is not None, enable_fp_fusion=False, **(launch or QUANT_LAUNCH))
    _bump_versions(p, m, v, w8, w8t)


def _bump_versions(p: Tensor, m: Tensor, v: Tensor, w8: Fp8Tensor, w8t: Fp8Tensor | None) -> None:
    """Triton's stores are invisible to autograd: the version counters of what a quantizing update wrote."""
    for x in (p, m, v, w8.data, w8.scale, *((w8t.data, w8t.scale) if w8t is not None else ())):
        increment_version(x)


def adamw_quant_multi_step_(ps: list, gs: list, ms: list, vs: list, copies: list, *, scale_fmt: str, lr: float,
                            beta1: float, beta2: float, eps: float, weight_decay: float, bc1: float, bc2: float,
                            grad_scale: Tensor | None = None, impl: str | None = None,
                            launch: dict | None = None) -> None:
    """`adamw_quant_step_` on several weights of one shape [N, K] (2-D, each its own tensors: p, g, m,
    v and a (w8, w8t) copy pair), the same results bit for bit, in one launch on the GPU (a table of
    their addresses): the small weights' own launches are single waves of latency-bound programs."""
    if not (len(ps) == len(gs) == len(ms) == len(vs) == len(copies)) or not ps:
        raise ValueError(f"adamw_quant_multi_step_: expected equally many p, g, m, v and copies (at least one), "
                         f"got {len(ps)}, {len(gs)}, {len(ms)}, {len(vs)}, {len(copies)}")
    p0, g0, m0 = ps[0], gs[0], ms[0]
    trans = copies[0][1] is not None
    for p, g, m, v, (w8, w8t) in zip(ps, gs, ms, vs, copies):
        _check(p, g, m, v, grad_scale)
        _check_copy(p, w8, w8t)
        if (p.dim() != 2 or p.shape != p0.shape or g.dtype != g0.dtype or m.dtype != m0.dtype
                or (w8t is not None) != trans):
            raise ValueError(f"adamw_quant_multi_step_: every weight must be 2-D of one shape with the same "
                             f"gradient and moment dtypes and copies, got {tuple(p.shape)} {g.dtype} {m.dtype} "
                             f"(transposed copy: {w8t is not None}) beside {tuple(p0.shape)} {g0.dtype} {m0.dtype} "
                             f"({trans})")
    hp = dict(scale_fmt=scale_fmt, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, bc1=bc1,
              bc2=bc2, grad_scale=grad_scale)
    rows = [(p, g, m, v, w8.data, w8.scale, *((w8t.data, w8t.scale) if trans else (w8.data, w8.scale)))
            for p, g, m, v, (w8, w8t) in zip(ps, gs, ms, vs, copies)]
    # a launch each: on CPU, for one weight, and where a tensor is not 16-byte aligned (a gradient viewed
    # in a bucket, say: the table's addresses are promised aligned to the kernel, a launch's own are checked)
    if not use_triton(p0, impl) or len(ps) == 1 or any(t.data_ptr() % 16 for r in rows for t in r):
        for p, g, m, v, (w8, w8t) in zip(ps, gs, ms, vs, copies):
            adamw_quant_step_(p, g, m, v, w8, w8t, impl=impl, launch=launch, **hp)
        return
    pow2 = check_scale_fmt(scale_fmt)
    tab = torch.tensor([t.data_ptr() for r in rows for t in r], dtype=torch.int64, pin_memory=p0.is_cuda)
    tab = tab.to(p0.device, non_blocking=True)  # pinned: no wait for the stream
    N, K = p0.shape
    dt = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}
    _adamw_quant_multi_kernel[(K // TILE, triton.cdiv(N, TILE), len(ps))](
        tab, grad_scale if grad_scale is not None else p0, N, K, 1 - beta1, beta2, 1 - beta2, eps,
        1 - lr * weight_decay, -lr / bc1, bc2, G_DTYPE=dt[g0.dtype], M_DTYPE=dt[m0.dtype],
        SCALED=grad_scale is not None, POW2=pow2, TRANS=trans, enable_fp_fusion=False, **(launch or QUANT_LAUNCH))
    for p, m, v, (w8, w8t) in zip(ps, ms, vs, copies):
        _bump_versions(p, m, v, w8, w8t)


@torch.no_grad()
def adamw_step_ref(p: Tensor, g: Tensor, m: Tensor, v: Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
                   weight_decay: float, bc1: float, bc2: float, grad_scale: Tensor | None = None) -> None:
    """AdamW.step's former body, in its order of operations."""
    g32 = g.float() if grad_scale is None else g.float() * grad_scale
    m32 = m.float().lerp(g32, 1 - beta1)  # out of place: .float() of an fp32 moment is the moment itself
    v32 = v.float().mul(beta2).addcmul_(g32, g32, value=1 - beta2)
    m.copy_(m32)
    v.copy_(v32)
    if weight_decay:
        p.mul_(1 - lr * weight_decay)
    p.addcdiv_(m32, v32.div_(bc2).sqrt_().add_(eps), value=-lr / bc1)
