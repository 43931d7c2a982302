"""The router's selection and load count (moefp8.kernels.route): the reference against a per-token
selection written independently, the Triton kernel (interpreter on CPU, compiled on GPU) against the
reference bit for bit -- ids in order and loads -- on the presets' shapes, odd token counts, ties,
no tokens; bad input."""

import pytest
import torch

from moefp8.kernels.route import route_select, route_select_ref

# (E, K, n_groups, topk_groups): small, 3B, v2_lite, DeepSeek-V3, groups of one expert, every expert picked
SHAPES = [(8, 2, 4, 2), (32, 4, 4, 2), (64, 6, 1, 1), (256, 8, 8, 4), (12, 2, 12, 3), (8, 8, 2, 2)]


def select_ref(s: torch.Tensor, b: torch.Tensor, k: int, n_groups: int, topk_groups: int) -> list[list[int]]:
    """Straightforward per-token selection, written independently of the vectorized one; ties to the lower id."""
    T, E = s.shape
    per = E // n_groups
    out = []
    for t in range(T):
        biased = [float(s[t, e] + b[e]) for e in range(E)]
        allowed = range(E)
        if n_groups > 1:
            gs = []
            for g in range(n_groups):
                vals = sorted(biased[g * per:(g + 1) * per], reverse=True)
                gs.append((-sum(vals[:2]), g))
            groups = [g for _, g in sorted(gs)[:topk_groups]]
            allowed = [e for e in range(E) if e // per in groups]
        out.append(sorted(allowed, key=lambda e: (-biased[e], e))[:k])
    return out


def scores(T, E, seed, ties=False, dtype=torch.float32):
    """Sigmoid-like scores [T, E] and a bias [E]; with ties, both on a grid of 4 levels (many equal
    biased scores and group sums, so the tie order is what is tested)."""
    g = torch.Generator().manual_seed(seed)
    s, b = torch.rand(T, E, generator=g, dtype=torch.float64), torch.randn(E, generator=g, dtype=torch.float64) * 0.1
    if ties:
        s, b = (s * 4).floor() / 4, (b * 0).to(torch.float64)
    return s.to(dtype), b.to(dtype)


@pytest.mark.parametrize("E,k,n_groups,topk_groups", SHAPES)
@pytest.mark.parametrize("ties", [False, True])
def test_reference_matches_per_token_selection(E, k, n_groups, topk_groups, ties):
    s, b = scores(61, E, E + k, ties, torch.float64)
    idx, load = route_select_ref(s, b, k, n_groups, topk_groups)
    assert idx.tolist() == select_ref(s, b, k, n_groups, topk_groups)  # ids in descending biased score
    assert idx.is_contiguous()  # as torch.topk's were (callers view them flat)
    assert load.dtype == torch.int64 and load.tolist() == [int((idx == e).sum()) for e in range(E)]
    if n_groups > 1:  # group-limited: a token's experts span at most topk_groups groups
        assert all(len({e // (E // n_groups) for e in r.tolist()}) <= topk_groups for r in idx)


def check_kernel(T, E, k, n_groups, topk_groups, ties, device):
    s, b = scores(T, E, T + E, ties)
    s, b = s.to(device), b.to(device)
    idx, load = route_select(s, b, k, n_groups, topk_groups, impl="triton")
    want_idx, want_load = route_select_ref(s, b, k, n_groups, topk_groups)
    assert idx.dtype == torch.int64 and idx.shape == (T, k) and load.dtype == torch.int64 and load.shape == (E,)
    assert torch.equal(idx.cpu(), want_idx.cpu()) and torch.equal(load.cpu(), want_load.cpu())


@pytest.mark.interp
@pytest.mark.parametrize("E,k,n_groups,topk_groups", SHAPES)
@pytest.mark.parametrize("T,ties", [(1, False), (37, False), (37, True)])
def test_interpreter_vs_ref(T, E, k, n_groups, topk_groups, ties):
    check_kernel(T, E, k, n_groups, topk_groups, ties, "cpu")


@pytest.mark.interp
def test_interpreter_no_tokens_and_strided_scores():
    s, b = scores(40, 32, 5)
    idx, load = route_select(s[:0], b, 4, 4, 2, impl="triton")
    assert idx.shape == (0, 4) and load.tolist() == [0] * 32
    wide = torch.zeros(40, 48)
    wide[:, :32] = s  # a row stride that is not E
    got = route_select(wide[:, :32], b, 4, 4, 2, impl="triton")
    want = route_select_ref(s, b, 4, 4, 2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def nan_scores(device):
    """Rows with NaN scores: one entirely, one half, one a single expert (a diverged router)."""
    s, b = scores(9, 32, 7)
    s[1] = float("nan")
    s[2, :16] = float("nan")
    s[3, 5] = float("nan")
    return s.to(device), b.to(device)


def check_nan(idx, load):
    assert idx[1].tolist() == [0, 1, 2, 3]  # all NaN: the lowest ids, distinct (groups 0 and 1 kept)
    assert all(len(set(r)) == 4 and all(0 <= e < 32 for e in r) for r in idx.tolist())
    assert 5 not in idx[3].tolist() and all(e >= 16 for e in idx[2].tolist())  # NaN picked last
    assert int(load.sum()) == 9 * 4


def test_reference_nan_scores_are_picked_last():
    check_nan(*route_select_ref(*nan_scores("cpu"), 4, 4, 2))


@pytest.mark.interp
@pytest.mark.filterwarnings("ignore:overflow encountered in add")  # -FLT_MAX + -FLT_MAX: -inf, as on the GPU
def test_interpreter_nan_scores_as_the_reference():
    got, want = route_select(*nan_scores("cpu"), 4, 4, 2, impl="triton"), route_select_ref(*nan_scores("cpu"), 4, 4, 2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    check_nan(*got)


@pytest.mark.gpu
@pytest.mark.parametrize("E,k,n_groups,topk_groups", SHAPES)
@pytest.mark.parametrize("T,ties", [(1, False), (4099, False), (4099, True)])
def test_gpu_vs_ref(T, E, k, n_groups, topk_groups, ties):
    check_kernel(T, E, k, n_groups, topk_groups, ties, "cuda")


@pytest.mark.gpu
def test_gpu_route_select_does_not_sync():
    s, b = scores(4096, 64, 1)
    s, b = s.cuda(), b.cuda()
    route_select(s, b, 6)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        idx, load = route_select(s, b, 6)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(load.sum()) == 4096 * 6




@pytest.mark.parametrize("shape,k,groups,msg", [
    ((5, 8), 9, (1, 1), "topk=9 of 8 experts"),
    ((5, 8), 2, (3, 1), "n_groups=3"),
    ((5, 8), 4, (4, 1), "topk=4 of 8 experts in topk_groups=1 of n_groups=4"),
    ((5,), 1, (1, 1), r"scores \[T, E\]"),
])
def test_bad_input(shape, k, groups, msg):
    with pytest.raises(ValueError, match=msg):
        route_select(torch.rand(*shape), torch.zeros(8), k, *groups)
