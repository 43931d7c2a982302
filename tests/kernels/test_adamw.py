"""Fused AdamW update: the reference vs an independent float64 computation, the Triton kernel
(interpreter on CPU, compiled on GPU) vs the reference, AdamW.step through both, input errors; the
update that refreshes a weight's FP8 copy in its pass (`adamw_quant_step_`) vs the update and then
`quant_weight`."""

import math

import pytest
import torch

from moefp8.config import OptimConfig
from moefp8.fp8 import FP8_DTYPE, Fp8Tensor
from moefp8.kernels import adamw as A
from moefp8.kernels.quant import quant_weight
from moefp8.testing import assert_fp8_equal
from moefp8.optim import AdamW

HPS = [dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, bc1=1 - 0.9**3, bc2=1 - 0.95**3),
       dict(lr=1e-2, beta1=0.3, beta2=0.999, eps=1e-6, bc1=1 - 0.3, bc2=1 - 0.999)]  # torch.lerp's other formula
MOMENTS = [torch.bfloat16, torch.float32]
# Every fp32 result is a few roundings (unit roundoff u = 2**-24) of sums of the magnitudes
# below, plus one more for the fp32 scalars: each implementation lies within ~6u of the exact value,
# so two of them (FMA contraction or not, interpreter or GPU) within ~12u < 16u = 2**-20.
TOL = 2.0**-20


def make_state(n, moment_dtype, g_dtype=torch.float32, seed=0, device="cpu"):
    """p, g, m, v as the optimizer holds them: gradients spread over 2**-8..2**8, every 7th zero
    and every 11th scaled by 1e15 ((1 - beta2) g**2 ~ 1e28 stays finite in fp32 and bf16)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-8, 9, (n,), generator=gen).float())
    g[::7] = 0
    g[3::11] *= 1e15
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    return [t.to(device) for t in (p, g.to(g_dtype), m.to(moment_dtype), v.to(moment_dtype))]


def exact(p, g, m, v, hp, weight_decay):
    """The update in float64, written independently of the reference, with per-element error
    bounds (TOL times the magnitudes involved; see TOL) for p, m and v."""
    p, g, m, v = (t.double() for t in (p, g, m, v))
    lr, b1, b2 = hp["lr"], hp["beta1"], hp["beta2"]
    m1 = b1 * m + (1 - b1) * g
    v1 = b2 * v + (1 - b2) * g**2
    denom = (v1 / hp["bc2"]).sqrt() + hp["eps"]
    upd = lr / hp["bc1"] * m1 / denom
    tol_m = TOL * (m.abs() + g.abs())
    tol_p = TOL * (p.abs() + upd.abs()) + lr / hp["bc1"] * tol_m / denom  # m's error carried into p
    return (p * (1 - lr * weight_decay) - upd, tol_p), (m1, tol_m), (v1, TOL * v1)


def bf16_ulp(x):
    """One bf16 ulp in x's binade (8 significant bits)."""
    return torch.ldexp(torch.ones_like(x), torch.frexp(x.double())[1] - 8)


def assert_close(got, want, tol, what):
    got, want = got.double().cpu(), want.double().cpu()
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    bad = ~((got - want).abs() <= tol.cpu())  # NaN fails too
    assert not bad.any(), f"{what}: {int(bad.sum())} beyond tolerance, e.g. {got[bad][:3]} vs {want[bad][:3]}"


def check_moment(got, want, tol, what):
    """fp32 moments within tol; bf16 ones may also round the other way (one bf16 ulp)."""
    if got.dtype == torch.bfloat16:
        tol = tol + bf16_ulp(want)
    assert_close(got, want, tol, what)


def step(impl, state, hp, weight_decay, **kw):
    """The update on copies, each the front of a buffer one element longer: the element past the
    end (the masked tail's neighbour) must stay untouched, and so must the gradient."""
    bufs = [torch.cat([t, torch.full((1,), 7.0, dtype=t.dtype, device=t.device)]) for t in state]
    p, g, m, v = (b[:-1] for b in bufs)
    A.adamw_step_(p, g, m, v, weight_decay=weight_decay, impl=impl, **hp, **kw)
    assert all(b[-1] == 7 for b in bufs)
    assert torch.equal(g, state[1])
    return p, m, v


