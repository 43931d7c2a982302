"""Property-based tests (hypothesis): quantize/dequantize and permute/unpermute over random
shapes and values, through the references (the Triton kernels equal them bit for bit on GPUs)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moefp8.kernels.permute import build_layout, permute_fp8_ref, permute_rows_ref, unpermute_combine_ref
from moefp8.kernels.quant import quant_colwise_ref, quant_rowwise_ref, quant_weight_ref

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def tensors(draw, max_rows=200):
    M = draw(st.integers(1, max_rows))
    K = 128 * draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    log_scale = draw(st.floats(-30, 13))  # magnitudes from ~1e-9 up to ~1e4 (outliers)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * 2.0**log_scale
    if draw(st.booleans()):  # sparse: zeros everywhere but a few entries
        x = x * (torch.rand(M, K, generator=g) < 0.05)
    return x.to(draw(st.sampled_from([torch.float32, torch.bfloat16])))


def assert_dequant_close(q, x, s_full):
    """|x - q*s| <= half an FP8 ulp (2**-4 relative) or half the subnormal step (s * 2**-10)."""
    d = q.dequantize()
    x = x.float()
    assert torch.isfinite(d).all()
    assert torch.all((d - x).abs() <= torch.maximum(x.abs() * 2**-4, s_full * 2**-10))


@SETTINGS
@given(tensors(), st.sampled_from(["pow2", "fp32"]))
def test_rowwise_and_colwise_round_trip(x, fmt):
    q = quant_rowwise_ref(x, fmt)
    assert_dequant_close(q, x, q.scale.repeat_interleave(128, 1))
    c = quant_colwise_ref(x, fmt)
    assert_dequant_close(c, x, c.scale.repeat_interleave(128, 1)[:, : x.shape[0]].t())
    if fmt == "pow2":
        assert torch.all(torch.frexp(q.scale)[0] == 0.5) and torch.all(torch.frexp(c.scale)[0] == 0.5)


@SETTINGS
@given(tensors(max_rows=300))
def test_weight_round_trip(w):
    q = quant_weight_ref(w)
    s = q.scale.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)
    assert_dequant_close(q, w, s)


@SETTINGS
@given(st.integers(0, 60), st.integers(1, 8), st.integers(1, 12), st.integers(0, 2**31 - 1), st.floats(0, 0.5))
def test_permute_unpermute_round_trip(T, K, E, seed, p_unrouted):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, E, (T, K), generator=g)
    idx[torch.rand(T, K, generator=g) < p_unrouted] = -1  # some slots routed elsewhere
    L = build_layout(idx, E)
    x = torch.randn(T, 128, generator=g).bfloat16()
    rows = permute_rows_ref(x, L)
    assert rows.shape == (L.M, 128)
    assert torch.all(rows[L.src_M < 0] == 0)  # padding rows are zeros
    n = (idx >= 0).sum(1, keepdim=True).float()
    back = unpermute_combine_ref(rows, L, torch.ones(T, K))
    # n copies of a bf16 value summed in fp32 are exact (n <= 8), then one bf16 rounding
    assert torch.equal(back, (x.float() * n).bfloat16())
    x8 = quant_rowwise_ref(x)
    p8 = permute_fp8_ref(x8, L)
    assert torch.equal(p8.dequantize(torch.bfloat16), permute_rows_ref(x8.dequantize(torch.bfloat16), L))
