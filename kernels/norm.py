"""RMSNorm, and the residual add before it, in one pass each way: Triton kernels -> wrappers ->
autograd Functions -> `_ref` twins.

    rms_norm(x_TH, w, eps) -> y_TH                   y = x * rsqrt(mean(x^2) + eps) * w
    rms_norm_split(x_TH, w, eps) -> (y_TH, x_TH)     the same, x passed through for a second consumer
                                                       whose gradient the backward adds in its pass
    add_rms_norm(x_TH, a_TH, w, eps) -> (h_TH, y_TH)   h = x + a (BF16, the bits of torch's add),
                                                       y = rms_norm(h)

BF16 rows in and out, math in fp32, w the fp32 master read rounded to BF16 (as the model's
`weight.to(bf16)`). The backward is one pass over the rows: dx = J^T dy (+ dh, the residual's
gradient, where the add was fused: autograd's add of the two gradients of h is that pass too) and
per-program fp32 partial sums of dw, then one sum over the programs (dw in fp32, no BF16 rounding).

Why: torch's fused RMSNorm takes one pass forward and three backward (grad input, then the weight
grad's two-stage reduction), and the residual add is one more kernel each way (read two, write one):
in the 3B step 9.7 ms of norms and ~5 ms of residual adds per step, each kernel above its
bandwidth floor. On by default (`model.fused_norm`): the 3B step FP8 +2.1%, BF16 +1.2% (one H200,
bench/notes/scale.md, session 55).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.nn import functional as F

from moefp8.fp8 import FP8_DTYPE, TILE, Fp8Tensor, check_scale_fmt
from moefp8.kernels import num_sms, use_triton
from moefp8.kernels.quant import _abs_nan0, _scale_from_amax, _scales, _to_fp8, quant_rowwise_ref


# Launch configs: rows per tile and warps (forward); rows per tile, warps and programs per SM of the
# backward's grid-stride loop, whose programs each write one fp32 partial row of dw. The defaults are the
# configs of session 54's first GPU timing (a row per program forward, ~4 programs per SM backward): 0.70-0.78
# of the copy bandwidth at H = 7168 (1.6x torch), 0.42-0.51 at H = 2048 (0.85-1.04x torch). The backward there is
# bound by latency, not bandwidth: each program walks its rows one load-reduce-store at a time, and registers
# (~7 fp32 values an element: 62-127 a thread at H = 2048, 230 at 8192, ptxas for sm_90) cap an SM at ~4 rows in
# flight. `tools/bench_norm.py --sweep` times the alternatives: tiles of 1-4 rows, 4-8 warps, 4-16 programs per
# SM, and the split backward (SPLIT: dx with the residual's dh, then dw by column blocks, as torch does).
# Its first GPU run (session 55, one H200, 32768 x 2048) kept these defaults: forward + backward 0.299 ms,
# 0.85 of the copy bandwidth, 1.72x torch's add + norm (bench/results/norm-NVIDIA-H200-sweep.json).
def launch_for(H: int) -> dict:
    warps = 4 if triton.next_power_of_2(H) <= 4096 else 8
    return {"fwd": dict(BLOCK_T=1, num_warps=warps), "bwd": dict(BLOCK_T=1, num_warps=warps, PROGS_PER_SM=4)}


@triton.jit
def _normed(x, w_ptr, offs, H, eps):
    """Rows x [BLOCK_T, BLOCK_H] fp32 (0 past H) -> (the norm in BF16, r = rsqrt(mean(x^2) + eps) fp32), w the
    fp32 master read rounded to BF16: both forward kernels' expression, bf16((x r) w). (Their r may still differ
    by one fp32 step: the compiler lays each kernel's rows out its own way, so the sum of squares runs in
    another order; H 2048 on an H200: 16 against 8 values a thread, ~1 row in 8 one step apart.)"""
    w = tl.load(w_ptr + offs, mask=offs < H, other=0.0).to(tl.bfloat16).to(tl.float32)
    r = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / H + eps)
    return (x * r[:, None] * w[None, :]).to(tl.bfloat16), r


@triton.jit
def _rms_fwd_kernel(x_ptr, a_ptr, w_ptr, h_ptr, y_ptr, r_ptr, T, H, stride_x, stride_a, stride_h, stride_y, eps,
                    ADD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """BLOCK_T rows per program. ADD: h = bf16(x + a) stored, the norm of h."""
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs = tl.arange(0, BLOCK_H)
    m = (offs_t < T)[:, None] & (offs < H)[None, :]
    x = tl.load(x_ptr + offs_t[:, None] * stride_x + offs[None, :], mask=m, other=0.0).to(tl.float32)
    if ADD:
        a = tl.load(a_ptr + offs_t[:, None] * stride_a + offs[None, :], mask=m, other=0.0).to(tl.float32)
        hb = (x + a).to(tl.bfloat16)
        tl.store(h_ptr + offs_t[:, None] * stride_h + offs[None, :], hb, mask=m)
        x = hb.to(tl.float32)
    y, r = _normed(x, w_ptr, offs, H, eps)
    tl.store(y_ptr + offs_t[:, None] * stride_y + offs[None, :], y, mask=m)
    tl.store(r_ptr + offs_t, r, mask=offs_t < T)


@triton.jit
def _rms_quant_fwd_kernel(x_ptr, w_ptr, q_ptr, s_ptr, r_ptr, T, H, stride_x, stride_q, stride_st, stride_sg, eps,
                          POW2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """`_rms_fwd_kernel`'s y (`_normed`: its expression) quantized "1x128" in registers
    as `quant_rowwise` quantizes BF16 rows (kernels/quant.py's helpers): codes and one scale per row and
    128 columns; the BF16 y is never written. H % 128 == 0."""
    G: tl.constexpr = BLOCK_H // 128
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs = tl.arange(0, BLOCK_H)
    m = (offs_t < T)[:, None] & (offs < H)[None, :]
    x = tl.load(x_ptr + offs_t[:, None] * stride_x + offs[None, :], mask=m, other=0.0).to(tl.float32)
    y, r = _normed(x, w_ptr, offs, H, eps)
    y3 = tl.reshape(y.to(tl.float32), (BLOCK_T, G, 128))  # (columns past H: 0)
    amax = tl.max(_abs_nan0(y3), axis=2)
    scale, inv = _scale_from_amax(amax, POW2)
    q = tl.reshape(_to_fp8(y3, scale[:, :, None], inv[:, :, None], POW2), (BLOCK_T, BLOCK_H))
    tl.store(q_ptr + offs_t[:, None] * stride_q + offs[None, :], q, mask=m)
    offs_g = tl.arange(0, G)
    tl.store(s_ptr + offs_t[:, None] * stride_st + offs_g[None, :] * stride_sg, scale,
             mask=(offs_t < T)[:, None] & (offs_g * 128 < H)[None, :])
    tl.store(r_ptr + offs_t, r, mask=offs_t < T)


@triton.jit
def _rms_bwd_kernel(h_ptr, dy_ptr, dh_ptr, w_ptr, r_ptr, dx_ptr, dw_ptr, T, H, stride_h, stride_dy, stride_dh,
                    stride_dx, ADD: tl.constexpr, DW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """Tiles of BLOCK_T rows, grid-stride over the programs: dx = (w dy - xhat mean(xhat w dy)) r (+ dh);
    DW: each program writes its partial sum of dy xhat (dw) as one fp32 row (else `_rms_dw_kernel` sums it)."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK_H)
    mh = offs < H
    w = tl.load(w_ptr + offs, mask=mh, other=0.0).to(tl.bfloat16).to(tl.float32)
    dw = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for t0 in range(pid * BLOCK_T, T, tl.num_programs(0) * BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        mt = offs_t < T
        m = mt[:, None] & mh[None, :]
        x = tl.load(h_ptr + offs_t[:, None] * stride_h + offs[None, :], mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs_t[:, None] * stride_dy + offs[None, :], mask=m, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + offs_t, mask=mt, other=0.0)  # (rows past T: x, dy = 0, their terms 0)
        xh = x * r[:, None]
        wdy = dy * w[None, :]
        dx = (wdy - xh * (tl.sum(xh * wdy, axis=1) / H)[:, None]) * r[:, None]
        if ADD:
            dx += tl.load(dh_ptr + offs_t[:, None] * stride_dh + offs[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs_t[:, None] * stride_dx + offs[None, :], dx.to(tl.bfloat16), mask=m)
        if DW:
            dw += dy * xh
    if DW:
        tl.store(dw_ptr + pid * H + offs, tl.sum(dw, axis=0), mask=mh)


@triton.jit
def _rms_dw_kernel(h_ptr, dy_ptr, r_ptr, dw_ptr, T, H, stride_h, stride_dy, ROWS, BLOCK_R: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    """The split backward's weight gradient: grid (column blocks, row chunks of ROWS); each program sums
    dy xhat over its chunk's rows, BLOCK_R at a time, into one fp32 partial row segment."""
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    pr = tl.program_id(1)
    mc = offs_c < H
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    end = tl.minimum(pr * ROWS + ROWS, T)
    for r0 in range(pr * ROWS, end, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
        mr = offs_r < end
        m = mr[:, None] & mc[None, :]
        x = tl.load(h_ptr + offs_r[:, None] * stride_h + offs_c[None, :], mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs_r[:, None] * stride_dy + offs_c[None, :], mask=m, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + offs_r, mask=mr, other=0.0)
        acc += dy * (x * r[:, None])
    tl.store(dw_ptr + pr * H + offs_c, tl.sum(acc, axis=0), mask=mc)


def _check(name: str, w: Tensor, *rows: Tensor) -> None:
    x = rows[0]
    for t in rows:
        if t.dim() != 2 or t.dtype != torch.bfloat16 or t.shape != x.shape or (t.numel() and t.stride(1) != 1):
            raise ValueError(f"{name}: expected bf16 [T, H] rows of one shape with unit column stride, got "
                             f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")
    if w.shape != (x.shape[1],):
        raise ValueError(f"{name}: w has shape {tuple(w.shape)}, expected [{x.shape[1]}]")


def rms_norm_fwd(x_TH: Tensor, w: Tensor, eps: float, a_TH: Tensor | None = None, *,
                 launch: dict | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The forward kernel: -> (h [T, H] bf16 = x + a, or x itself without a; y [T, H] bf16; r [T] fp32
    the rows' rsqrt(mean(h^2) + eps), which the backward reads). launch: `launch_for(H)["fwd"]`'s keys."""
    _check("rms_norm", w, x_TH, *([a_TH] if a_TH is not None else []))
    T, H = x_TH.shape
    y = torch.empty_like(x_TH)
    h = torch.empty_like(x_TH) if a_TH is not None else x_TH
    r = torch.empty(T, dtype=torch.float32, device=x_TH.device)
    if T and H:
        cfg = launch or launch_for(H)["fwd"]
        a = a_TH if a_TH is not None else x_TH
        _rms_fwd_kernel[(triton.cdiv(T, cfg["BLOCK_T"]),)](
            x_TH, a, w, h, y, r, T, H, x_TH.stride(0), a.stride(0), h.stride(0), y.stride(0), eps,
            ADD=a_TH is not None, BLOCK_H=triton.next_power_of_2(H), **cfg)
    return h, y, r


def rms_norm_quant_fwd(x_TH: Tensor, w: Tensor, eps: float, scale_fmt: str = "pow2", *,
                       launch: dict | None = None) -> tuple[Fp8Tensor, Tensor]:
    """RMSNorm quantized for an FP8 GEMM in one pass: -> (`quant_rowwise(bf16((x r) w), colmajor_scale=True)`
    bit for bit, "1x128" [T, H] with column-major scales; r [T] fp32 for `rms_norm_bwd`, within one fp32 step of
    `rms_norm_fwd`'s: the sum of squares in the compiler's order, see `_normed`). H % 128 == 0.
    launch: `launch_for(H)["fwd"]`'s keys."""
    _check("rms_norm_quant", w, x_TH)
    pow2 = check_scale_fmt(scale_fmt)
    T, H = x_TH.shape
    if H % TILE:
        raise ValueError(f"rms_norm_quant: H={H} must be a multiple of {TILE}")
    q = torch.empty(T, H, dtype=FP8_DTYPE, device=x_TH.device)
    s = _scales(T, H // TILE, x_TH.device, True)
    r = torch.empty(T, dtype=torch.float32, device=x_TH.device)
    if T:
        cfg = launch or launch_for(H)["fwd"]
        _rms_quant_fwd_kernel[(triton.cdiv(T, cfg["BLOCK_T"]),)](
            x_TH, w, q, s, r, T, H, x_TH.stride(0), q.stride(0), s.stride(0), s.stride(1), eps, POW2=pow2,
            BLOCK_H=triton.next_power_of_2(H), **cfg)
    return Fp8Tensor(q, s, "1x128"), r


def rms_norm_quant_ref(x_TH: Tensor, w: Tensor, eps: float, scale_fmt: str = "pow2") -> tuple[Fp8Tensor, Tensor]:
    """`rms_norm_quant_fwd`'s twin: the reference norm, quantized by the reference."""
    r = torch.rsqrt(x_TH.float().pow(2).mean(-1) + eps)
    return quant_rowwise_ref(rms_norm_ref(x_TH, w, eps), scale_fmt, colmajor_scale=True), r


def rms_norm_bwd(h_TH: Tensor, dy_TH: Tensor, w: Tensor, r_T: Tensor, dh_TH: Tensor | None = None, *,
                 launch: dict | None = None) -> tuple[Tensor, Tensor]:
    """The backward kernels: -> (dx [T, H] bf16 = J^T dy (+ dh), dw [H] fp32). launch: `launch_for(H)["bwd"]`'s
    keys: one pass (BLOCK_T, num_warps, PROGS_PER_SM: dx and dw's partial sums together), or with SPLIT
    true two kernels, as torch's (dx: BLOCK_T rows a program, num_warps; dw by column blocks: DW_BLOCK_R rows
    of DW_BLOCK_C columns at a time over chunks of DW_ROWS rows, DW_WARPS): more loads in flight, two more
    passes over h and dy."""
    T, H = h_TH.shape
    dy_TH = dy_TH if dy_TH.stride(1) == 1 else dy_TH.contiguous()
    if dh_TH is not None and dh_TH.stride(1) != 1:
        dh_TH = dh_TH.contiguous()
    dx = torch.empty_like(h_TH)
    cfg = dict(launch or launch_for(H)["bwd"])
    split = cfg.pop("SPLIT", False)
    dw_cfg = {k: cfg.pop(k) for k in ("DW_BLOCK_R", "DW_BLOCK_C", "DW_ROWS", "DW_WARPS") if k in cfg}
    per_sm = cfg.pop("PROGS_PER_SM", 4)
    tiles = triton.cdiv(T, cfg["BLOCK_T"])
    progs = tiles if split else min(tiles, per_sm * num_sms(h_TH.device))
    chunks = triton.cdiv(T, dw_cfg["DW_ROWS"]) if split else progs
    part = torch.empty(chunks, H, dtype=torch.float32, device=h_TH.device)
    if T and H:
        dh = dh_TH if dh_TH is not None else dy_TH
        _rms_bwd_kernel[(progs,)](h_TH, dy_TH, dh, w, r_T, dx, part, T, H, h_TH.stride(0), dy_TH.stride(0),
                                  dh.stride(0), dx.stride(0), ADD=dh_TH is not None, DW=not split,
                                  BLOCK_H=triton.next_power_of_2(H), **cfg)
        if split:
            _rms_dw_kernel[(triton.cdiv(H, dw_cfg["DW_BLOCK_C"]), chunks)](
                h_TH, dy_TH, r_T, part, T, H, h_TH.stride(0), dy_TH.stride(0), dw_cfg["DW_ROWS"],
                BLOCK_R=dw_cfg["DW_BLOCK_R"], BLOCK_C=dw_cfg["DW_BLOCK_C"], num_warps=dw_cfg["DW_WARPS"])
    return dx, part.sum(0)


class RMSNormSplitFunction(torch.autograd.Function):
    """apply(x [T, H] bf16, w [H] fp32, eps) -> (y = rms_norm(x), x itself (a view)) by the kernels: where x
    has a second consumer (each block's input: its attention's norm and the residual add), that consumer
    takes the view, and the backward adds its gradient into dx in its pass (dx = dx' + J^T dy), not
    autograd in a pass of its own. `rms_norm` is this function with the pass-through unused."""

    @staticmethod
    def forward(ctx, x, w, eps):
        _, y, r = rms_norm_fwd(x, w, eps)
        ctx.save_for_backward(x, w, r)
        return y, x.view_as(x)

    @staticmethod
    def backward(ctx, dy, dx_res):
        x, w, r = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(x)
        dx, dw = rms_norm_bwd(x, dy, w, r, dx_res)
        return dx, dw.to(w.dtype), None


class AddRMSNormFunction(torch.autograd.Function):
    """apply(x, a [T, H] bf16, w [H] fp32, eps) -> (h = x + a, y = rms_norm(h)) by the kernels; the
    backward adds h's own gradient (the residual's) into dx in its pass: dx = da = dh + J^T dy."""

    @staticmethod
    def forward(ctx, x, a, w, eps):
        h, y, r = rms_norm_fwd(x, w, eps, a)
        ctx.save_for_backward(h, w, r)
        return h, y

    @staticmethod
    def backward(ctx, dh, dy):
        h, w, r = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(h)
        dx, dw = rms_norm_bwd(h, dy, w, r, dh)
        return dx, dx, dw.to(w.dtype), None


def rms_norm(x: Tensor, w: Tensor, eps: float, impl: str | None = None) -> Tensor:
    """x [..., H] bf16 -> RMSNorm(x) * w in BF16 (w fp32, read as BF16). CUDA: the kernels; CPU: the reference."""
    if not use_triton(x, impl):
        return rms_norm_ref(x, w, eps)
    return rms_norm_split(x, w, eps, impl)[0]  # (the pass-through unused: no gradient to add)


def rms_norm_split(x: Tensor, w: Tensor, eps: float, impl: str | None = None) -> tuple[Tensor, Tensor]:
    """x [..., H] bf16 -> (RMSNorm(x) * w, x for its other consumer): on CUDA the gradient that consumer
    gives x is added in the norm's backward pass (`RMSNormSplitFunction`); CPU: (the reference, x)."""
    if not use_triton(x, impl):
        return rms_norm_ref(x, w, eps), x
    y, xr = RMSNormSplitFunction.apply(x.reshape(-1, x.shape[-1]), w, eps)
    return y.view(x.shape), xr.view(x.shape)


def add_rms_norm(x: Tensor, a: Tensor, w: Tensor, eps: float, impl: str | None = None) -> tuple[Tensor, Tensor]:
    """x, a [..., H] bf16 -> (h = x + a, rms_norm(h, w)), one pass each way on CUDA."""
    if not use_triton(x, impl):
        return add_rms_norm_ref(x, a, w, eps)
    H = x.shape[-1]
    h, y = AddRMSNormFunction.apply(x.reshape(-1, H), a.reshape(-1, H), w, eps)
    return h.view(x.shape), y.view(x.shape)


def rms_norm_ref(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """The model's unfused norm: torch's `F.rms_norm` on a BF16 copy of the weight (fp32 math)."""
    return F.rms_norm(x, (x.shape[-1],), w.to(x.dtype), eps)


def add_rms_norm_ref(x: Tensor, a: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    h = x + a
    return h, rms_norm_ref(h, w, eps)