@pytest.mark.parametrize("moment_dtype", MOMENTS)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("hp", HPS)
def test_ref_matches_float64(moment_dtype, weight_decay, hp):
    state = make_state(5000, moment_dtype)
    (p1, tol_p), (m1, tol_m), (v1, tol_v) = exact(*state, hp, weight_decay)
    p, m, v = step("ref", state, hp, weight_decay)
    assert_close(p, p1, tol_p, "p")
    half = 0.5 if moment_dtype == torch.bfloat16 else 0.0  # stored rounded to nearest: half a bf16 ulp
    assert_close(m, m1, tol_m + half * bf16_ulp(m1), "m")
    assert_close(v, v1, tol_v + half * bf16_ulp(v1), "v")


@pytest.mark.interp
@pytest.mark.parametrize("n", [1, 1000, 3 * A.BLOCK + 5])
@pytest.mark.parametrize("moment_dtype", MOMENTS)
@pytest.mark.parametrize("g_dtype", [torch.float32, torch.bfloat16])
def test_interpreter_vs_ref(n, moment_dtype, g_dtype):
    state = make_state(n, moment_dtype, g_dtype, seed=n)
    for hp in HPS:
        for wd in (0.0, 0.1):
            (_, tol_p), (_, tol_m), (_, tol_v) = exact(*state, hp, wd)
            got, want = step("triton", state, hp, wd), step("ref", state, hp, wd)
            assert_close(got[0], want[0], tol_p, "p")
            # the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: one bf16 ulp
            check_moment(got[1], want[1], tol_m, "m")
            check_moment(got[2], want[2], tol_v, "v")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 1023, 1024, 100_003, 1 << 24])
@pytest.mark.parametrize("moment_dtype", MOMENTS)
def test_gpu_vs_ref(n, moment_dtype):
    state = make_state(n, moment_dtype, seed=n, device="cuda")
    hp = HPS[0]
    (_, tol_p), (_, tol_m), (_, tol_v) = exact(*state, hp, 0.1)
    got, want = step(None, state, hp, 0.1), step("ref", state, hp, 0.1)
    assert_close(got[0], want[0], tol_p, "p")
    for i, tol, what in ((1, tol_m, "m"), (2, tol_v, "v")):
        check_moment(got[i], want[i], tol, what)
        if moment_dtype == torch.bfloat16:  # fp32 moments: FMA contraction moves ~20% by an ulp (H200), within tol
            # both round to nearest: bf16 moments differ only where fp32 values an ulp apart straddle a rounding point
            assert (got[i] != want[i]).float().mean() < 1e-3, what


@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=pytest.mark.interp),
                                  pytest.param(None, marks=pytest.mark.gpu)])
def test_grad_scale_updates_as_the_scaled_gradient(impl):
    """grad_scale (the mean over ranks times the clipping, moefp8.optim.clip_scale) multiplies the
    gradient as the update reads it: the update of g * grad_scale (the reference's bit for bit, the
    kernel's within the tolerances), g itself unchanged. 0.3 is not a power of two: a kernel that
    ignored the scale, or applied it twice, fails."""
    dev = "cpu" if impl is not None else "cuda"
    state = make_state(3 * A.BLOCK + 5, torch.bfloat16, seed=5, device=dev)
    gs = torch.tensor(0.3, device=dev)
    hp = HPS[0]
    scaled = (state[0], state[1] * gs, state[2], state[3])
    got, want = step(impl, state, hp, 0.1, grad_scale=gs), step("ref", scaled, hp, 0.1)
    if impl == "ref":
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    (_, tol_p), (_, tol_m), (_, tol_v) = exact(*scaled, hp, 0.1)
    assert_close(got[0], want[0], tol_p, "p")
    check_moment(got[1], want[1], tol_m, "m")
    check_moment(got[2], want[2], tol_v, "v")
    unscaled = step("ref", state, hp, 0.1)
    assert not torch.equal(unscaled[0], got[0])


