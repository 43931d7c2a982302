"""Fused RoPE: the reference against a float64 complex rotation, the Triton kernel (interpreter on
CPU, compiled on GPU) against the reference, forward and backward, on strided q/k views."""

import pytest
import torch

from moefp8.kernels import rope as R
from moefp8.testing import assert_fp8_equal


def qkv(B, S, nh, hd, dtype, seed=0, device="cpu"):
    """The attention projection's output [B, S, 3, nh, hd]: q, k are strided slices of it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, 3, nh, hd, generator=g) * 3
    x[0, 0] = 0  # a zero position
    return x.to(dtype).to(device)


def rotate_f64(x_BSnd, S, hd, theta=10000.0):
    """Independent: pairs as complex numbers times exp(i * s * theta^(-2i/hd)), float64."""
    inv = theta ** -(torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(S, dtype=torch.float64)[:, None] * inv[None, :]
    z = torch.view_as_complex(x_BSnd.double().unflatten(-1, (-1, 2)).contiguous())  # [B, S, nh, hd/2]
    z = z * torch.polar(torch.ones_like(ang), ang)[None, :, None, :]
    return torch.view_as_real(z).flatten(-2).transpose(1, 2)  # [B, nh, S, hd]


def test_ref_matches_float64_rotation():
    B, S, nh, hd = 2, 50, 3, 64
    x = qkv(B, S, nh, hd, torch.float32)[:, :, 0]
    cos, sin = R.rope_tables(S, hd, 10000.0)
    got = R.rope_ref(x, cos, sin)
    assert got.shape == (B, nh, S, hd) and got.is_contiguous()
    # fp32 angles (s * inv in fp32, then cos/sin) and two fp32 products: ~S * 2**-24 relative error in the angle
    assert torch.allclose(got.double(), rotate_f64(x, S, hd), rtol=0, atol=1e-5 * float(x.abs().max()))


def check_vs_ref(device, dtype, exact):
    B, S, nh, hd = 2, 70, 3, 64  # S not a multiple of the kernel's 32-position block
    x_all = qkv(B, S, nh, hd, dtype, seed=S, device=device)
    cos, sin = R.rope_tables(S, hd, 10000.0, device)
    for which in (0, 1):  # q and k: strided slices of the qkv output
        x1 = x_all[:, :, which].detach().requires_grad_()
        x2 = x_all[:, :, which].detach().requires_grad_()
        y1, y2 = R.rope(x1, cos, sin, impl="triton"), R.rope_ref(x2, cos, sin)
        # heads-last memory ([B, S, nh, hd] buffer), so SDPA's output comes back in it and the attention's
        # o.transpose(1, 2).reshape(B, S, -1) is a view, not a copy
        assert y1.shape == (B, nh, S, hd) and y1.transpose(1, 2).is_contiguous() and y1.dtype == dtype
        dy = torch.randn(y2.shape, generator=torch.Generator().manual_seed(which)).to(dtype).to(device)
        if which:  # the gradient as SDPA gives it for heads-last q/k (heads-last too): no copy in the backward
            dy = dy.transpose(1, 2).contiguous().transpose(1, 2)
        y1.backward(dy)
        y2.backward(dy)
        assert not torch.isnan(y1).any() and not torch.isnan(x1.grad).any()
        if exact:  # the same fp32 products and sums, no FMA contraction: bit for bit
            assert torch.equal(y1, y2)
        # a bf16 store may round where the interpreter truncates: one ulp of the result (2**-7 relative
        # for bf16; fp32: the last bit); backward sums the two products in autograd's order: the same bound
        tol = 2**-7 if dtype == torch.bfloat16 else 2**-22
        for got, want in ((y1, y2), (x1.grad, x2.grad)):
            assert torch.all((got.float() - want.float()).abs() <= want.float().abs() * tol + 1e-30)


def check_qkv(device, dtype):
    """rope_qkv against rope on each slice and autograd's unbind: the same q, k, v and, bit for bit,
    the same d(qkv) (the same inverse-rotation kernel, dv copied), written in one buffer."""
    B, S, nh, hd = 2, 70, 3, 64
    cos, sin = R.rope_tables(S, hd, 10000.0, device)
    x1 = qkv(B, S, nh, hd, dtype, seed=3, device=device).requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    q1, k1, v1 = R.rope_qkv(x1, cos, sin, impl="triton")
    q2, k2, v2 = x2.unbind(2)
    q2, k2 = R.rope(q2, cos, sin, impl="triton"), R.rope(k2, cos, sin, impl="triton")
    for a, b in ((q1, q2), (k1, k2), (v1, v2)):
        assert a.shape == b.shape and torch.equal(a, b)
    assert q1.transpose(1, 2).is_contiguous() and k1.transpose(1, 2).is_contiguous()
    g = torch.Generator().manual_seed(5)
    dq, dk, dv = (torch.randn(t.shape, generator=g).to(dtype).to(device) for t in (q1, k1, v1))
    dq = dq.transpose(1, 2).contiguous().transpose(1, 2)  # heads-last, as SDPA returns it
    torch.autograd.backward((q1, k1, v1), (dq, dk, dv))
    torch.autograd.backward((q2, k2, v2), (dq, dk, dv))
    assert x1.grad.is_contiguous() and torch.equal(x1.grad, x2.grad)
    assert torch.equal(x1.grad[:, :, 2], dv)  # the v slot: dv as it came


@pytest.mark.interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_interpreter_vs_ref(dtype):
    check_vs_ref("cpu", dtype, exact=False)
    check_qkv("cpu", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_gpu_vs_ref(dtype):
    check_vs_ref("cuda", dtype, exact=True)
    check_qkv("cuda", dtype)


def _qkv_grads(B, S, nh, device, seed=0):
    """dq, dk [B, nh, S, 128] as SDPA gives them (heads-last memory), dv [B, S, nh, 128], bf16; an outlier
    head row and a zero one (the 1x128 groups' amax clamp)."""
    g = torch.Generator().manual_seed(seed)
    dq, dk, dv = (torch.randn(B, S, nh, 128, generator=g) for _ in range(3))
    dq[0, 1, 0] *= 500
    dk[0, 2, 1] = 0
    dq, dk, dv = (t.bfloat16().to(device) for t in (dq, dk, dv))
    return dq.transpose(1, 2), dk.transpose(1, 2), dv


def test_backward_quant_ref_is_the_quantized_gradient():
    """rope_qkv's backward as "1x128" FP8 (one group a head row): within half an FP8 ulp of the fp32
    gradient autograd computes through rope_ref, head rows in d(qkv)'s [B, S, 3, nh, hd] order."""
    B, S, nh = 2, 40, 3
    cos, sin = R.rope_tables(S, 128, 10000.0)
    dq, dk, dv = _qkv_grads(B, S, nh, "cpu")
    x = torch.zeros(B, S, 3, nh, 128, requires_grad=True)
    q, k, v = R.rope_qkv(x, cos, sin, impl="ref")
    torch.autograd.backward((q, k, v), (dq.float(), dk.float(), dv.float()))
    got = R.rope_qkv_backward_quant_ref(dq, dk, dv, cos, sin)
    assert got.layout == "1x128" and got.data.shape == (B * S, 3 * nh * 128) and got.scale.stride(0) == 1
    want = x.grad.reshape(B * S, -1)
    s = got.scale.repeat_interleave(128, 1)
    assert torch.all((got.dequantize() - want).abs() <= torch.maximum(want.abs() * 2**-4, s * 2**-10) + 1e-6 * s)


def test_backward_quant_ref_of_no_token():
    """A batch of no tokens (no sequence, or sequences of none): an empty [0, 3 nh hd] FP8 gradient, not an error."""
    for B, S in ((0, 8), (2, 0)):
        cos, sin = R.rope_tables(S, 128, 10000.0)
        dq, dk = (torch.zeros(B, S, 3, 128, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
        got = R.rope_qkv_backward_quant_ref(dq, dk, torch.zeros(B, S, 3, 128, dtype=torch.bfloat16), cos, sin)
        assert got.data.shape == (0, 3 * 3 * 128) and got.scale.shape == (0, 9)


def check_backward_quant(device, exact):
    B, S, nh = 2, 70, 3  # S not a multiple of the kernel's 32-position block
    cos, sin = R.rope_tables(S, 128, 10000.0, device)
    for fmt in ("pow2", "fp32"):
        dq, dk, dv = _qkv_grads(B, S, nh, device, seed=len(fmt))
        got = R.rope_qkv_backward_quant(dq, dk, dv, cos, sin, fmt, impl="triton")
        assert_fp8_equal(got, R.rope_qkv_backward_quant_ref(dq, dk, dv, cos, sin, fmt), exact=exact)


@pytest.mark.interp
def test_backward_quant_interpreter():
    check_backward_quant("cpu", exact=False)


@pytest.mark.gpu
def test_backward_quant_gpu():
    check_backward_quant("cuda", exact=True)


def test_errors():
    cos, sin = R.rope_tables(8, 64, 10000.0)
    with pytest.raises(ValueError, match="head_dim must be 128"):
        R.rope_qkv_backward_quant(*(torch.zeros(1, 2, 8, 64) for _ in range(2)), torch.zeros(1, 8, 2, 64), cos, sin)
    with pytest.raises(ValueError, match=r"rope_qkv: expected qkv \[B, S, 3, n_heads, head_dim\], got \(1, 8, 2, 2, 64\)"):
        R.rope_qkv(torch.zeros(1, 8, 2, 2, 64), cos, sin)
    with pytest.raises(ValueError, match=r"cos/sin must be \[S, head_dim/2\] = \[8, 32\], got \[8, 16\]"):
        R.rope(torch.zeros(1, 8, 2, 64), cos[:, :16], sin[:, :16])
    with pytest.raises(ValueError, match="even head_dim"):
        R.rope(torch.zeros(1, 8, 2, 63), cos, sin)
