"""Permute / unpermute-combine: layout invariants, exact data movement, gradients vs float64."""

import pytest
import torch

from moefp8.fp8 import Fp8Tensor, col_major
from moefp8.kernels import permute as P
from moefp8.kernels.quant import quant_rowwise_ref, requant_colwise_ref
from moefp8.testing import assert_fp8_equal, scale_storage


def routing(T: int, K: int, E: int, kind: str = "random", seed: int = 0, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "random":  # distinct experts per token
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
    elif kind == "one_expert":  # every token's first slot to expert 0, others unrouted
        idx = torch.full((T, K), -1)
        idx[:, 0] = 0
    elif kind == "skewed":  # a hot expert, an empty one, unrouted slots
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        idx[: T // 2, 0] = 1
        idx[idx == 2] = -1
    elif kind == "unrouted":  # no slot routed here (a rank none of whose experts was picked)
        idx = torch.full((T, K), -1)
    elif kind == "noisy":  # repeats within a token, negative ids other than -1
        idx = torch.randint(-3, E, (T, K), generator=g)
    return idx.long().to(device)


CASES = [(37, 3, 5, "random"), (120, 4, 8, "skewed"), (130, 2, 4, "one_expert"), (0, 4, 3, "random"),
         (1, 1, 1, "random")]


def check_layout(L: P.PermuteLayout, idx: torch.Tensor, E: int) -> None:
    T, K = idx.shape
    counts = torch.bincount(idx[idx >= 0].cpu(), minlength=E).tolist()
    assert L.counts == counts and L.num_experts == E
    off = L.offsets.cpu().tolist()
    assert off[0] == 0 and all(o % 128 == 0 for o in off) and L.M == off[-1]
    assert all(off[e + 1] - off[e] == -(-counts[e] // 128) * 128 for e in range(E))
    row, src = L.row_TK.cpu().long(), L.src_M.cpu().long()
    assert torch.equal(row < 0, idx.cpu() < 0)
    pairs = torch.arange(T * K).view(T, K)
    assert torch.equal(src[row[row >= 0]], pairs[row >= 0])  # row and src are inverse maps
    assert (src >= 0).sum() == sum(counts)
    for e in range(E):  # deterministic: ascending (token, slot) inside each segment, then padding
        seg = src[off[e]: off[e + 1]]
        real = seg[: counts[e]]
        assert torch.all(real >= 0) and torch.all(seg[counts[e]:] == -1)
        assert torch.all(real[1:] > real[:-1]) and torch.all(idx.cpu().view(-1)[real] == e)


@pytest.mark.parametrize("T,K,E,kind", CASES)
def test_build_layout(T, K, E, kind):
    idx = routing(T, K, E, kind)
    L = P.build_layout(idx, E)
    check_layout(L, idx, E)
    L2 = P.build_layout(idx.int(), E)  # int32 input, same answer: deterministic
    assert torch.equal(L.src_M, L2.src_M) and torch.equal(L.row_TK, L2.row_TK)


@pytest.mark.parametrize("T,K,E,kind", CASES + [(129, 1, 3, "noisy"), (77, 5, 6, "unrouted")])
def test_build_layout_with_the_dispatchs_counts(T, K, E, kind):
    """The counts an EP dispatch brings (`Dispatched.counts`): the same layout without the read-back; the
    reference raises where they are not the ids' counts (the Triton path trusts them, test below)."""
    from moefp8.kernels.pack import pairs_per_expert

    idx = routing(T, K, E, kind)
    counts = pairs_per_expert(idx, E).tolist()
    assert counts == torch.bincount(idx[(idx >= 0) & (idx < E)], minlength=E).tolist()
    assert_same_layout(P.build_layout(idx, E, counts=counts), P.build_layout(idx, E))
    if T and (idx >= 0).any():
        wrong = [c + (e == 0) for e, c in enumerate(counts)]
        with pytest.raises(ValueError, match="the given counts .* are not the ids'"):
            P.build_layout(idx, E, counts=wrong)
    with pytest.raises(ValueError, match=f"{E + 1} counts for {E} experts"):
        P.build_layout(idx, E, counts=[0] * (E + 1))


def check_bound(B: P.PermuteLayout, exact: P.PermuteLayout, T: int, K: int, E: int) -> None:
    """A bound layout (EP = 1, no read-back) against the exact one: the same pairs, rows and offsets; its rows run
    on to the static `rows_bound`, those past offsets[E] padding; no counts on the host."""
    assert B.counts is None and B.offsets_host is None and B.num_experts == E
    assert B.M == P.rows_bound(T * K, E) >= exact.M and B.M % 128 == 0 and B.src_M.numel() == B.M
    for name in ("row_TK", "offsets"):
        assert torch.equal(getattr(B, name).cpu(), getattr(exact, name).cpu()), name
    src = B.src_M.cpu()
    assert torch.equal(src[:exact.M], exact.src_M.cpu()) and torch.all(src[exact.M:] == -1)


@pytest.mark.parametrize("T,K,E,kind", CASES + [(77, 5, 6, "unrouted"), (129, 1, 3, "noisy"), (3, 8, 256, "random")])
def test_build_layout_bound(T, K, E, kind):
    idx = routing(T, K, E, kind)
    check_bound(P.build_layout(idx, E, bound=True), P.build_layout(idx, E), T, K, E)
    with pytest.raises(ValueError, match="counts and bound=True each size the rows"):
        P.build_layout(idx, E, counts=[0] * E, bound=True)


def check_cap(C: P.PermuteLayout, exact: P.PermuteLayout, cap: int) -> None:
    """A capped layout against the exact one: where the pairs fit, the same layout with padding past
    offsets[E] (as the bound's) and no overflow; where they do not, the overflow flag, the offsets clamped,
    the pairs within the cap at their exact rows and those past it without a row."""
    assert C.counts is None and C.M == cap == C.src_M.numel() and C.overflow.shape == (1,)
    fits = exact.M <= cap
    assert int(C.overflow) == (not fits)
    assert torch.equal(C.offsets.cpu(), exact.offsets.cpu().clamp(max=cap))
    rows = exact.row_TK.cpu()
    assert torch.equal(C.row_TK.cpu(), torch.where(rows < cap, rows, -1))
    src = C.src_M.cpu()
    n = min(cap, exact.M)
    assert torch.equal(src[:n], exact.src_M.cpu()[:n]) and torch.all(src[n:] == -1)


CAP_CASES = [(200, 4, 8, "random"), (300, 8, 256, "skewed"), (1000, 4, 8, "one_expert"), (77, 5, 6, "unrouted"),
             (0, 8, 8, "random")]


@pytest.mark.parametrize("T,K,E,kind", CAP_CASES)
def test_build_layout_cap(T, K, E, kind):
    idx = routing(T, K, E, kind)
    exact = P.build_layout(idx, E)
    for cap in (0, 128, exact.M - 128, exact.M, exact.M + 256, P.rows_bound(T * K, E)):
        if cap >= 0:
            check_cap(P.build_layout(idx, E, cap=cap), exact, cap)
    for bad in (100, -128, 128.0):
        with pytest.raises(ValueError, match=f"cap={bad!r}, expected a multiple of 128"):
            P.build_layout(idx, E, cap=bad)
    with pytest.raises(ValueError, match="bound=True and cap each size the rows"):
        P.build_layout(idx, E, bound=True, cap=128)


def test_rows_bound_holds_every_layout():
    """The bound is never short: every expert non-empty with one pair over (the most padding), all pairs on one
    expert, fewer pairs than experts, random splits."""
    g = torch.Generator().manual_seed(0)
    for n, E in [(0, 8), (1, 8), (7, 8), (8, 8), (9, 8), (129 * 8, 8), (1000, 1), (5000, 256), (255, 256)]:
        worst = P.segment_offsets([n // E + (e < n % E) for e in range(E)])[-1] if n >= E else 128 * n
        assert P.rows_bound(n, E) >= worst and P.rows_bound(n, E) % 128 == 0
        assert P.rows_bound(n, E) >= P.segment_offsets([n] + [0] * (E - 1))[-1]
        for _ in range(20):
            cut = torch.randint(0, E, (n,), generator=g) if n else torch.zeros(0, dtype=torch.long)
            assert P.rows_bound(n, E) >= P.segment_offsets(torch.bincount(cut, minlength=E).tolist())[-1]
    pairs = 16 * 2048 * 4  # the 3B preset: <= 4096 rows (3%) past its pairs
    assert P.rows_bound(pairs, 32) - pairs <= 32 * 128


def test_pairs_per_expert_counts_no_bad_id():
    from moefp8.kernels.pack import pairs_per_expert

    idx = torch.tensor([[0, 3, -1], [3, 3, 9], [-7, 2, 0]])  # -1 / -7: not routed; 9: not an expert (counted nowhere)
    assert pairs_per_expert(idx, 4).tolist() == [2, 0, 1, 3]
    assert pairs_per_expert(idx.int(), 4).dtype == torch.int64
    assert pairs_per_expert(torch.zeros(0, 2, dtype=torch.long), 3).tolist() == [0, 0, 0]


def test_build_layout_errors():
    with pytest.raises(ValueError, match="holds expert 7, but there are only 4 experts"):
        P.build_layout(torch.tensor([[0, 7]]), 4)
    with pytest.raises(ValueError, match="expected integer topk_idx"):
        P.build_layout(torch.zeros(2, 2), 4)


@pytest.mark.parametrize("T,K,E,kind", CASES)
def test_permute_ref_moves_rows_exactly(T, K, E, kind):
    idx = routing(T, K, E, kind, seed=1)
    L = P.build_layout(idx, E)
    x8 = quant_rowwise_ref(torch.randn(T, 256) * 10)
    w = torch.rand(T, K)
    out = P.permute_fp8_ref(x8, L)
    src = L.src_M.long()
    for m in range(L.M):
        if src[m] >= 0:
            t = src[m] // K
            assert torch.equal(out.data[m].view(torch.uint8), x8.data[t].view(torch.uint8))
            assert torch.equal(out.scale[m], x8.scale[t])
        else:  # padding: zeros with scale 1 (finite, never leaks into a GEMM's result)
            assert torch.all(out.data[m].view(torch.uint8) == 0) and torch.all(out.scale[m] == 1)
    xb = x8.dequantize(torch.bfloat16)  # rows of any dtype: the same movement, padding zeros
    assert torch.equal(P.permute_rows_ref(xb, L), out.dequantize(torch.bfloat16))
    scaled = P.permute_fp8_ref(x8, L, w)
    ok = src >= 0
    wrow = w.view(-1)[src.clamp(min=0)]
    assert torch.equal(scaled.scale[ok], out.scale[ok] * wrow[ok, None])
    assert torch.equal(scaled.data.view(torch.uint8), out.data.view(torch.uint8))


def test_permute_then_combine_round_trip():
    T, K, E, H = 50, 4, 6, 384
    idx = routing(T, K, E, "skewed", seed=2)
    L = P.build_layout(idx, E)
    x = torch.randn(T, H).bfloat16()
    x8 = quant_rowwise_ref(x)
    y = P.permute_fp8_ref(x8, L).dequantize(torch.bfloat16)
    ones = torch.ones(T, K)
    back = P.unpermute_combine_ref(y, L, ones)
    n_routed = (idx >= 0).sum(1, keepdim=True).float()
    assert torch.equal(back.float(), (x8.dequantize() * n_routed).bfloat16().float())


def test_combine_and_backward_ref_vs_float64():
    T, K, E, H = 64, 4, 8, 256
    torch.manual_seed(3)
    idx = routing(T, K, E, "skewed", seed=3)
    L = P.build_layout(idx, E)
    y = torch.randn(L.M, H).bfloat16()
    w = torch.rand(T, K)
    # float64 autograd of out = sum_k w * y[row] over routed slots
    y64 = y.double().requires_grad_()
    w64 = w.double().requires_grad_()
    r = L.row_TK.long()
    ok = (r >= 0).double()
    out64 = (w64[:, :, None] * ok[:, :, None] * y64[r.clamp(min=0)]).sum(1)
    dz = torch.randn(T, H).bfloat16()
    out64.backward(dz.double())
    out = P.unpermute_combine_ref(y, L, w)
    # fp32 products and sum of K terms (error <= (K + 1) 2**-24 of the magnitude sum: matters where
    # the terms cancel), then bf16 rounding (half an ulp: 2**-8 relative) of the fp32 result
    mag = (w64[:, :, None] * ok[:, :, None] * y64[r.clamp(min=0)]).abs().sum(1).detach()
    fp32_err = mag * (K + 1) * 2**-24
    bound = (out64.detach().abs() + fp32_err) * 2**-8 + fp32_err
    assert torch.all((out.double() - out64.detach()).abs() <= bound + 1e-30)
    dy, dw = P.combine_backward_ref(dz, y, L, w)
    # dw: fp32 dot products of H terms: relative error ~H * 2**-24 of the magnitude sum
    bound = (y[r.clamp(min=0)].double().abs() * dz.double().abs()[:, None]).sum(-1) * H * 2**-24
    assert torch.all((dw.double() - w64.grad).abs() <= bound + 1e-30)
    assert torch.all(dw[r < 0] == 0)
    # dy = w * dz at routed rows (bf16-rounded), padding rows untouched zeros
    assert torch.equal(dy.float(), y64.grad.bfloat16().float())


# ----------------------------------------------------------------------------------------------
# Triton vs reference: interpreter (data movement exact; bf16 stores truncate there, so combine
# outputs are compared within one bf16 ulp) and GPU (bit-exact; dw by fp32 reassociation bound)


def _compare_all(T, K, E, kind, H, device, exact: bool):
    idx = routing(T, K, E, kind, seed=T + K, device=device)
    L = P.build_layout(idx, E)
    x8 = quant_rowwise_ref(torch.randn(T, H, device=device) * 5)
    w = torch.rand(T, K, device=device)
    x8c = x8._replace(scale=col_major(x8.scale))  # scales read in either order,
    for sb, col in ((None, False), (w, False), (None, True), (w, True)):  # written in either order on request
        a, b = P.permute_fp8(x8c if col else x8, L, sb, impl="triton", colmajor_scale=col), P.permute_fp8_ref(x8, L, sb)
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)
        assert scale_storage(a.scale) == scale_storage(P.permute_fp8_ref(x8, L, sb, colmajor_scale=col).scale)
        if L.M > 1:
            assert a.scale.stride() == ((1, L.M) if col else (H // 128, 1))
    xb = torch.randn(T, H, device=device).bfloat16()
    assert torch.equal(P.permute_rows(xb, L, impl="triton"), P.permute_rows_ref(xb, L))
    y = torch.randn(L.M, H, device=device).bfloat16()
    dz = torch.randn(T, H, device=device).bfloat16()
    a, b = P.unpermute_combine(y, L, w, impl="triton"), P.unpermute_combine_ref(y, L, w)
    (dy_a, dw_a), (dy_b, dw_b) = P.combine_backward(dz, y, L, w, impl="triton"), P.combine_backward_ref(dz, y, L, w)
    # add_TH: the shared experts' output added in the same pass, the bits of the separate BF16 add
    # (a strided view, and values where the sum cancels: -a)
    add = torch.cat([torch.randn(T, H, device=device).bfloat16(), -b], 1)[:, :H] if T % 2 else -b
    a_add, b_add = P.unpermute_combine(y, L, w, impl="triton", add_TH=add), P.unpermute_combine_ref(y, L, w, add)
    assert torch.equal(b_add, b + add) and torch.isfinite(a_add.float()).all()
    if exact:
        assert torch.equal(a, b) and torch.equal(dy_a, dy_b) and torch.equal(a_add, b_add)
    else:
        assert torch.all((a.float() - b.float()).abs() <= b.float().abs() * 2**-7)
        assert torch.all((dy_a.float() - dy_b.float()).abs() <= dy_b.float().abs() * 2**-7)
        # (two truncating casts under the interpreter: up to two ulps)
        assert torch.all((a_add.float() - b_add.float()).abs() <= (b.float().abs() + add.float().abs()) * 2**-6)
    scale = float(dw_b.abs().max()) if dw_b.numel() else 0.0
    assert torch.allclose(dw_a, dw_b, rtol=1e-5, atol=1e-5 * scale + 1e-30)
    _, dw_only = P.combine_backward(dz, y, L, w, want_dy=False, impl="triton")
    assert torch.equal(dw_only, dw_a)
    # dz in FP8, as the EP dispatch delivers it (rows of a wider receive buffer, scales in either
    # order, power-of-two or fp32 scales): the same as the kernel on its BF16 dequantization. With
    # power-of-two scales q x s is exact in BF16, so bit for bit under the interpreter too; fp32
    # scales round there (the interpreter truncates its bf16 casts: one ulp)
    x = torch.randn(T, H, device=device) * 3
    x[::7, :5] *= 200  # outliers: tiles with other scales
    pow2, fp32s = quant_rowwise_ref(x), quant_rowwise_ref(x, "fp32")
    buf = torch.zeros(T, H + 64, dtype=torch.uint8, device=device)
    buf[:, 16:16 + H] = pow2.data.view(torch.uint8)
    in_buffer = Fp8Tensor(buf[:, 16:16 + H].view(torch.float8_e4m3fn), pow2.scale, "1x128")
    for d8, bits in ((pow2, True), (in_buffer, True), (pow2._replace(scale=col_major(pow2.scale)), True),
                     (fp32s, exact)):
        for want_dy in (False, True):
            dy_8, dw_8 = P.combine_backward(d8, y, L, w, want_dy=want_dy, impl="triton")
            dy_16, dw_16 = P.combine_backward(d8.dequantize(torch.bfloat16), y, L, w, want_dy=want_dy, impl="triton")
            assert torch.isfinite(dw_8).all()
            if bits:
                assert torch.equal(dw_8, dw_16) and (not want_dy or torch.equal(dy_8, dy_16))
            else:
                scale = float(dw_16.abs().max()) if dw_16.numel() else 0.0
                assert torch.allclose(dw_8, dw_16, rtol=2**-7, atol=2**-7 * scale + 1e-30)
    ref = P.combine_backward_ref(pow2.dequantize(torch.bfloat16), y, L, w)
    assert all(torch.equal(u, v) for u, v in zip(P.combine_backward_ref(pow2, y, L, w), ref))
    with pytest.raises(ValueError, match="an FP8 dz must be '1x128'"):
        P.combine_backward(Fp8Tensor(pow2.data.t(), pow2.scale.t(), "128x1"), y, L, w, impl="triton")
    # out=: written into a given buffer (a transport's send slot: a view into a larger byte buffer)
    for impl in ("triton", None):
        raw = torch.full((T * H * 2 + 64,), 0xAB, dtype=torch.uint8, device=device)
        out = raw[32:32 + T * H * 2].view(torch.bfloat16).view(T, H)
        got = P.unpermute_combine(y, L, w, impl=impl, out=out)
        assert got.data_ptr() == out.data_ptr() and torch.equal(got, a if impl else P.unpermute_combine(y, L, w))
        assert torch.all(raw[:32] == 0xAB) and torch.all(raw[32 + T * H * 2:] == 0xAB)
    with pytest.raises(ValueError, match=r"out must be bf16 \[%d, %d\]" % (T, H)):
        P.unpermute_combine(y, L, w, impl="triton", out=torch.empty(T + 1, H, dtype=torch.bfloat16, device=device))


@pytest.mark.interp
@pytest.mark.parametrize("T,K,E,kind", CASES)
def test_triton_interpreter_vs_ref(T, K, E, kind):
    _compare_all(T, K, E, kind, 384, "cpu", exact=False)


def _check_dy_padding(T, K, E, kind, H, device, monkeypatch):
    """combine_backward's dy comes from torch.empty: its padding rows (per-expert alignment, the rows
    past offsets[E] of a bound layout, a capped layout's) must be written as zeros by the kernel.
    Every bf16 allocation here starts as NaN, so a row the kernel skips fails the comparison."""
    empty = torch.empty

    def nan_empty(*size, dtype=None, **kw):
        t = empty(*size, dtype=dtype, **kw)
        return t.fill_(float("nan")) if dtype == torch.bfloat16 else t

    idx = routing(T, K, E, kind, seed=T + 3 * K, device=device)
    exact = P.build_layout(idx, E)
    layouts = [exact, P.build_layout(idx.clamp(max=E - 1), E, bound=True), P.build_layout(idx, E, cap=exact.M + 256)]
    w = torch.rand(T, K, device=device)
    dz = torch.randn(T, H, device=device).bfloat16()
    for L in layouts:
        assert int((L.src_M < 0).sum()) > 0  # padding to write
        y = torch.randn(L.M, H, device=device).bfloat16()
        ref = P.combine_backward_ref(dz, y, L, w)[0]
        with monkeypatch.context() as m:
            m.setattr(torch, "empty", nan_empty)
            for y_ in (y, None):  # with dw and without
                dy = P.combine_backward(dz, y_, L, w, impl="triton")[0]
                assert not dy.isnan().any()
                assert torch.all((dy.float() - ref.float()).abs() <= ref.float().abs() * 2**-7)
                assert torch.equal(dy[L.src_M < 0], torch.zeros_like(dy[L.src_M < 0]))


@pytest.mark.interp
@pytest.mark.parametrize("T,K,E,kind", [(37, 2, 3, "random"), (5, 4, 8, "skewed")])
def test_combine_backward_writes_dy_padding_interpreter(monkeypatch, T, K, E, kind):
    _check_dy_padding(T, K, E, kind, 256, "cpu", monkeypatch)


@pytest.mark.gpu
def test_combine_backward_writes_dy_padding_gpu(monkeypatch):
    _check_dy_padding(4097, 8, 64, "skewed", 2048, "cuda", monkeypatch)


def _check_permute_requant(T, K, E, kind, H, device, exact: bool, cut: int | None = None):
    """permute_requant_colwise against requant_colwise(permute_fp8(...)) (the two kernels it
    replaces: bit for bit, the interpreter too) and the reference (exact on a GPU); x8's scales in
    either order. cut: the layout's first `cut` rows only (an M that is not a multiple of 128)."""
    from dataclasses import replace

    from moefp8.kernels.quant import requant_colwise

    idx = routing(T, K, E, kind, seed=T + K, device=device)
    L = P.build_layout(idx, E)
    if cut is not None:
        L = replace(L, src_M=L.src_M[:cut], M=cut)
    x = torch.randn(T, H, device=device) * 3
    x[::5, :7] *= 300  # outliers: tiles of other scales
    x8 = quant_rowwise_ref(x)
    for inp in (x8, x8._replace(scale=col_major(x8.scale))):
        got = P.permute_requant_colwise(inp, L, impl="triton")
        two = requant_colwise(P.permute_fp8(inp, L, impl="triton", colmajor_scale=True), impl="triton")
        assert got.layout == "128x1" and got.data.shape == (H, L.M) and got.scale.stride(0) == 1
        assert_fp8_equal(got, two, exact=True)
        assert_fp8_equal(got, P.permute_requant_colwise_ref(inp, L), exact=exact)
    fp32 = quant_rowwise_ref(x, "fp32")  # fp32 scales: the two kernels
    assert_fp8_equal(P.permute_requant_colwise(fp32, L, "fp32", impl="triton"),
                     P.permute_requant_colwise_ref(fp32, L, "fp32"), exact=exact)


@pytest.mark.interp
@pytest.mark.parametrize("T,K,E,kind", CASES + [(300, 4, 3, "skewed")])
def test_permute_requant_colwise_interpreter(monkeypatch, T, K, E, kind):
    from moefp8.kernels import quant as Q

    # persistent over more tiles than programs, bands of 3 column blocks (a partial last band)
    monkeypatch.setitem(Q.LAUNCH, "requant_colwise", dict(BLOCK_K=32, num_warps=1, GROUP_K=3, STAGES=2,
                                                         PROGS_PER_SM=2))
    _check_permute_requant(T, K, E, kind, 384, "cpu", exact=False)


@pytest.mark.interp
def test_permute_requant_colwise_interpreter_partial_row_group():
    """M % 128 != 0 (the masked last row group) and M % 16 != 0 (the two kernels instead)."""
    for cut in (272, 200):
        _check_permute_requant(120, 4, 3, "random", 256, "cpu", exact=False, cut=cut)


def test_permute_requant_colwise_ref_and_errors():
    idx = routing(37, 3, 5, "skewed")
    L = P.build_layout(idx, 5)
    x8 = quant_rowwise_ref(torch.randn(37, 256))
    got = P.permute_requant_colwise(x8, L)  # CPU: the reference
    assert_fp8_equal(got, requant_colwise_ref(P.permute_fp8_ref(x8, L)), exact=True)
    with pytest.raises(ValueError, match="x8 has 36 tokens but the layout was built for 37"):
        P.permute_requant_colwise(quant_rowwise_ref(torch.randn(36, 256)), L)
    with pytest.raises(ValueError, match="expected an Fp8Tensor"):
        P.permute_requant_colwise(torch.randn(37, 256), L)


def assert_same_layout(a: P.PermuteLayout, b: P.PermuteLayout) -> None:
    assert a.counts == b.counts and a.M == b.M
    for name in ("row_TK", "src_M", "offsets"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype == torch.int32 and torch.equal(x.cpu(), y.cpu()), name


LAYOUT_CASES = CASES + [(77, 5, 6, "unrouted"), (129, 1, 3, "noisy"), (50, 4, 1, "noisy"), (20, 8, 256, "random"),
                        (300, 8, 256, "skewed"), (1, 8, 256, "noisy")]


@pytest.mark.interp
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("T,K,E,kind", LAYOUT_CASES)
def test_build_layout_interpreter_vs_ref(T, K, E, kind, dtype):
    idx = routing(T, K, E, kind, seed=T + E).to(dtype)
    assert_same_layout(P.build_layout(idx, E, impl="triton"), P.build_layout_ref(idx, E))


@pytest.mark.interp
@pytest.mark.parametrize("T,K,E,kind", [(37, 3, 5, "random"), (120, 4, 8, "skewed"), (129, 1, 3, "noisy")])
def test_build_layout_interpreter_with_counts(T, K, E, kind):
    """Given counts: no read-back, the same layout; counts that undercount the ids (a caller's bug) size
    fewer rows, and the kernel writes none past them (the interpreter checks every access)."""
    idx = routing(T, K, E, kind, seed=T)
    counts = torch.bincount(idx[idx >= 0], minlength=E).tolist()
    assert_same_layout(P.build_layout(idx, E, impl="triton", counts=counts), P.build_layout_ref(idx, E))
    short = [max(0, c - 129) for c in counts]  # a whole 128-row segment fewer where there is one
    L = P.build_layout(idx, E, impl="triton", counts=short)
    assert L.M == P.segment_offsets(short)[-1] == L.src_M.numel() < P.build_layout_ref(idx, E).M
    assert int(L.row_TK.max()) < L.M  # no pair points past the rows (a later gather would read out of bounds)


@pytest.mark.interp
@pytest.mark.parametrize("T,K,E,kind", CAP_CASES)
def test_build_layout_interpreter_cap(T, K, E, kind):
    """The Triton path's cap equals the reference's, short of the pairs and past them."""
    idx = routing(T, K, E, kind, seed=T + E)
    exact = P.build_layout_ref(idx, E)
    for cap in sorted({0, 128, max(exact.M - 128, 0), exact.M, exact.M + 256}):
        got, want = P.build_layout(idx, E, impl="triton", cap=cap), P.build_layout_ref(idx, E, cap=cap)
        assert_same_layout_bound(got, want)
        assert torch.equal(got.overflow.cpu(), want.overflow.cpu())
        check_cap(got, exact, cap)


@pytest.mark.interp
@pytest.mark.parametrize("T,K,E,kind", LAYOUT_CASES)
def test_build_layout_interpreter_bound(T, K, E, kind):
    """No read-back: the kernels size nothing from the counts, and write every row up to the bound."""
    idx = routing(T, K, E, kind, seed=T + E)
    if kind == "noisy":
        idx = idx.clamp(max=E - 1)  # the bound's ids are the router's: in range (negatives: unrouted)
    got = P.build_layout(idx, E, impl="triton", bound=True)
    assert_same_layout_bound(got, P.build_layout_ref(idx, E, bound=True))
    check_bound(got, P.build_layout_ref(idx, E), T, K, E)


def assert_same_layout_bound(a: P.PermuteLayout, b: P.PermuteLayout) -> None:
    assert a.counts is None and b.counts is None and a.M == b.M
    for name in ("row_TK", "src_M", "offsets"):
        assert torch.equal(getattr(a, name).cpu(), getattr(b, name).cpu()), name


@pytest.mark.interp
def test_build_layout_interpreter_errors():
    for dtype in (torch.int64, torch.int32):
        with pytest.raises(ValueError, match="holds expert 9, but there are only 4 experts"):
            P.build_layout(torch.tensor([[0, 7], [9, -1]], dtype=dtype), 4, impl="triton")
    with pytest.raises(ValueError, match=f"holds expert {2**40}, but there are only 4 experts"):
        P.build_layout(torch.tensor([[0, 2**40]]), 4, impl="triton")  # not truncated to int32
    with pytest.raises(ValueError, match="expected integer topk_idx"):
        P.build_layout(torch.zeros(2, 2), 4, impl="triton")
    idx = torch.tensor([[-2**40 + 3, 1]])  # negative: unrouted, whatever its low bits
    assert_same_layout(P.build_layout(idx, 4, impl="triton"), P.build_layout_ref(idx, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("T,K,E,kind", [(16388, 8, 16, "random"), (4096, 8, 256, "skewed"), (4097, 8, 64, "noisy"),
                                        (1000, 4, 8, "one_expert"), (333, 2, 4, "unrouted"), (0, 8, 8, "random")])
def test_build_layout_gpu_vs_ref(T, K, E, kind):
    idx = routing(T, K, E, kind, seed=T)
    for x in (idx, idx.int()):
        ref = P.build_layout_ref(x, E)
        assert_same_layout(P.build_layout(x.cuda(), E), ref)
        assert_same_layout(P.build_layout(x.cuda(), E, counts=ref.counts), ref)  # an EP dispatch's counts: no read-back
        if kind != "noisy":  # EP = 1 (the router's ids): no read-back, no sync
            xg = x.cuda()  # the copy from the host syncs; the layout must not
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            caps = sorted({max(ref.M - 128, 0), ref.M + 256})  # short of the pairs, and past them
            try:
                got = P.build_layout(xg, E, bound=True)
                capped = [P.build_layout(xg, E, cap=c) for c in caps]
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert_same_layout_bound(got, P.build_layout_ref(x, E, bound=True))
            for c, L in zip(caps, capped):
                check_cap(L, ref, c)
    with pytest.raises(ValueError, match=f"holds expert {E + 5}, but there are only {E} experts"):
        P.build_layout(torch.cat([idx, torch.tensor([[E + 5] * K])]).cuda(), E)


@pytest.mark.gpu
@pytest.mark.parametrize("T,K,E,kind,H", [(4096, 8, 32, "random", 7168), (4097, 8, 256, "skewed", 2048),
                                          (1000, 4, 8, "one_expert", 384), (0, 8, 8, "random", 256)])
def test_triton_gpu_vs_ref(T, K, E, kind, H):
    _compare_all(T, K, E, kind, H, "cuda", exact=True)
    _check_permute_requant(T, K, E, kind, H, "cuda", exact=True)


def test_refs_with_no_row_at_all():
    """Every slot -1 (a rank that receives tokens routed to none of its experts): the references
    return zeros instead of indexing an empty tensor (found by the hypothesis round trip)."""
    from moefp8.kernels.permute import PermuteLayout, combine_backward_ref, unpermute_combine_ref

    T, K, H = 5, 2, 128
    L = PermuteLayout(torch.full((T, K), -1, dtype=torch.int32), torch.empty(0, dtype=torch.int32),
                      torch.zeros(3, dtype=torch.int64), [0, 0], 0)
    y, w, dz = torch.empty(0, H).bfloat16(), torch.rand(T, K), torch.randn(T, H).bfloat16()
    assert torch.equal(unpermute_combine_ref(y, L, w), torch.zeros(T, H).bfloat16())
    dy, dw = combine_backward_ref(dz, y, L, w)
    assert dy.shape == (0, H) and torch.equal(dw, torch.zeros(T, K))