@pytest.mark.interp
@pytest.mark.parametrize("moment", ["bf16", "fp32"])
def test_optimizer_triton_vs_ref(moment):
    """Three steps through AdamW.step (bias corrections, decay by name, a parameter without a
    gradient); after each, the Triton side must match and is then reset to the reference's state,
    so that each step is checked with the single-step tolerances."""
    shapes = {"embed.weight": (33, 16), "norm.weight": (16,), "layers.0.w1": (3, 40, 16), "no_grad": (5,)}
    gen = torch.Generator().manual_seed(0)
    init = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    cfg = OptimConfig(moment_dtype=moment)
    tri, ref = (AdamW([(n, torch.nn.Parameter(t.clone())) for n, t in init.items()], cfg) for _ in range(2))
    tri.impl, ref.impl = "triton", "ref"
    for k, lr in enumerate((1e-2, 3e-3, 1e-3), 1):
        grads = {n: torch.randn(s, generator=gen) for n, s in shapes.items() if n != "no_grad"}
        hp = dict(lr=lr, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps, bc1=1 - cfg.beta1**k, bc2=1 - cfg.beta2**k)
        tols = {n: exact(ref.params[n], g, ref.exp_avg[n], ref.exp_avg_sq[n], hp, 0.0) for n, g in grads.items()}
        versions = {n: p._version for n, p in tri.params.items()}
        for opt in (tri, ref):
            for n, p in opt.params.items():
                p.grad = grads[n].clone() if n in grads else None
            opt.step(lr)
        for n, (p_tol, m_tol, v_tol) in tols.items():
            assert tri.params[n]._version > versions[n], n  # WeightCache sees the update
            assert_close(tri.params[n], ref.params[n], p_tol[1], n)
            check_moment(tri.exp_avg[n], ref.exp_avg[n], m_tol[1], n)
            check_moment(tri.exp_avg_sq[n], ref.exp_avg_sq[n], v_tol[1], n)
        assert tri.params["no_grad"]._version == versions["no_grad"]
        assert torch.equal(tri.params["no_grad"], init["no_grad"])
        tri.load_state_dict(ref.state_dict())
        for n, p in tri.params.items():
            p.data.copy_(ref.params[n])


@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=pytest.mark.interp),
                                  pytest.param(None, marks=pytest.mark.gpu)])
def test_low_copy_is_the_updated_weight_in_bf16(impl):
    """`low=`: the same pass writes the weight's BF16 copy: p, m and v bit for bit the update without it,
    low the new p rounded to BF16 (the interpreter truncates: within one BF16 step); the buffer held
    other values before (a kernel that skipped the store, or wrote the old p, fails)."""
    dev = "cuda" if impl is None else "cpu"
    state = make_state(3 * A.BLOCK + 5, torch.bfloat16, seed=7, device=dev)
    hp = dict(weight_decay=0.1, impl=impl, **HPS[0])
    want = [t.clone() for t in state]
    A.adamw_step_(*want, **hp)
    got = [t.clone() for t in state]
    low = torch.full_like(state[0], 7.0, dtype=torch.bfloat16)
    A.adamw_step_(*got, low=low, **hp)
    for a, b, what in zip(got, want, "pgmv"):
        assert torch.equal(a, b), what
    if impl == "triton":
        assert torch.allclose(low.float(), got[0], rtol=2.0**-7, atol=0)
    else:
        assert torch.equal(low, got[0].bfloat16())
    with pytest.raises(ValueError, match="low must be a contiguous bfloat16 tensor of p's shape"):
        A.adamw_step_(*got, low=low.float(), **hp)


def weight_state(shape, moment_dtype, seed, device):
    """make_state's values as a weight [(E,) N, K]: its first 128x128 block all zeros (p, g and the
    moments: the block stays 0, the amax floor's scale), its last block's masters times 1e4 (a large
    scale beside small ones)."""
    state = [t.view(shape) for t in make_state(math.prod(shape), moment_dtype, seed=seed, device=device)]
    for t in state:
        t[..., :128, :128] = 0
    state[0][..., -128:, -128:] *= 1e4
    return state


