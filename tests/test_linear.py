"""Fp8Linear: output and gradients against BF16 autograd.

Tolerance: each FP8 GEMM sees two E4M3 operands (3 mantissa bits, relative rounding error up to
2**-4, ~2.5% rms within a tile once the tile's amax sets the scale); measured on these random
Gaussian shapes the FP8 result is 3.6-3.8% (rel. Frobenius) from the fp64 product of the BF16
operands, for y, dx and dw alike; a BF16 nn.Linear is 0.17% from it. Bound: 0.07 per GEMM output (y, dx, dw), as the issue asks."""

import pytest
import torch

from moefp8.linear import Fp8Linear
from moefp8.testing import rel_err

TOL = 0.07


def _grads(lin_fn, x, w, dy):
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    y = lin_fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _ref64(x, w, dy):
    return _grads(lambda x, w: x @ w.t(), x.double(), w.double(), dy.double())


@pytest.mark.parametrize("M,K,N", [(64, 256, 128), (200, 128, 384)])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_vs_bf16(M, K, N, wdtype, device="cpu"):
    torch.manual_seed(M + K + N)
    lin = Fp8Linear(K, N, dtype=wdtype, device=device)
    x = torch.randn(2, M // 2, K, device=device).bfloat16()
    dy = torch.randn(2, M // 2, N, device=device).bfloat16()
    x_in = x.detach().clone().requires_grad_(True)
    y = lin(x_in)
    y.backward(dy)
    dx, dw = x_in.grad, lin.weight.grad
    assert y.dtype == torch.bfloat16 and y.shape == (2, M // 2, N)
    assert dx.dtype == torch.bfloat16 and dw.dtype == wdtype
    w_ref = lin.weight.detach().to(torch.bfloat16)
    y_b, dx_b, dw_b = _grads(lambda x, w: torch.nn.functional.linear(x, w), x, w_ref, dy)
    y_e, dx_e, dw_e = _ref64(x, w_ref, dy)
    y = y.detach()
    for got, bf, exact in ((y, y_b, y_e), (dx, dx_b, dx_e), (dw, dw_b, dw_e)):
        assert rel_err(bf, exact) < 0.01  # sanity of the reference itself
        assert rel_err(got, exact) < TOL
        assert rel_err(got, bf) < TOL


def test_fp8_linear_main_grad_accumulates():
    torch.manual_seed(0)
    lin = Fp8Linear(128, 128)
    lin.weight.main_grad = torch.ones(128, 128)
    x, dy = torch.randn(64, 128).bfloat16(), torch.randn(64, 128).bfloat16()
    lin(x).backward(dy)
    assert lin.weight.grad is None
    expect = 1 + dy.double().t() @ x.double()
    assert rel_err(lin.weight.main_grad, expect) < TOL


def test_fp8_linear_dgrad_is_the_fp8_product(device="cpu"):
    """dX is dY's "1x128" FP8 times the weight's "128x128" FP8 (fp8_gemm_dgrad's arithmetic) bit for bit: the
    backward multiplies by the transposed copy made in the forward's weight pass (N != K: a swapped axis fails).
    A frozen input (no dX wanted) and a frozen weight (no dW) each still run."""
    from moefp8.kernels.gemm import fp8_gemm_dgrad
    from moefp8.kernels.quant import quant_rowwise, quant_weight

    torch.manual_seed(1)
    lin = Fp8Linear(256, 384, device=device)
    x = torch.randn(200, 256, device=device).bfloat16().requires_grad_(True)
    dy = torch.randn(200, 384, device=device).bfloat16()
    lin(x).backward(dy)
    want = fp8_gemm_dgrad(quant_rowwise(dy, colmajor_scale=True), quant_weight(lin.weight.detach()))
    assert x.grad.dtype == torch.bfloat16 and torch.equal(x.grad, want)
    lin.weight.grad = None
    lin(x.detach()).backward(dy)  # weight only
    assert lin.weight.grad is not None
    lin.weight.requires_grad_(False)
    x.grad = None
    lin(x).backward(dy)  # input only
    assert torch.equal(x.grad, want)


def test_fp8_qkv_rope_equals_the_linear_then_rope():
    """Fp8Linear.qkv_rope (the attention's FP8 path at head_dim 128): the forward bit for bit the
    linear then rope_qkv; the backward quantizes d(qkv) in the RoPE backward from the fp32 rotations
    where the unfused path rounds it to BF16 first, so some codes sit one FP8 step apart: dx and dW
    within 3% of the unfused path's (measured 1.4%), and no farther from float64 autograd (~3.5%,
    the FP8 recipe's own error at these sizes)."""
    from moefp8.kernels.rope import rope_qkv, rope_tables

    torch.manual_seed(0)
    B, S, nh, K = 2, 64, 2, 256
    lin = Fp8Linear(K, 3 * nh * 128)
    cos, sin = rope_tables(S, 128, 10000.0)
    x = torch.randn(B, S, K).bfloat16()
    x1, x2 = (x.clone().requires_grad_() for _ in range(2))
    out1 = lin.qkv_rope(x1, cos, sin, nh)
    out2 = rope_qkv(lin(x2).view(B, S, 3, nh, 128), cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(out1, out2))
    g = [torch.randn(t.shape).bfloat16() for t in out1]
    torch.autograd.backward(out1, g)
    dw1, lin.weight.grad = lin.weight.grad.clone(), None
    torch.autograd.backward(out2, g)
    dw2 = lin.weight.grad
    w64, x64 = lin.weight.detach().double().requires_grad_(), x.double().requires_grad_()
    y = (x64 @ w64.t()).view(B, S, 3, nh, 128)

    def rot(t):  # float64 rotation of [B, S, nh, 128] -> [B, nh, S, 128]
        t = t.transpose(1, 2).unflatten(-1, (-1, 2))
        a, b = t[..., 0], t[..., 1]
        return torch.stack((a * cos.double() - b * sin.double(), a * sin.double() + b * cos.double()), -1).flatten(-2)

    torch.autograd.backward((rot(y[:, :, 0]), rot(y[:, :, 1]), y[:, :, 2]), [t.double() for t in g])
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    assert rel(x1.grad, x2.grad) < 0.03 and rel(dw1, dw2) < 0.03
    assert rel(x1.grad, x64.grad) <= 1.02 * rel(x2.grad, x64.grad) and rel(dw1, w64.grad) <= 1.02 * rel(dw2, w64.grad)


def _norm_qkv_rope_pair(device: str, K: int = 256):
    """The fused norm + QKV + RoPE function and the unfused composition (rms_norm_split, then qkv_rope) on
    the same inputs and output gradients -> ((outputs, dx, dW, d norm weight) fused, the same unfused)."""
    from moefp8.kernels.norm import rms_norm_split
    from moefp8.kernels.rope import rope_tables
    from moefp8.linear import Fp8NormQKVRopeFunction

    torch.manual_seed(1)
    B, S, nh = 2, 64, 2
    lin = Fp8Linear(K, 3 * nh * 128, device=device)
    nw = (1 + 0.3 * torch.randn(K, device=device)).requires_grad_()
    cos, sin = rope_tables(S, 128, 10000.0, device)
    x = torch.randn(B, S, K, device=device).bfloat16()
    x[0, 3] = 0  # a zero row
    grads = None
    runs = []
    for fused in (True, False):
        xg = x.clone().requires_grad_()
        if fused:
            out = Fp8NormQKVRopeFunction.apply(xg, lin.weight, nw, 1e-6, cos, sin, nh, "pow2", lin.stats, lin.gemm)
        else:
            n, xr = rms_norm_split(xg, nw, 1e-6, impl="triton")
            out = (*lin.qkv_rope(n, cos, sin, nh), xr)
        grads = grads or [torch.randn(t.shape, device=device).bfloat16() for t in out]
        torch.autograd.backward(out, grads)
        runs.append(([t.detach() for t in out], xg.grad, lin.weight.grad, nw.grad))
        lin.weight.grad = nw.grad = None
    return runs


@pytest.mark.interp
def test_fp8_norm_qkv_rope_is_the_norm_then_qkv_rope(monkeypatch):
    """Fp8NormQKVRopeFunction (fused norms, FP8 QKV): the norm's output quantized in the norm's pass, the
    QKV's dgrad into the norm's backward with the residual's gradient: the same function as the norm
    (rms_norm_split) then qkv_rope, bit for bit. Under the interpreter the unfused path quantizes the
    norm's output with the row-wise kernel too (its CPU default is the reference, whose fp8 cast rounds
    where the interpreter's truncates); everything else is the same code on both sides."""
    import moefp8.linear as L
    from moefp8.kernels.quant import quant_rowwise, requant_colwise

    def operand(x2, fmt, colwise, kind, stats):
        q = stats.record(kind, quant_rowwise(x2, fmt, impl="triton", colmajor_scale=True))
        return q, (requant_colwise(q, fmt) if colwise else None)

    monkeypatch.setattr(L, "quant_operand", operand)
    (o1, dx1, dw1, dn1), (o2, dx2, dw2, dn2) = _norm_qkv_rope_pair("cpu")
    assert all(torch.isfinite(t).all() for t in (*o1, dx1, dw1, dn1))
    assert all(torch.equal(a, b) for a, b in zip(o1, o2))
    assert torch.equal(dx1, dx2) and torch.equal(dw1, dw2) and torch.equal(dn1, dn2)


@pytest.mark.gpu
@pytest.mark.parametrize("K", [256, 2048])
def test_gpu_fp8_norm_qkv_rope_is_the_norm_then_qkv_rope(K):
    """On a GPU the fused kernel's r may sit one fp32 step from `rms_norm_fwd`'s (kernels/norm.py `_normed`):
    a BF16 normed value one step off now and then, its FP8 code one step off more rarely. Every output and
    gradient within a BF16 step (2^-8) of the unfused path's, relative, and nearly all of the outputs the same
    bits (the fp32 gradients' sums pick up any difference in their last bits)."""
    (o1, dx1, dw1, dn1), (o2, dx2, dw2, dn2) = _norm_qkv_rope_pair("cuda", K)
    for i, (a, b) in enumerate(zip((*o1, dx1, dw1, dn1), (*o2, dx2, dw2, dn2))):
        assert torch.isfinite(a).all() and a.shape == b.shape
        err = float((a.float() - b.float()).norm() / b.float().norm())
        assert err <= 2.0**-8, (i, err)
        if i < len(o1):
            assert float((a == b).float().mean()) > 0.99, i


def test_fp8_linear_errors():
    with pytest.raises(ValueError, match="divisible by 128"):
        Fp8Linear(100, 128)
    lin = Fp8Linear(128, 256)
    with pytest.raises(ValueError, match="in_features=128"):
        lin(torch.randn(4, 256).bfloat16())


@pytest.mark.gpu
def test_gpu_fp8_linear():
    test_fp8_linear_vs_bf16(4096, 2048, 7168, torch.float32, device="cuda")
    test_fp8_linear_vs_bf16(200, 7168, 4096, torch.float32, device="cuda")
    test_fp8_linear_dgrad_is_the_fp8_product(device="cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_linear_is_the_linear_of_the_casts(device):
    """`Bf16Linear` (the baseline's dense linears, reading the weight's BF16 copy): y and dx bit for bit
    autograd of `F.linear(x.bfloat16(), w.bfloat16())`; dW on CPU bit for bit too (the BF16 product cast),
    on CUDA the GEMM's fp32 output, which autograd's BF16 dW rounds: within one BF16 rounding (2^-8
    relative). After an in-place change of the weight the next forward reads the new weight."""
    from moefp8.linear import Bf16Linear

    torch.manual_seed(0)
    lin = Bf16Linear(256, 384).to(device)
    torch.nn.init.normal_(lin.weight, std=0.05)
    x = torch.randn(2, 33, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2, 33, 384, device=device, dtype=torch.bfloat16)
    for _ in range(2):
        w = lin.weight.detach().clone().requires_grad_()
        xr = x.detach().clone().requires_grad_()
        yr = torch.nn.functional.linear(xr, w.bfloat16())
        yr.backward(dy)
        y = lin(x)
        y.backward(dy)
        assert torch.equal(y, yr) and torch.equal(x.grad, xr.grad)
        assert lin.weight.grad.dtype == torch.float32
        if device == "cpu":
            assert torch.equal(lin.weight.grad, w.grad)
        else:
            err = (lin.weight.grad - w.grad).abs() / (w.grad.abs() + 1e-30)
            assert float(err.max()) <= 2.0**-8
        x.grad = lin.weight.grad = None
        with torch.no_grad():
            lin.weight.mul_(-2.0)  # the copy must follow
