"""Fused AdamW update (moefp8.optim.AdamW.step): Triton kernel -> public wrapper -> `_ref` twin.

One pass per parameter: read p (fp32 master), g (fp32|bf16), m and v (bf16|fp32), write p, m, v,
which replaces the reference's dozen elementwise passes. An optional gradient multiplier (a device
scalar: the clipping factor times 1/world where the gradients hold sums over the ranks) is applied
as g is read, so neither the mean nor the clipping costs a pass over the gradients of its own.
Math in fp32, in the reference's order: torch.lerp for m, addcmul for v, the moments stored rounded
but the update made from the fp32 values, then decay and addcdiv with IEEE division and sqrt. FMA
contraction stays on (as in torch's CUDA kernels), so the kernel and the reference agree to a few
fp32 ulp, not bit for bit.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.graph import increment_version

from moefp8.kernels import use_triton

_MOMENT_DTYPES = (torch.bfloat16, torch.float32)
# 8 elements per thread: 128-bit loads and stores, two per fp32 tensor and one per bf16 one, when
# numel % 16 == 0 (Triton specializes on it; all tensors of the small model) and scalar ones
# otherwise. Not tuned on a GPU: the kernel is bandwidth-bound at any sane setting.
BLOCK, NUM_WARPS = 1024, 4


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, gs_ptr, n, w1, beta2, w2, eps, decay, step_size, bc2,
                  SCALED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    if SCALED:
        g = g * tl.load(gs_ptr)
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
    m = m + w1 * (g - m)  # torch.lerp's formula for w1 < 0.5 (beyond, g - (g - m) * (1 - w1): an ulp apart)
    v = v * beta2 + w2 * g * g
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
    denom = tl.sqrt_rn(tl.math.div_rn(v, bc2)) + eps
    tl.store(p_ptr + offs, p * decay + step_size * tl.math.div_rn(m, denom), mask=mask)


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
                impl: str | None = None) -> None:
    """One AdamW update in place: p fp32 (contiguous), its gradient g fp32|bf16, moments m, v
    (bf16 or fp32, both alike), all of p's shape. bc1, bc2: the bias corrections 1 - beta**step;
    weight_decay 0 for parameters that do not decay. grad_scale: a float32 scalar tensor on p's
    device the update uses g * grad_scale for (g itself is not changed); None: g."""
    _check(p, g, m, v, grad_scale)
    if not use_triton(p, impl):
        return adamw_step_ref(p, g, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                              bc1=bc1, bc2=bc2, grad_scale=grad_scale)
    n = p.numel()
    if n:  # scalars as fp32 arguments, not constexprs: a new lr does not recompile
        _adamw_kernel[(triton.cdiv(n, BLOCK),)](
            p, g, m, v, grad_scale if grad_scale is not None else p, n, 1 - beta1, beta2, 1 - beta2, eps,
            1 - lr * weight_decay, -lr / bc1, bc2, SCALED=grad_scale is not None, BLOCK=BLOCK,
            num_warps=NUM_WARPS, enable_fp_fusion=True)  # FMAs as torch's CUDA kernels; off by default in Triton 3.10
    for t in (p, m, v):  # Triton's stores are invisible to autograd; WeightCache keys on p's version
        increment_version(t)


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