def stale_copy(shape, transposed, device):
    """A copy's buffers holding other values (a previous step's), contiguous, of the weight's shape."""
    w = torch.randn(shape, device=device) * 3
    return quant_weight(w, "pow2", impl="ref", transposed=True) if transposed else (quant_weight(w, "pow2", impl="ref"),
                                                                                     None)


@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=pytest.mark.interp),
                                  pytest.param(None, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("shape", [(256, 128), (2, 256, 384), (200, 256)])  # last: N % 128 != 0, no transpose
@pytest.mark.parametrize("scale_fmt", ["pow2", "fp32"])
@pytest.mark.parametrize("rows", [None, 32, 128])  # QUANT_LAUNCH's; the block by 32-row passes, or whole
def test_quant_step_is_the_update_then_quant_weight(impl, shape, scale_fmt, rows):
    """The weight's update and its FP8 copy from one pass: p, m and v bit for bit `adamw_step_`'s (the
    same implementation), the copy (and its transpose) bit for bit `quant_weight` of the updated p,
    written into the buffers given (which held other codes: a kernel that skipped a block, quantized
    the old p or wrote the transpose wrong fails)."""
    dev = "cuda" if impl is None else "cpu"
    state = weight_state(shape, torch.bfloat16, seed=len(shape), device=dev)
    trans = shape[-2] % 128 == 0
    hp = dict(weight_decay=0.1, grad_scale=torch.tensor(0.3, device=dev), impl=impl, **HPS[0])
    want = [t.clone() for t in state]
    A.adamw_step_(*want, **hp)
    q, qt = quant_weight(want[0], scale_fmt, impl=impl, transposed=True) if trans else \
        (quant_weight(want[0], scale_fmt, impl=impl), None)
    got = [t.clone() for t in state]
    w8, w8t = stale_copy(shape, trans, dev)
    A.adamw_quant_step_(*got, w8, w8t, scale_fmt=scale_fmt, launch=rows and dict(ROWS=rows, num_warps=4), **hp)
    for a, b, what in zip(got, want, "pgmv"):
        assert torch.equal(a, b), what
    assert torch.isfinite(w8.data.float()).all() and w8.scale[..., 0, 0].eq(w8.scale.min()).all()  # the zero block
    assert_fp8_equal(w8, q, exact=True)
    if trans:
        assert_fp8_equal(w8t, qt, exact=True)


@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=pytest.mark.interp),
                                  pytest.param(None, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("shape,g_dtype,moment,scale_fmt", [((256, 384), torch.float32, torch.bfloat16, "pow2"),
                                                            ((384, 256), torch.bfloat16, torch.float32, "fp32"),
                                                            ((200, 256), torch.float32, torch.bfloat16, "pow2")])
def test_multi_step_is_each_weights_quant_step(impl, shape, g_dtype, moment, scale_fmt):
    """Three weights of one shape in one launch (a table of their addresses): p, m, v and the copies
    (and transposes) bit for bit what each weight's own `adamw_quant_step_` gives; the copies' buffers
    held stale codes (a program that read another weight's row of the table, or skipped one, fails)."""
    dev = "cuda" if impl is None else "cpu"
    trans = shape[0] % 128 == 0
    states = []
    for i in range(3):
        st = weight_state(shape, moment, seed=10 + i, device=dev)
        st[1] = st[1].to(g_dtype)
        st[0].mul_(i + 1)  # three different scales
        states.append(st)
    hp = dict(weight_decay=0.1, grad_scale=torch.tensor(0.3, device=dev), impl=impl, scale_fmt=scale_fmt, **HPS[0])
    want, got = [[[t.clone() for t in st] for st in states] for _ in range(2)]
    want_c = [stale_copy(shape, trans, dev) for _ in states]
    got_c = [stale_copy(shape, trans, dev) for _ in states]
    for st, (w8, w8t) in zip(want, want_c):
        A.adamw_quant_step_(*st, w8, w8t, **hp)
    A.adamw_quant_multi_step_(*[[st[j] for st in got] for j in range(4)], got_c, **hp)
    for a, b in zip(got, want):
        for x, y, what in zip(a, b, "pgmv"):
            assert torch.equal(x, y), what
    for (a8, a8t), (b8, b8t) in zip(got_c, want_c):
        assert_fp8_equal(a8, b8, exact=True)
        if trans:
            assert_fp8_equal(a8t, b8t, exact=True)
    with pytest.raises(ValueError, match="one shape"):
        A.adamw_quant_multi_step_(*[[st[j] for st in got] + [got[0][j][:128].contiguous()] for j in range(4)],
                                  got_c + [stale_copy((128, shape[1]), trans, dev)], **hp)
    # a gradient that does not start 16-byte aligned (a view into a bucket): the same results (a launch each)
    again = [[t.clone() for t in st] for st in states]
    again[1][1] = unaligned(states[1][1])
    again_c = [stale_copy(shape, trans, dev) for _ in states]
    A.adamw_quant_multi_step_(*[[st[j] for st in again] for j in range(4)], again_c, **hp)
    for a, b in zip(again, want):
        for x, y, what in zip(a, b, "pgmv"):
            assert torch.equal(x, y), what


def unaligned(t):
    """t's values in a tensor that starts one element past a 16-byte boundary."""
    u = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
    u.copy_(t)
    return u


@pytest.mark.parametrize("impl", [pytest.param("triton", marks=pytest.mark.interp),
                                  pytest.param(None, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("quant", [False, True])
def test_update_of_an_unaligned_bf16_gradient_is_the_aligned_ones(impl, quant):
    """A BF16 gradient that starts 2 bytes past a 16-byte boundary (scalar loads where the aligned one
    gets vector loads: another compiled kernel) gives the same p, m, v and copy bit for bit. With the
    compiler's FMA contraction on, the two compiled kernels fused different products: v moved by an ulp
    in ~9% of its elements, p by up to 256 ulp where the update cancels it (one H200, session 59);
    `_adam` writes its FMAs out."""
    dev = "cuda" if impl is None else "cpu"
    shape = (384, 256)
    st = weight_state(shape, torch.float32, seed=11, device=dev)
    st[1] = st[1].to(torch.bfloat16)
    hp = dict(weight_decay=0.1, grad_scale=torch.tensor(0.3, device=dev), impl=impl, **HPS[0])
    want, got = [t.clone() for t in st], [t.clone() for t in st]
    got[1] = unaligned(st[1])
    assert got[1].data_ptr() % 16 == 2
    if quant:
        copies = [stale_copy(shape, True, dev) for _ in range(2)]
        for s_, (w8, w8t) in zip((want, got), copies):
            A.adamw_quant_step_(*s_, w8, w8t, scale_fmt="fp32", **hp)
        for a, b in zip(*copies):
            assert_fp8_equal(a, b, exact=True)
    else:
        for s_ in (want, got):
            A.adamw_step_(*s_, **hp)
    for x, y, what in zip(got, want, "pgmv"):
        assert torch.equal(x, y), what


@pytest.mark.interp
def test_optimizer_updates_the_fp8_matrices_of_one_shape_in_one_launch(monkeypatch):
    """AdamW.step hands the FP8-copy matrices of one shape and update to `adamw_quant_multi_step_` (one
    call for a.w and b.w; c.w, of another shape, and the 3-D expert weight alone): every weight, moment
    and copy bit for bit each weight's own `adamw_quant_step_`, and the copies marked current."""
    from moefp8 import optim
    from moefp8.weight_copy import copy_of

    shapes = {"a.w": (256, 128), "b.w": (256, 128), "c.w": (128, 256), "e.w": (2, 128, 128)}
    gen = torch.Generator().manual_seed(3)
    init = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    grads = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    opt = AdamW([(n, torch.nn.Parameter(t.clone())) for n, t in init.items()], OptimConfig())
    opt.impl = "triton"
    for p in opt.params.values():
        copy_of(p, "pow2", transposed=True)
        p.grad = grads[next(n for n, q in opt.params.items() if q is p)].clone()
    calls = []
    real = optim.adamw_quant_multi_step_
    monkeypatch.setattr(optim, "adamw_quant_multi_step_",
                        lambda ps, *a, **k: (calls.append(len(ps)), real(ps, *a, **k)))
    opt.step(1e-2)
    assert sorted(calls) == [1, 2]  # (a.w, b.w) together, c.w alone; the expert weight not through it
    c = opt.cfg
    for n, t in init.items():
        p, m, v = t.clone(), torch.zeros_like(t, dtype=torch.bfloat16), torch.zeros_like(t, dtype=torch.bfloat16)
        w8, w8t = quant_weight(p, "pow2", impl="ref", transposed=True)
        A.adamw_quant_step_(p, grads[n], m, v, w8, w8t, scale_fmt="pow2", lr=1e-2, beta1=c.beta1, beta2=c.beta2,
                            eps=c.eps, weight_decay=c.weight_decay, bc1=1 - c.beta1, bc2=1 - c.beta2, impl="triton")
        q = opt.params[n]
        assert torch.equal(q, p) and torch.equal(opt.exp_avg[n], m) and torch.equal(opt.exp_avg_sq[n], v), n
        assert_fp8_equal(q.low_copy.low, w8, exact=True)
        assert_fp8_equal(q.low_copy.low_t, w8t, exact=True)
        assert q.low_copy.version == q._version, n


def test_quant_step_errors():
    p, g, m, v = weight_state((256, 128), torch.bfloat16, seed=0, device="cpu")
    w8, w8t = stale_copy((256, 128), True, "cpu")
    hp = dict(weight_decay=0.0, scale_fmt="pow2", **HPS[0])
    with pytest.raises(ValueError, match=r"w8t must be a contiguous \"128x128\" FP8 copy with data \(128, 256\)"):
        A.adamw_quant_step_(p, g, m, v, w8, w8, **hp)
    with pytest.raises(ValueError, match=r"w8 must be .* fp32 scales \(2, 1\), got 128x128 .* scales torch.float32 \(1, 2\)"):
        A.adamw_quant_step_(p, g, m, v, Fp8Tensor(w8.data, w8t.scale, "128x128"), None, **hp)
    with pytest.raises(ValueError, match=r"K % 128 == 0, got \(2, 5\)"):
        A.adamw_quant_step_(p[:2, :5].contiguous(), g[:2, :5].contiguous(), m[:2, :5].contiguous(),
                            v[:2, :5].contiguous(), w8, None, **hp)
    with pytest.raises(ValueError, match=r"a transposed copy needs N % 128 == 0, got N=200"):
        A.adamw_quant_step_(*(t[:200].contiguous() for t in (p, g, m, v)), Fp8Tensor(
            torch.zeros(200, 128, dtype=FP8_DTYPE), torch.zeros(2, 1), "128x128"), w8t, **hp)
    with pytest.raises(ValueError, match="scale_fmt"):
        A.adamw_quant_step_(p, g, m, v, w8, w8t, **{**hp, "scale_fmt": "e8m0"})


def test_errors():
    p, g, m, v = make_state(64, torch.bfloat16)
    hp = dict(weight_decay=0.0, **HPS[0])
    with pytest.raises(ValueError, match=r"g is not contiguous \(shape \(8, 4\), stride \(1, 8\)\)"):
        A.adamw_step_(p[:32].view(8, 4), g[:32].view(4, 8).t(), m[:32].view(8, 4), v[:32].view(8, 4), **hp)
    with pytest.raises(ValueError, match=r"v has shape \(32,\), expected p's \(64,\)"):
        A.adamw_step_(p, g, m, v[:32], **hp)
    with pytest.raises(TypeError, match="m and v both bfloat16 or both float32"):
        A.adamw_step_(p, g, m, v.float(), **hp)
    with pytest.raises(TypeError, match="expected p float32"):
        A.adamw_step_(p.bfloat16(), g, m, v, **hp)
    with pytest.raises(ValueError, match="grad_scale must be one float32 value"):
        A.adamw_step_(p, g, m, v, grad_scale=torch.ones(2), **hp)
    with pytest.raises(ValueError, match="grad_scale must be one float32 value"):
        A.adamw_step_(p, g, m, v, grad_scale=torch.tensor(1.0, dtype=torch.float64), **hp)
