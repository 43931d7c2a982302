"""RMSNorm and add + RMSNorm (kernels/norm.py): the kernels (interpreter on CPU, compiled on GPU)
and the reference against a float64 RMSNorm of the same BF16 inputs, forward and backward, on odd
row counts, a width that is not a power of two, outlier rows and all-zero rows."""

import pytest
import torch

from moefp8.kernels import norm as N

EPS = 1e-6


def rows(T, H, seed, device):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g) * 2
    if T > 3:
        x[1] = 0  # a zero row: r = 1/sqrt(eps), y = 0
        x[2, :5] *= 1e3  # outliers
    return x.bfloat16().to(device)


def norm_f64(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Independent: float64 RMSNorm of the BF16 values with the BF16-rounded weight."""
    h64, w64 = h.double(), w.bfloat16().double()
    return h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + EPS) * w64


def grads_f64(h, w, dy, dh=None):
    """float64 autograd of the same function: (dx, dw)."""
    h64 = h.double().requires_grad_()
    w64 = w.bfloat16().double().requires_grad_()
    y = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + EPS) * w64
    y.backward(dy.double())
    dx = h64.grad + (dh.double() if dh is not None else 0)
    return dx, w64.grad


def close_bf16(got, want, slack=1, size=None):
    """BF16 outputs: one rounding of the fp32 value (2**-8 relative, two ulps where the interpreter
    truncates), plus fp32 arithmetic against the row's largest term. size: the magnitude the
    roundings scale with where it is not |want| (a sum of two terms rounded apart, which may cancel)."""
    size = want.abs() if size is None else size
    err = (got.double() - want).abs()
    bound = slack * 2.0**-7 * size + 1e-4 * size.amax(-1, keepdim=True) + 1e-30
    assert torch.isfinite(got).all() and bool((err <= bound).all()), float((err / bound).max())


def check(T, H, device, impl, slack):
    x, a = rows(T, H, T + H, device), rows(T, H, T + H + 1, device) / 4
    # a weight BF16 represents exactly (the interpreter truncates the kernels' cast; on a GPU it rounds, tested
    # with the fp32 weight in test_gpu_weight_is_read_rounded_to_bf16)
    w = (1 + 0.3 * torch.randn(H, generator=torch.Generator().manual_seed(H))).bfloat16().float().to(device)
    dy, dh = rows(T, H, 7, device), rows(T, H, 8, device)
    # rms_norm
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = N.rms_norm(xg, wg, EPS, impl=impl)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    close_bf16(y, norm_f64(x, w), slack)
    y.backward(dy)
    dx64, dw64 = grads_f64(x, w, dy)
    close_bf16(xg.grad, dx64, slack)
    assert wg.grad.dtype == torch.float32
    # dw: the kernels sum in fp32 (one pass of partial sums, ~T fp32 roundings); the reference's gradient
    # reaches the fp32 master through its BF16 weight copy, rounded to BF16 once (2**-8 relative)
    dw_rtol = 2.0**-7 if impl == "ref" else 1e-3
    assert torch.allclose(wg.grad.double(), dw64, rtol=dw_rtol, atol=1e-4 * float(dw64.abs().max()) + 1e-30)
    # rms_norm_split: y and x passed through; the pass-through's gradient (dh here) added into dx
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y, xr = N.rms_norm_split(xg, wg, EPS, impl=impl)
    close_bf16(y, norm_f64(x, w), slack)
    assert torch.equal(xr, x)
    torch.autograd.backward([y, xr], [dy, dh])
    dx64, dw64 = grads_f64(x, w, dy, dh)
    close_bf16(xg.grad, dx64, slack, size=(dx64 - dh.double()).abs() + dh.double().abs())
    assert torch.allclose(wg.grad.double(), dw64, rtol=dw_rtol, atol=1e-4 * float(dw64.abs().max()) + 1e-30)
    # add_rms_norm: h = x + a, the bits of torch's BF16 add (GPU); the residual's gradient dh added into dx
    xg, ag, wg = x.clone().requires_grad_(), a.clone().requires_grad_(), w.clone().requires_grad_()
    h, y = N.add_rms_norm(xg, ag, wg, EPS, impl=impl)
    if slack == 1:
        assert torch.equal(h, x + a)
    else:
        close_bf16(h, x.double() + a.double(), slack)
    close_bf16(y, norm_f64(h.detach(), w), slack)
    torch.autograd.backward([h, y], [dh, dy])
    dx64, dw64 = grads_f64(h.detach(), w, dy, dh)
    close_bf16(xg.grad, dx64, slack, size=(dx64 - dh.double()).abs() + dh.double().abs())
    assert torch.equal(xg.grad, ag.grad)
    assert torch.allclose(wg.grad.double(), dw64, rtol=dw_rtol, atol=1e-4 * float(dw64.abs().max()) + 1e-30)


# odd T, H not a power of two; one row; a partial tile; more tiles than the backward's programs (its loop)
CASES = [(37, 384), (1, 128), (130, 256), (1100, 256)]


@pytest.mark.parametrize("T,H", CASES)
def test_reference_matches_float64(T, H):
    check(T, H, "cpu", "ref", slack=1)


@pytest.mark.interp
@pytest.mark.parametrize("T,H", CASES)
def test_triton_interpreter_matches_float64(T, H):
    check(T, H, "cpu", "triton", slack=2)


@pytest.mark.gpu
@pytest.mark.parametrize("T,H", [*CASES, (4099, 2048), (1000, 7168)])
def test_gpu_kernels_match_float64(T, H):
    check(T, H, "cuda", None, slack=1)


def test_bad_rows_are_named():
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"w has shape \(128,\), expected \[256\]"):
        N.rms_norm_fwd(x, torch.ones(128), EPS)
    with pytest.raises(ValueError, match="expected bf16 \\[T, H\\] rows"):
        N.rms_norm_fwd(x.float(), torch.ones(256), EPS)


@pytest.mark.interp
def test_no_rows():
    x = torch.zeros(0, 256, dtype=torch.bfloat16)
    h, y, r = N.rms_norm_fwd(x, torch.ones(256), EPS, x)
    assert h.shape == y.shape == (0, 256) and r.shape == (0,)
    dx, dw = N.rms_norm_bwd(h, y, torch.ones(256), r, h)
    assert dx.shape == (0, 256) and torch.equal(dw, torch.zeros(256))


@pytest.mark.gpu
def test_gpu_weight_is_read_rounded_to_bf16():
    """An fp32 master that BF16 does not represent: the kernels read it rounded (as `weight.to(bf16)`)."""
    x = rows(300, 512, 3, "cuda")
    w = 1 + 0.3 * torch.randn(512, device="cuda")
    assert not torch.equal(w, w.bfloat16().float())
    close_bf16(N.rms_norm(x, w, EPS), norm_f64(x, w))


@pytest.mark.interp
@pytest.mark.parametrize("fwd,bwd", [(dict(BLOCK_T=1, num_warps=4), dict(BLOCK_T=1, num_warps=4, PROGS_PER_SM=1)),
                                     (dict(BLOCK_T=4, num_warps=2), dict(BLOCK_T=2, num_warps=8, PROGS_PER_SM=3)),
                                     # the split backward: chunks of 40 rows (the last one partial), 3 column blocks
                                     (dict(BLOCK_T=2, num_warps=4), dict(SPLIT=True, BLOCK_T=2, num_warps=4, DW_BLOCK_R=8,
                                                                         DW_BLOCK_C=128, DW_ROWS=40, DW_WARPS=4))])
def test_launch_configs_agree(fwd, bwd):
    """Other tilings (tools/bench_norm.py --sweep tries them): the same rows bit for bit (each row's math is
    the tiling's alone), dw the same sum in another order."""
    T, H = 203, 384
    x, a, dy, dh = (rows(T, H, s, "cpu") for s in range(4))
    w = torch.rand(H).bfloat16().float() + 0.5
    h0, y0, r0 = N.rms_norm_fwd(x, w, EPS, a)
    h1, y1, r1 = N.rms_norm_fwd(x, w, EPS, a, launch=fwd)
    assert torch.equal(h0, h1) and torch.equal(y0, y1) and torch.equal(r0, r1)
    dx0, dw0 = N.rms_norm_bwd(h0, dy, w, r0, dh)
    dx1, dw1 = N.rms_norm_bwd(h0, dy, w, r0, dh, launch=bwd)
    assert torch.equal(dx0, dx1) and torch.allclose(dw0, dw1, rtol=1e-5, atol=1e-5 * float(dw0.abs().max()))


def quant_check(T, H, device, launch=None):
    """rms_norm_quant_fwd: the codes and scales of `quant_rowwise` (the same device's kernel) of the BF16
    norm written with its own r, (x r) w rounded to BF16 (the kernel's expression), bit for bit; r within two
    fp32 steps of `rms_norm_fwd`'s (on a GPU the compiler lays the two kernels' rows out apart, 16 or 8 values a
    thread at H 2048: the sum of squares in another order, r one step off in ~1 row in 8); on a GPU against
    the reference twin (torch's norm may round a BF16 value the other way: codes one FP8 step apart at most)."""
    from moefp8.kernels.quant import quant_rowwise

    x = rows(T, H, T + H, device)
    w = (1 + 0.3 * torch.randn(H, generator=torch.Generator().manual_seed(H))).bfloat16().float().to(device)
    q, r = N.rms_norm_quant_fwd(x, w, EPS, launch=launch)
    _, y, r0 = N.rms_norm_fwd(x, w, EPS)
    if device == "cuda":  # the kernel's rows, its r, rounded as the GPU rounds to BF16 (to nearest even)
        y_r = (x.float() * r[:, None] * w).bfloat16()
        assert torch.equal(y_r[r == r0], y[r == r0])  # (rows of equal r: the plain kernel's rows too)
    else:  # (the interpreter's BF16 cast is not torch's; one order of the sum: the plain kernel's r and rows)
        assert torch.equal(r, r0)
        y_r = y
    q0 = quant_rowwise(y_r, impl="triton", colmajor_scale=True)
    assert q.layout == "1x128" and q.scale.stride() == q0.scale.stride() == (1, T)
    assert torch.equal(q.data.view(torch.uint8), q0.data.view(torch.uint8)) and torch.equal(q.scale, q0.scale)
    assert torch.allclose(r, r0, rtol=2.0**-22, atol=0)
    qr, rr = N.rms_norm_quant_ref(x, w, EPS)
    assert torch.allclose(r, rr, rtol=1e-5)
    if device == "cuda":  # (the interpreter's fp8 cast drops values at binade edges a binade: no reference there)
        d, want = q.dequantize(torch.float32), qr.dequantize(torch.float32)
        s = qr.scale.float().repeat_interleave(128, dim=1)[:, :H]  # one E4M3 step of the value, or two subnormal
        assert bool(((d - want).abs() <= 2.0**-3 * want.abs() + 2.0**-8 * s).all())


@pytest.mark.interp
@pytest.mark.parametrize("T,H,launch", [(37, 384, None), (1, 128, None), (130, 2048, dict(BLOCK_T=2, num_warps=4))])
def test_norm_quant_is_quant_rowwise_of_the_norm(T, H, launch):
    quant_check(T, H, "cpu", launch)


@pytest.mark.gpu
@pytest.mark.parametrize("T,H", [(37, 384), (4099, 2048), (1000, 7168)])
def test_gpu_norm_quant_is_quant_rowwise_of_the_norm(T, H):
    quant_check(T, H, "cuda")


def test_norm_quant_bad_width_is_named():
    with pytest.raises(ValueError, match="rms_norm_quant: H=200 must be a multiple of 128"):
        N.rms_norm_quant_fwd(torch.zeros(4, 200, dtype=torch.bfloat16), torch.ones(200), EPS)
