"""Quantization kernels: references vs an independent float64 computation, Triton (interpreter
on CPU, compiled on GPU) vs the references, the non-finite contract, the double-quantization
claim of docs/design.md §1, and input errors."""

import math

import pytest
import torch

from moefp8.fp8 import AMAX_MIN, FP8_DTYPE, Fp8Tensor, col_major
from moefp8.kernels import quant as Q
from moefp8.testing import assert_fp8_equal

FMTS = ["pow2", "fp32"]
E4M3_MIN_NORMAL = 2.0**-6


# ----------------------------------------------------------------------------------------------
# Inputs


def make_x(M: int, K: int, dtype=torch.bfloat16, seed: int = 0, device="cpu") -> torch.Tensor:
    """Random rows with per-row magnitudes spread over 2**-12..2**12, a few outliers up to 1e4,
    an all-zero row and a row of tiny values (exercises the amax clamp)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-12, 13, (M, 1), generator=g).float())
    n_out = max(1, M * K // 500)
    idx = torch.randint(0, M * K, (n_out,), generator=g)
    x.view(-1)[idx] = (torch.rand(n_out, generator=g) * 2 - 1) * 1e4
    if M > 2:
        x[1] = 0
        x[2] = torch.randn(K, generator=g) * 1e-7
    return x.to(dtype).to(device)


# ----------------------------------------------------------------------------------------------
# Independent float64 model of the recipe


def _e4m3_table() -> torch.Tensor:
    """All finite non-negative E4M3 values in float64, from the format's definition (not a cast)."""
    vals = [m / 8 * 2.0**-6 for m in range(8)]  # subnormals (exponent field 0)
    for e in range(1, 16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # S.1111.111 is NaN in e4m3fn
            vals.append((1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64)


E4M3 = _e4m3_table()  # index == code of the magnitude bits, ascending


def round_e4m3_f64(y: torch.Tensor) -> torch.Tensor:
    """Round float64 to the nearest E4M3 value, ties to even code, saturating at 448."""
    a = y.abs().clamp(max=448.0)
    hi = torch.bucketize(a, E4M3).clamp(max=len(E4M3) - 1)  # first table value >= a
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - E4M3[lo], E4M3[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.where(pick_hi, E4M3[hi], E4M3[lo]) * torch.sign(y)


def expected_scale_f64(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    amax = amax.double().clamp_min(float(torch.tensor(AMAX_MIN, dtype=torch.float32)))
    if fmt == "pow2":
        return torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    return (amax / 448.0).float().double()  # binary64 -> binary32 rounding of the exact quotient


def check_against_f64(q: Fp8Tensor, x: torch.Tensor, fmt: str) -> None:
    """q must be the 1x128-tile quantization of x (x laid out like q.data) per docs/design.md §1."""
    x64 = x.double()
    L = x64.shape[-1]
    G = -(-L // 128)
    xt = torch.nn.functional.pad(x64, (0, G * 128 - L)).view(*x64.shape[:-1], G, 128)
    s = expected_scale_f64(xt.abs().amax(-1), fmt)
    assert torch.equal(q.scale.double(), s), "scales differ from the float64 model"
    y = xt / s[..., None]  # exact for pow2 scales; fp32 scales divide in fp32 first (two roundings)
    if fmt == "fp32":
        y = y.float().double()
    want = round_e4m3_f64(y).view(*x64.shape[:-1], G * 128)[..., :L]
    got = q.data.double()
    assert torch.equal(got, want), f"{(got != want).sum().item()} FP8 values differ from float64 RNE"


# ----------------------------------------------------------------------------------------------
# References vs float64


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("M,K,dtype", [(1, 128, torch.float32), (200, 384, torch.bfloat16), (300, 640, torch.float32)])
def test_rowwise_ref_matches_f64(fmt, M, K, dtype):
    x = make_x(M, K, dtype, seed=M + K)
    q = Q.quant_rowwise_ref(x, fmt)
    assert q.data.dtype == FP8_DTYPE and q.scale.dtype == torch.float32
    assert q.data.shape == (M, K) and q.scale.shape == (M, K // 128)
    check_against_f64(q, x, fmt)
    if fmt == "pow2":  # scales are exact powers of two
        m, _ = torch.frexp(q.scale)
        assert torch.all(m == 0.5)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("M,K", [(1, 128), (129, 256), (300, 384)])
def test_colwise_ref_matches_f64(fmt, M, K):
    x = make_x(M, K, torch.bfloat16, seed=M * K)
    q = Q.quant_colwise_ref(x, fmt)
    assert q.layout == "128x1" and q.shape == (M, K)
    assert q.data.shape == (K, M) and q.scale.shape == (K, -(-M // 128))
    check_against_f64(q, x.t(), fmt)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("shape", [(256, 384), (300, 256), (3, 200, 128)])
def test_weight_ref_matches_f64(fmt, shape):
    w = make_x(math.prod(shape[:-1]), shape[-1], torch.float32, seed=7).view(shape)
    q = Q.quant_weight_ref(w, fmt)
    N, K = shape[-2:]
    Nb = -(-N // 128)
    assert q.scale.shape == (*shape[:-2], Nb, K // 128)
    w64 = torch.nn.functional.pad(w.double(), (0, 0, 0, Nb * 128 - N))
    blocks = w64.view(*shape[:-2], Nb, 128, K // 128, 128)
    s = expected_scale_f64(blocks.abs().amax(dim=(-3, -1)), fmt)
    assert torch.equal(q.scale.double(), s)
    y = blocks / s[..., :, None, :, None]
    if fmt == "fp32":
        y = y.float().double()
    want = round_e4m3_f64(y).view(w64.shape)[..., :N, :]
    assert torch.equal(q.data.double(), want)


def test_swiglu_ref_matches_f64():
    h = make_x(70, 512, torch.bfloat16, seed=3).clamp(-30, 30)
    g, u = h.double().chunk(2, dim=-1)
    a64 = g * torch.sigmoid(g) * u
    # exp(-g) is exp2(g * -log2 e): rounding the product to fp32 moves the exponent by up to
    # |g| log2(e) 2^-24, i.e. exp by a relative |g| 2^-24; sigmoid, division and the products add
    # a few ulps (2^-21 covers them)
    bound = (g.abs() * 2.0**-24 + 2.0**-21) * a64.abs()
    err = (Q.swiglu_ref(h).double() - a64).abs()
    assert (err <= bound).all(), f"worst {(err / bound).max().item():.2f}x the bound"
    assert (err > bound / 64).any()  # the bound is not vacuous
    q = Q.swiglu_quant_ref(h)
    check_against_f64(q, Q.swiglu_ref(h), "pow2")


def test_dequantize_layouts_round_trip():
    x = make_x(130, 256, torch.float32, seed=11)
    for q in (Q.quant_rowwise_ref(x), Q.quant_colwise_ref(x)):
        assert q.shape == x.shape
        d = q.dequantize()
        assert d.shape == x.shape
        # |x - q*s| <= half an FP8 ulp (2**-4 relative) or, below E4M3's normal range, half the
        # subnormal step 2**-9 * s
        s = q.scale.repeat_interleave(128, -1)
        s = s if q.layout == "1x128" else s[:, : x.shape[0]].t()
        assert torch.all((d - x).abs() <= torch.maximum(x.abs() * 2**-4, s * 2**-10))


def test_zero_tiles_use_the_amax_clamp_and_gradient_sized_tiles_their_own_scale():
    x = torch.zeros(3, 256)
    x[1, :128] = 1e-9  # a gradient-sized tile (dY tiles of a 16k-token step: amax ~1e-7..1e-9)
    x[2, :128] = 1e-35  # below the clamp
    for quant in (Q.quant_rowwise_ref, Q.quant_rowwise):
        q = quant(x)
        floor = 2.0**-108  # 2**ceil(log2(AMAX_MIN/448)), AMAX_MIN = 1e-30
        assert torch.all(q.scale[[0, 2]] == floor) and torch.all(q.scale[1, 1] == floor)
        assert q.scale[1, 0] == 2.0**-38  # 2**ceil(log2(1e-9/448)): 1e-9 -> 275, a normal E4M3 value
        assert torch.all(q.data.float()[0] == 0)
        assert torch.all((q.dequantize()[2] - x[2]).abs() <= 2**-10 * floor)  # E4M3 subnormals of the floor
        assert torch.all(q.data.float()[1, :128] == 288.0)  # 1e-9 * 2**38 = 274.9: E4M3 step 32 there
        assert torch.all(q.dequantize()[1, :128] / 1e-9 - 1 < 2**-4)
    assert AMAX_MIN == 1e-30


def test_outliers_never_overflow():
    x = torch.tensor([[1e4, -1e4] + [1e-8] * 126, [448.0 * 2**10] * 128])
    for fmt in FMTS:
        q = Q.quant_rowwise_ref(x, fmt)
        assert torch.isfinite(q.dequantize()).all()
        assert torch.allclose(q.dequantize()[:, :2], x[:, :2], rtol=2**-4)


# ----------------------------------------------------------------------------------------------
# Non-finite contract (moefp8.fp8): NaN stays NaN, Inf poisons its tile, nothing becomes finite


def nonfinite_input() -> torch.Tensor:
    x = make_x(4, 256, torch.float32, seed=5)
    x[0, 3] = float("nan")
    x[2, 130] = float("inf")
    x[3, 0] = float("-inf")
    return x


def requant_nonfinite_input(M: int, device="cpu") -> Fp8Tensor:
    """"1x128" [M, 256], M > 128: a NaN code at (5, 3); scale Inf on row 7's second tile (codes 1,
    one 0: NaN) and on row M-1's first tile (codes -2)."""
    q = Q.quant_rowwise_ref(make_x(M, 256, torch.float32, seed=4))
    q.data[5, 3] = float("nan")
    q.data[7, 128:] = 1.0
    q.data[7, 200] = 0.0
    q.data[M - 1, :128] = -2.0
    q.scale[7, 1] = q.scale[M - 1, 0] = float("inf")
    return Fp8Tensor(q.data.to(device), q.scale.to(device), "1x128")


def check_nonfinite_contract(q: Fp8Tensor, x: torch.Tensor, fmt: str) -> None:
    d = q.dequantize()
    assert torch.isnan(d[0, 3])
    keep = torch.arange(128) != 3
    ref = Q.quant_rowwise_ref(x[0:1, :128].nan_to_num(0.0), fmt)  # NaN ignored by the amax
    assert torch.equal(d[0, :128][keep], ref.dequantize()[0][keep])
    assert torch.isnan(d[2, 128:]).all() and torch.isfinite(d[2, :128]).all()  # Inf poisons its tile only
    assert torch.isnan(d[3, :128]).all()
    assert torch.isfinite(d[1]).all()


def test_nonfinite_ref():
    x = nonfinite_input()
    for fmt in FMTS:
        check_nonfinite_contract(Q.quant_rowwise_ref(x, fmt), x, fmt)


# ----------------------------------------------------------------------------------------------
# Double quantization (docs/design.md §1): row-wise FP8 -> dequant -> col-wise FP8 with pow2 scales
# gives the same values as col-wise quantization of the source, except where a value is subnormal
# in E4M3 in one of the quantizations. Measured, not assumed: the bytes can also differ without
# the values differing, when a column tile's amax a > 448*2**e rounds down onto 448*2**e in the
# row-wise pass: that tile's scale halves and its FP8 codes double.


def test_double_quantization_claim():
    x = make_x(384, 512, torch.bfloat16, seed=21)
    x[5] = 0  # zero rows and the amax clamp in both directions
    single = Q.quant_colwise_ref(x)
    row = Q.quant_rowwise_ref(x)
    double = Q.requant_colwise_ref(row)
    xs = x.float()
    s_single = single.scale.repeat_interleave(128, 1).t()  # [M, K]
    s_double = double.scale.repeat_interleave(128, 1).t()
    subnormal = ((xs / row.scale.repeat_interleave(128, 1)).abs() < E4M3_MIN_NORMAL) \
        | ((xs / s_single).abs() < E4M3_MIN_NORMAL) | ((row.dequantize() / s_double).abs() < E4M3_MIN_NORMAL)
    differ = single.dequantize() != double.dequantize()
    assert not (differ & ~subnormal).any(), f"{(differ & ~subnormal).sum()} values differ at normal values"
    moved = single.scale != double.scale
    assert torch.equal(double.scale[moved] * 2, single.scale[moved]), "a scale moved by other than 1/2"
    # make_x spreads row magnitudes over 2**24 to force subnormals; on activation-like data
    # (normal, a few outliers) mismatches are rare: 0.03% measured here.
    z = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(1)).bfloat16()
    z.view(-1)[::997] *= 100
    zs, zd = Q.quant_colwise_ref(z), Q.requant_colwise_ref(Q.quant_rowwise_ref(z))
    assert (zs.dequantize() != zd.dequantize()).float().mean() < 1e-3
    # Bit-exact on data with neither subnormals nor an amax near a threshold: |y| in [1, 1.75).
    y = (torch.rand(256, 256) * 0.7 + 1) * torch.sign(torch.randn(256, 256))
    assert torch.equal(Q.quant_colwise_ref(y).data.view(torch.uint8),
                       Q.requant_colwise_ref(Q.quant_rowwise_ref(y)).data.view(torch.uint8))


# ----------------------------------------------------------------------------------------------
# Triton kernels vs references. Under the interpreter, compare bytes with the two known
# interpreter cast bugs allowed (ties rounded away from zero: one code step; a value just under
# a power of two dropping to the binade below: half the reference value); on a GPU, bit-exact.

KERNELS = {
    # name: (make input from x, triton call, reference call)
    "rowwise": (lambda x: x, Q.quant_rowwise, Q.quant_rowwise_ref),
    "colwise": (lambda x: x, Q.quant_colwise, Q.quant_colwise_ref),
    "weight": (lambda x: x, Q.quant_weight, Q.quant_weight_ref),
    "weight_stack": (lambda x: x.view(2, -1, x.shape[-1]) if x.shape[0] % 2 == 0 else x[None], Q.quant_weight,
                     Q.quant_weight_ref),
    "requant_colwise": (lambda x: Q.quant_rowwise_ref(x), Q.requant_colwise, Q.requant_colwise_ref),
    "swiglu_quant": (lambda x: x.clamp(-60, 60), Q.swiglu_quant, Q.swiglu_quant_ref),
    "dequant_swiglu_quant_colwise": (lambda x: Q.quant_rowwise_ref(x.clamp(-60, 60)), Q.dequant_swiglu_quant_colwise,
                                     Q.dequant_swiglu_quant_colwise_ref),
}


# M % 16 == 0 takes the col-wise kernels' packed store (144: a 16-row last tile), other M the byte-wise one
SHAPES_INTERP = [(1, 256), (200, 256), (129, 512), (144, 256)]


@pytest.mark.interp
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("M,K", SHAPES_INTERP)
def test_triton_interpreter_vs_ref(name, fmt, M, K):
    prep, fn, ref = KERNELS[name]
    x = make_x(M, K, torch.bfloat16, seed=M + K)
    inp = prep(x)
    got = fn(inp, fmt, impl="triton")
    want = ref(inp, fmt)
    # swiglu: numpy's exp and torch's may differ in the last bit, which moves fp32 amaxes by an ulp
    rtol = 1e-6 if (fmt == "fp32" and "swiglu" in name) else 0.0
    assert_fp8_equal(got, want, exact=False, scale_rtol=rtol)


@pytest.mark.interp
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy on the NaN/Inf fed in
@pytest.mark.parametrize("fmt", FMTS)
def test_triton_interpreter_nonfinite_scales(fmt):
    # The interpreter casts NaN to FP8 384 (Triton 3.9), so only the scale half of the contract is
    # checkable here; the FP8 NaN encoding is checked on the reference and on the GPU.
    x = nonfinite_input()
    want = Q.quant_rowwise_ref(x, fmt).scale
    assert torch.isinf(want[2, 1]) and torch.isinf(want[3, 0]) and torch.isfinite(want[0, 0])
    assert torch.equal(Q.quant_rowwise(x, fmt, impl="triton").scale, want)
    assert torch.equal(Q.quant_colwise(x.t().contiguous(), fmt, impl="triton").scale, want)


class _LaunchSpy:
    """Stands in for a Triton kernel in Q's namespace: records its name on launch."""

    def __init__(self, kernel, name, calls):
        self.kernel, self.name, self.calls = kernel, name, calls

    def __getitem__(self, grid):
        self.calls.append(self.name)
        return self.kernel[grid]


# requant_colwise has two kernels: int32 words (pow2 scales, M % 16 == 0; 256: no masks, 272 and
# 144: a partial last 128-row group) and the generic one (fp32 scales, or M % 16 != 0: 200, 1)
REQUANT_CASES = [(256, "pow2", "words"), (272, "pow2", "words"), (144, "pow2", "words"), (200, "pow2", "generic"),
                 (1, "pow2", "generic"), (272, "fp32", "generic")]


@pytest.mark.interp
@pytest.mark.parametrize("M,fmt,kernel", REQUANT_CASES)
def test_triton_interpreter_requant_colwise_paths(monkeypatch, M, fmt, kernel):
    calls = []
    for name, tag in (("_requant_colwise_words_kernel", "words"), ("_requant_colwise_kernel", "generic")):
        monkeypatch.setattr(Q, name, _LaunchSpy(getattr(Q, name), tag, calls))
    # 384 columns: BLOCK_K-wide programs over three 128-column scale tiles
    inp = Q.quant_rowwise_ref(make_x(M, 384, torch.bfloat16, seed=M))
    got = Q.requant_colwise(inp, fmt, impl="triton")
    assert calls == [kernel]
    assert_fp8_equal(got, Q.requant_colwise_ref(inp, fmt), exact=False)
    # the words kernel's byte order: values exactly representable in both passes give equal bytes
    y = (torch.rand(M, 384, generator=torch.Generator().manual_seed(M)) * 0.7 + 1) * torch.randn(M, 384).sign()
    y8 = Q.quant_rowwise_ref(y, fmt)
    assert torch.equal(Q.requant_colwise(y8, fmt, impl="triton").data.view(torch.uint8),
                       Q.requant_colwise_ref(y8, fmt).data.view(torch.uint8))


# dequant_swiglu_quant_colwise has two kernels too: strips (pow2, M % 16 == 0) and the generic one
DEQUANT_SWIGLU_CASES = [(256, "pow2", "strips"), (144, "pow2", "strips"), (200, "pow2", "generic"),
                        (272, "fp32", "generic")]


@pytest.mark.interp
@pytest.mark.parametrize("M,fmt,kernel", DEQUANT_SWIGLU_CASES)
def test_triton_interpreter_dequant_swiglu_paths(monkeypatch, M, fmt, kernel):
    calls = []
    for name, tag in (("_dequant_swiglu_quant_colwise_strips_kernel", "strips"),
                      ("_dequant_swiglu_quant_colwise_kernel", "generic")):
        monkeypatch.setattr(Q, name, _LaunchSpy(getattr(Q, name), tag, calls))
    inp = Q.quant_rowwise_ref(make_x(M, 512, torch.bfloat16, seed=M).clamp(-60, 60))
    got = Q.dequant_swiglu_quant_colwise(inp, fmt, impl="triton")
    assert calls == [kernel]
    assert_fp8_equal(got, Q.dequant_swiglu_quant_colwise_ref(inp, fmt), exact=False)


@pytest.mark.interp
@pytest.mark.parametrize("block_k,num_warps", [(16, 1), (32, 4), (64, 8), (128, 1)])
def test_triton_interpreter_dequant_swiglu_strips_configs(monkeypatch, block_k, num_warps):
    # The strips kernel maps its tile rows to 4-row groups by the threads along the rows, T =
    # (32 / (BLOCK_K / 4)) * num_warps (R = 32 / T groups each: 4, 2, 1, 1 here): a wrong map
    # stores a group's words at another group's place. 272 rows: a partial last 128-row group.
    monkeypatch.setitem(Q.LAUNCH, "dequant_swiglu_quant_colwise", dict(BLOCK_K=block_k, num_warps=num_warps, GROUP_K=8))
    inp = Q.quant_rowwise_ref(make_x(272, 512, torch.bfloat16, seed=block_k).clamp(-60, 60))
    assert_fp8_equal(Q.dequant_swiglu_quant_colwise(inp, impl="triton"), Q.dequant_swiglu_quant_colwise_ref(inp),
                     exact=False)


@pytest.mark.interp
@pytest.mark.parametrize("K", [256, 768])
def test_triton_interpreter_colwise_program_order(monkeypatch, K):
    # The words kernels walk the (column block, row group) grid in bands of GROUP_K column blocks;
    # 8 or 24 blocks in bands of 3 leave a partial last band (8) or none (24). A tile the order
    # skipped would keep torch.empty's garbage, a tile done twice nothing: compare everything.
    # requant is persistent: 20 programs (5 per "SM", 4 under the interpreter) over 24 or 72 tiles.
    monkeypatch.setitem(Q.LAUNCH, "requant_colwise", dict(BLOCK_K=32, num_warps=1, GROUP_K=3, STAGES=2, PROGS_PER_SM=5))
    monkeypatch.setitem(Q.LAUNCH, "dequant_swiglu_quant_colwise", dict(BLOCK_K=16, num_warps=1, GROUP_K=3))
    inp = Q.quant_rowwise_ref(make_x(272, K, torch.bfloat16, seed=K).clamp(-60, 60))
    assert_fp8_equal(Q.requant_colwise(inp, impl="triton"), Q.requant_colwise_ref(inp), exact=False)
    assert_fp8_equal(Q.dequant_swiglu_quant_colwise(inp, impl="triton"), Q.dequant_swiglu_quant_colwise_ref(inp),
                     exact=False)


# quant_rowwise_colwise = quant_rowwise(colmajor_scale) then requant_colwise. Under the interpreter
# the reference within the interpreter's cast bugs; on a GPU, bit for bit.


def check_rowwise_colwise(x: torch.Tensor, fmt: str, exact: bool) -> None:
    r, c = Q.quant_rowwise_colwise(x, fmt, impl="triton")
    assert_fp8_equal(r, Q.quant_rowwise_ref(x, fmt, colmajor_scale=True), exact=exact)
    # col-wise from the kernel's own row-wise codes (under the interpreter they carry its cast bugs)
    assert_fp8_equal(c, Q.requant_colwise_ref(r, fmt), exact=exact)
    if exact:
        assert_fp8_equal(c, Q.quant_rowwise_colwise_ref(x, fmt)[1], exact=True)
    r2 = Q.quant_rowwise(x, fmt, impl="triton", colmajor_scale=True)
    assert_fp8_equal(r, r2, exact=True)
    assert_fp8_equal(c, Q.requant_colwise(r2, fmt, impl="triton"), exact=True)


@pytest.mark.interp
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("M,K", [(1, 256), (200, 256), (144, 384), (256, 128)])
def test_triton_interpreter_rowwise_colwise(fmt, M, K):
    x = make_x(M, K, torch.bfloat16, seed=M + K)
    x[: min(M, 3), :128] = 0  # all-zero 1x128 groups: the amax clamp
    check_rowwise_colwise(x, fmt, exact=False)


def check_swiglu_quant_cache(h: torch.Tensor, fmt: str, exact: bool, colmajor: bool = True) -> None:
    """swiglu_quant_cache = (quant_rowwise(h), swiglu_quant(h)) in one kernel, both with the scale
    order asked for."""
    h8, a8 = Q.swiglu_quant_cache(h, fmt, impl="triton", colmajor_scale=colmajor)
    assert_fp8_equal(h8, Q.quant_rowwise(h, fmt, impl="triton", colmajor_scale=colmajor), exact=True)
    assert_fp8_equal(a8, Q.swiglu_quant(h, fmt, impl="triton", colmajor_scale=colmajor), exact=True)
    assert_fp8_equal(h8, Q.quant_rowwise_ref(h, fmt, colmajor_scale=colmajor), exact=exact)
    assert_fp8_equal(a8, Q.swiglu_quant_ref(h, fmt, colmajor_scale=colmajor), exact=exact,
                     scale_rtol=0.0 if exact or fmt == "pow2" else 1e-6)  # numpy's exp2 vs torch's


@pytest.mark.interp
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("M,I,colmajor", [(1, 128, True), (200, 256, True), (9, 128, True), (200, 256, False)])
def test_triton_interpreter_swiglu_quant_cache(fmt, M, I, colmajor):
    check_swiglu_quant_cache(make_x(M, 2 * I, torch.bfloat16, seed=M + I).clamp(-60, 60), fmt, exact=False,
                             colmajor=colmajor)


def test_fused_pairs_ref_and_errors():
    x = make_x(300, 256, torch.float32, seed=5)
    r, c = Q.quant_rowwise_colwise(x)  # CPU: the reference
    assert r.layout == "1x128" and c.layout == "128x1" and c.data.shape == (256, 300)
    assert_fp8_equal(c, Q.requant_colwise_ref(Q.quant_rowwise_ref(x, colmajor_scale=True)), exact=True)
    with pytest.raises(ValueError, match="200 is not divisible by 128"):
        Q.quant_rowwise_colwise(torch.zeros(4, 200))
    with pytest.raises(ValueError, match=r"expected x \[M, K\], got shape \(2, 4, 128\)"):
        Q.quant_rowwise_colwise(torch.zeros(2, 4, 128))
    h8, a8 = Q.swiglu_quant_cache(x)  # CPU: the references
    assert_fp8_equal(h8, Q.quant_rowwise_ref(x), exact=True)
    assert_fp8_equal(a8, Q.swiglu_quant_ref(x), exact=True)
    with pytest.raises(ValueError, match=r"I % 128 == 0, got shape \(4, 384\)"):
        Q.swiglu_quant_cache(torch.zeros(4, 384))


# Scale storage (moefp8.fp8): "1x128" producers write column-major scales on request (GEMM
# operands), "128x1" scales are always column-major, and every kernel that reads "1x128" scales
# gives the same result from either order. M = 144 takes requant's words kernel, 200 the generic one.


def check_scale_layouts(device: str, exact: bool) -> None:
    for M in (144, 200):
        x = make_x(M, 512, torch.bfloat16, seed=M, device=device).clamp(-60, 60)
        for fn, ref in ((Q.quant_rowwise, Q.quant_rowwise_ref), (Q.swiglu_quant, Q.swiglu_quant_ref)):
            row, col = fn(x, impl="triton"), fn(x, impl="triton", colmajor_scale=True)
            assert row.scale.is_contiguous() and col.scale.stride(0) == 1 and col.scale.t().is_contiguous()
            assert torch.equal(row.scale, col.scale) and torch.equal(row.data.view(torch.uint8),
                                                                    col.data.view(torch.uint8))
            assert_fp8_equal(col, ref(x, colmajor_scale=True), exact=exact)  # the reference stores the same order
        x8 = Q.quant_rowwise_ref(x)
        x8c = Fp8Tensor(x8.data, col_major(x8.scale), "1x128")
        for fn in (Q.requant_colwise, Q.dequant_swiglu_quant_colwise):
            for fmt in FMTS:
                got, want = fn(x8c, fmt, impl="triton"), fn(x8, fmt, impl="triton")
                assert got.scale.stride(0) == 1 and got.scale.t().is_contiguous()  # "128x1": column-major
                assert_fp8_equal(got, want, exact=True)  # same kernel, same values: the read order is free
        assert Q.quant_colwise(x, impl="triton").scale.stride(0) == 1


@pytest.mark.interp
def test_triton_interpreter_scale_layouts():
    check_scale_layouts("cpu", exact=False)


@pytest.mark.gpu
def test_triton_gpu_scale_layouts():
    check_scale_layouts("cuda", exact=True)


@pytest.mark.interp
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # numpy: Inf * 0
@pytest.mark.parametrize("M", [144, 200])
def test_triton_interpreter_requant_nonfinite_scales(M):
    # Scale-half of the contract for both requant kernels: a NaN code is ignored by the amax; an
    # Inf row scale on nonzero codes gives +-Inf values, so their "128x1" tiles get scale Inf.
    inp = requant_nonfinite_input(M)
    want = Q.requant_colwise_ref(inp).scale
    inf_cols = torch.arange(128, 256) != 200  # column 200: code 0 * Inf = NaN, ignored
    assert torch.isinf(want[128:, 0][inf_cols]).all() and torch.isfinite(want[200, 0])
    assert torch.isinf(want[:128, 1]).all() and torch.isfinite(want[:128, 0]).all()
    assert torch.isfinite(want[128:, 1]).all()
    assert torch.equal(Q.requant_colwise(inp, impl="triton").scale, want)


def test_dispatcher_picks_reference_on_cpu(monkeypatch):
    called = []
    monkeypatch.setattr(Q, "quant_rowwise_ref", lambda x, f="pow2", **kw: called.append(1) or "ref")
    assert Q.quant_rowwise(torch.zeros(1, 128)) == "ref" and called


# ----------------------------------------------------------------------------------------------
# Errors name the offending value


def test_errors():
    with pytest.raises(ValueError, match="100 is not divisible by 128"):
        Q.quant_rowwise(torch.zeros(4, 100))
    with pytest.raises(ValueError, match="not divisible by 128"):
        Q.quant_weight(torch.zeros(256, 200))
    with pytest.raises(ValueError, match="scale_fmt='e8m0'"):
        Q.quant_rowwise(torch.zeros(4, 128), "e8m0")
    with pytest.raises(TypeError, match="torch.int32"):
        Q.quant_rowwise(torch.zeros(4, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="layout '1x128'"):
        Q.requant_colwise(Q.quant_colwise_ref(torch.zeros(4, 128)))
    with pytest.raises(ValueError, match=r"I % 128 == 0, got shape \(4, 384\)"):
        Q.swiglu_quant(torch.zeros(4, 384))
    with pytest.raises(ValueError, match="impl='cuda'"):
        Q.quant_rowwise(torch.zeros(4, 128), impl="cuda")


# ----------------------------------------------------------------------------------------------
# GPU: Triton bit-exact against the reference (run on the same device), many shapes

# (8208, 1024): 520 col-wise tiles, more than the persistent requant kernel has programs, and a partial last group
GPU_SHAPES = [(1, 128), (127, 384), (128, 640), (129, 2048), (1000, 7168), (1040, 384), (4113, 4096), (16384, 256),
              (8208, 1024)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("M,K", GPU_SHAPES)
def test_triton_gpu_bit_exact(name, fmt, M, K):
    prep, fn, ref = KERNELS[name]
    if "swiglu" in name and K % 256:
        K *= 2  # h is [M, 2I] with I % 128 == 0
    for seed in range(2):  # fresh inputs each time
        x = make_x(M, K, torch.bfloat16, seed=seed * 1000 + M + K, device="cuda")
        inp = prep(x)
        got = fn(inp, fmt)  # default dispatch: Triton on CUDA
        want = ref(inp, fmt)
        torch.cuda.synchronize()
        assert_fp8_equal(got, want, exact=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("M,K", GPU_SHAPES)
def test_triton_gpu_fused_pairs_bit_exact(fmt, M, K):
    for seed in range(2):
        check_rowwise_colwise(make_x(M, K, torch.bfloat16, seed=seed * 1000 + M + K, device="cuda"), fmt, exact=True)
    z = requant_nonfinite_input(200, "cuda").dequantize()  # NaN and Inf inputs: as the two kernels
    check_rowwise_colwise(z, fmt, exact=True)
    if K % 256 == 0:
        h = make_x(M, K, torch.bfloat16, seed=M, device="cuda").clamp(-60, 60)
        check_swiglu_quant_cache(h, fmt, exact=True)
        check_swiglu_quant_cache(h, fmt, exact=True, colmajor=False)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
def test_triton_gpu_nonfinite_and_fp32_input(fmt):
    x = nonfinite_input().cuda()
    check_nonfinite_contract(Fp8Tensor(*[t.cpu() for t in Q.quant_rowwise(x, fmt)[:2]], "1x128"), x.cpu(), fmt)
    y = make_x(300, 1024, torch.float32, device="cuda")
    assert_fp8_equal(Q.quant_rowwise(y, fmt), Q.quant_rowwise_ref(y, fmt), exact=True)
    assert_fp8_equal(Q.quant_colwise(y, fmt), Q.quant_colwise_ref(y, fmt), exact=True)
    for M in (144, 200):  # requant_colwise: NaN codes and Inf row scales, both kernels with pow2
        z8 = requant_nonfinite_input(M, "cuda")
        got, want = Q.requant_colwise(z8, fmt), Q.requant_colwise_ref(z8, fmt)
        assert torch.isnan(want.dequantize()[5, 3]) and torch.isinf(want.scale[:128, 1]).all()
        assert_fp8_equal(got, want, exact=True)


# ----------------------------------------------------------------------------------------------
# quant_weight(transposed=True): the weight and dgrad's transposed copy from one pass


def check_weight_pair(shape, fmt, device, exact):
    w = make_x(math.prod(shape[:-1]), shape[-1], torch.float32, seed=sum(shape)).view(shape).to(device)
    q8, qt8 = Q.quant_weight(w, fmt, impl="triton" if device == "cpu" else None, transposed=True)
    want = Q.quant_weight_ref(w.cpu(), fmt)
    assert_fp8_equal(q8, want, exact=exact)
    assert_fp8_equal(qt8, Q.transpose_weight_ref(want), exact=exact)
    assert qt8.data.shape == (*shape[:-2], shape[-1], shape[-2]) and qt8.data.is_contiguous()
    # the transposed copy is the same codes as the kernel's own q8, transposed (no second rounding)
    assert torch.equal(qt8.data.view(torch.uint8).cpu(), q8.data.view(torch.uint8).transpose(-1, -2).cpu())
    from moefp8.kernels.grouped_gemm import transpose_weight
    assert_fp8_equal(qt8, transpose_weight(q8), exact=True)  # the separate transpose it replaces


@pytest.mark.interp
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("shape", [(256, 128), (128, 384), (3, 256, 256)])
def test_quant_weight_transposed_interpreter(shape, fmt):
    check_weight_pair(shape, fmt, "cpu", exact=False)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("shape", [(2048, 7168), (7168, 2048), (16, 2816, 2048), (16, 2048, 1408)])
def test_quant_weight_transposed_gpu(shape, fmt):
    check_weight_pair(shape, fmt, "cuda", exact=True)


def test_quant_weight_transposed_reference_and_errors():
    w = torch.randn(2, 256, 384)
    q8, qt8 = Q.quant_weight(w, transposed=True)  # CPU: the reference twins
    assert_fp8_equal(qt8, Q.transpose_weight_ref(Q.quant_weight_ref(w)), exact=True)
    assert torch.equal(qt8.dequantize(torch.float32), q8.dequantize(torch.float32).transpose(-1, -2))
    with pytest.raises(ValueError, match="transposed needs N % 128 == 0, got N=200"):
        Q.quant_weight(torch.randn(200, 256), transposed=True)
