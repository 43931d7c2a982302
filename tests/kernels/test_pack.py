"""The dispatch send buffer: one-pass gather + pack vs its reference (same bytes, pad excepted)."""

import pytest
import torch

from moefp8.dispatch.all_to_all import row_bytes
from moefp8.kernels import pack as P
from moefp8.kernels.quant import quant_rowwise_ref

CASES = [("bf16", "none", None), ("fp8-pow2", "ue8m0", 8), ("fp8-pow2", "ue8m0", None), ("fp8-fp32", "fp32", 3)]


def run_case(payload, scales, K, T, H, device, impl):
    g = torch.Generator().manual_seed(T + H)
    xb = torch.randn(T, H, generator=g)
    x = xb.bfloat16() if payload == "bf16" else quant_rowwise_ref(xb, "fp32" if scales == "fp32" else "pow2")
    if device == "cuda":
        x = x.cuda() if payload == "bf16" else x._replace(data=x.data.cuda(), scale=x.scale.cuda())
    send = torch.randint(0, max(T, 1), (2 * T + 1,), generator=g).to(device) if T else torch.zeros(0, dtype=torch.long,
                                                                                                  device=device)
    idx = torch.randint(-1, 16, (T, K), generator=g).to(device) if K else None
    w = torch.rand(T, K, generator=g).to(device) if K else None
    nb = row_bytes(H, K, payload)
    used = 8 * (K or 0) + (2 * H if payload == "bf16" else H + (H // 128) * (1 if scales == "ue8m0" else 4))
    got = impl(x, send, nb, scales, idx, w)
    want = P.pack_rows_ref(x, send, nb, scales, idx, w)
    assert got.shape == want.shape == (send.numel(), nb)
    assert torch.equal(got[:, :used], want[:, :used])
    if K:  # local ids for each row's destination rank, and only the first n rows written
        dest = torch.randint(0, 4, (send.numel(),), generator=g).to(device)
        n = send.numel() // 2
        got = impl(x, send, nb, scales, idx, w, dest, 4, torch.tensor(n, device=device))
        want = P.pack_rows_ref(x, send, nb, scales, idx, w, dest, 4)
        assert torch.equal(got[:n, :used], want[:n, :used])
        ids = want[:, 4 * K:8 * K].view(torch.int32).long()
        gl = idx.long()[send]
        assert torch.equal(ids, torch.where((gl >= 0) & (gl // 4 == dest[:, None]), gl % 4, -1))


@pytest.mark.parametrize("payload,scales,K", CASES)
@pytest.mark.parametrize("T", [0, 5])
def test_ref_layout(payload, scales, K, T):
    H = 256
    x = torch.randn(T, H).bfloat16()
    if payload != "bf16":
        x = quant_rowwise_ref(x, "fp32" if scales == "fp32" else "pow2")
    send = torch.arange(T).flip(0)
    idx = torch.full((T, K), 3) if K else None
    w = torch.full((T, K), 0.5) if K else None
    out = P.pack_rows_ref(x, send, row_bytes(H, K, payload), scales, idx, w)
    if T and K:  # the routing fields lead each row
        assert torch.equal(out[0, :4 * K].view(torch.float32), torch.full((K,), 0.5))
        assert torch.equal(out[0, 4 * K:8 * K].view(torch.int32), torch.full((K,), 3, dtype=torch.int32))


@pytest.mark.interp
@pytest.mark.parametrize("payload,scales,K", CASES)
def test_interpreter_kernel_vs_ref(payload, scales, K):
    run_case(payload, scales, K, 6, 256, "cpu", lambda *a: P.pack_rows(*a, impl="triton"))


def test_ref_is_the_default_on_cpu():
    run_case("fp8-pow2", "ue8m0", 8, 6, 256, "cpu", P.pack_rows)


@pytest.mark.gpu
@pytest.mark.parametrize("payload,scales,K", CASES)
@pytest.mark.parametrize("T,H", [(0, 256), (7, 384), (4096, 7168)])
def test_gpu_kernel_vs_ref(payload, scales, K, T, H):
    run_case(payload, scales, K, T, H, "cuda", P.pack_rows)


LAYOUT_CASES = [(37, 3, 8, 2), (300, 8, 16, 4), (0, 2, 4, 2), (5, 2, 4, 4), (129, 8, 256, 8)]


def check_layout(T, K, E, R, device, impl):
    g = torch.Generator().manual_seed(T * K + R)
    idx = torch.randint(-1, E, (T, K), generator=g).to(device)
    sc = torch.exp2(torch.randint(-5, 5, (T, 3), generator=g).float()).to(device)
    got = P.dispatch_layout(idx, E, R, 7296, sc, impl=impl)
    want = P.dispatch_layout_ref(idx, E, R, 7296, sc)
    n = int(want[4])
    assert int(got[4]) == n and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[2][:n], want[2][:n]) and torch.equal(got[3][:n], want[3][:n])
    # the reference itself: every routed (token, rank) pair once, in (rank, token) order
    tok, dest = want[2][:n].cpu(), want[3][:n].cpu()
    pairs = sorted({(int(r), t) for t in range(T) for e in idx[t].tolist() if e >= 0 for r in [e // (E // R)]})
    assert list(zip(dest.tolist(), tok.tolist())) == pairs
    bad = ((torch.tensor([[0, E + 1]]), None, (1, E + 1)), (torch.tensor([[0, 1]]), torch.tensor([[3.0]]), (2, 0)))
    for i, s, (code, val) in bad:
        meta = P.dispatch_layout(i.to(device), E, R, 16, s.to(device) if s is not None else None, impl=impl)[0]
        assert meta[:, 2].tolist() == [code] * R and meta[:, 3].tolist() == [val] * R


@pytest.mark.interp
@pytest.mark.parametrize("T,K,E,R", LAYOUT_CASES)
def test_layout_interpreter_vs_ref(T, K, E, R):
    check_layout(T, K, E, R, "cpu", "triton")


def test_layout_ref_on_cpu():
    check_layout(37, 3, 8, 2, "cpu", None)


@pytest.mark.gpu
@pytest.mark.parametrize("T,K,E,R", LAYOUT_CASES + [(4096, 8, 256, 4)])
def test_layout_gpu_vs_ref(T, K, E, R):
    check_layout(T, K, E, R, "cuda", None)



# Fixed-capacity send buffer (the all_to_all dispatch's capacity mode)
CAP_CASES = [("fp8-pow2", "ue8m0", 7, 9, 3, 8, 2), ("bf16", "none", 5, 5, 2, 8, 4),
             ("fp8-fp32", "fp32", 6, 4, 3, 12, 3),
             ("fp8-pow2", "ue8m0", 0, 3, 2, 4, 2), ("fp8-pow2", "ue8m0", 6, 4, 2, 8, 2)]


def _capacity_inputs(payload, scales, T, K, E, H, device, seed):
    """Rows (bf16, or "1x128" FP8 with pow2 / fp32 scales), ids in [-1, E), weights: one rank's dispatch."""
    g = torch.Generator().manual_seed(seed)
    xb = torch.randn(T, H, generator=g)
    x = xb.bfloat16() if payload == "bf16" else quant_rowwise_ref(xb, "fp32" if scales == "fp32" else "pow2")
    idx = torch.randint(-1, E, (T, K), generator=g)
    w = torch.rand(T, K, generator=g)
    if device == "cuda":
        x = x.cuda() if payload == "bf16" else x._replace(data=x.data.cuda(), scale=x.scale.cuda())
        idx, w = idx.cuda(), w.cuda()
    return x, idx, w


def check_capacity(payload, scales, T, cap, K, E, R, H, device, impl):
    """The kernel writes the same bytes as the reference where it writes (routing fields of every row,
    payload of the sent rows, headers), the same positions; the cached variant likewise."""
    x, idx, w = _capacity_inputs(payload, scales, T, K, E, H, device, seed=T * K + R)
    nb, check = row_bytes(H, K, payload), scales == "ue8m0"
    got, gpos, gover = P.pack_capacity(x, idx, w, E, R, cap, nb, scales, check_scales=check, impl=impl)
    want, wpos, wover = P.pack_capacity_ref(x, idx, w, E, R, cap, nb, scales, check_scales=check)
    assert gover is None and wover is None
    assert got.shape == want.shape == (R * (cap + 1), nb) and torch.equal(gpos, wpos)
    used = 8 * K + (2 * H if payload == "bf16" else H + (H // 128) * (1 if scales == "ue8m0" else 4))
    assert torch.equal(got[:, :8 * K], want[:, :8 * K])  # every row: weights, local ids (-1 where unsent)
    hdr = got.view(R, cap + 1, nb)[:, cap, 8 * K:8 * K + 8 * P.HDR_WORDS].contiguous().view(torch.int64)
    assert hdr.tolist() == [[P.HDR_MAGIC, nb, cap, T, 3 if T > cap else 0, T if T > cap else 0]] * R
    sent = wpos.reshape(-1).long()
    sent = sent[sent >= 0]
    assert torch.equal(got[sent, :used], want[sent, :used])
    # the reference itself: row r*(cap+1)+t holds token t iff one of its experts lives on rank r
    n, El, r = min(T, cap), E // R, torch.arange(R, device=idx.device)
    on_r = ((idx[:n, None, :] >= r[None, :, None] * El) & (idx[:n, None, :] < (r[None, :, None] + 1) * El)).any(-1)
    rows = r[None, :] * (cap + 1) + torch.arange(n, device=idx.device)[:, None]
    assert torch.equal(wpos[:n].long(), torch.where(on_r, rows, -1)) and torch.all(wpos[n:] == -1)
    # out=: the same bytes written into a given buffer (a transport's send slot), returned as is
    out = torch.full((R * (cap + 1), nb), 0xAB, dtype=torch.uint8, device=idx.device)
    got2, gpos2, _ = P.pack_capacity(x, idx, w, E, R, cap, nb, scales, check_scales=check, impl=impl, out=out)
    assert got2.data_ptr() == out.data_ptr() and torch.equal(gpos2, wpos)
    assert torch.equal(got2[:, :8 * K], want[:, :8 * K]) and torch.equal(got2[sent, :used], want[sent, :used])
    with pytest.raises(ValueError, match=r"out must be a contiguous uint8 \[%d, %d\]" % (R * (cap + 1), nb)):
        P.pack_capacity(x, idx, w, E, R, cap, nb, scales, impl=impl, out=out[:, :-16])
    nb0 = row_bytes(H, None, payload)
    got = P.pack_capacity_cached(x, gpos, cap, nb0, scales, impl=impl)
    want = P.pack_capacity_cached_ref(x, gpos, cap, nb0, scales)
    assert torch.equal(got[sent, :used - 8 * K], want[sent, :used - 8 * K])
    out = torch.full((R * (cap + 1), nb0), 0xAB, dtype=torch.uint8, device=idx.device)
    got2 = P.pack_capacity_cached(x, gpos, cap, nb0, scales, impl=impl, out=out)
    assert got2.data_ptr() == out.data_ptr() and torch.equal(got2[sent, :used - 8 * K], want[sent, :used - 8 * K])
    # input errors land in every block's header: the largest bad id, else a non-pow2 scale
    if T and payload == "fp8-pow2":
        bad_idx = idx.clone()
        bad_idx[-1, 0] = E + 5
        bad_idx[(min(T, cap) - 1) // 2, K - 1] = E + 9  # the largest, on a token in the middle
        out = P.pack_capacity(x, bad_idx, w, E, R, cap, nb, scales, check_scales=True, impl=impl)[0]
        hdr = out.view(R, cap + 1, nb)[:, cap, 8 * K:8 * K + 8 * P.HDR_WORDS].contiguous().view(torch.int64)
        assert hdr[:, 4:].tolist() == ([[3, T]] * R if T > cap else [[1, E + 9]] * R)
        scale3 = x.scale.clone()
        scale3[(min(T, cap) - 1) // 2, -1] *= 3  # one scale of one token not a power of two
        out = P.pack_capacity(x._replace(scale=scale3), idx, w, E, R, cap, nb, scales, check_scales=True,
                              impl=impl)[0]
        hdr = out.view(R, cap + 1, nb)[:, cap, 8 * K:8 * K + 8 * P.HDR_WORDS].contiguous().view(torch.int64)
        assert hdr[:, 4].tolist() == [3 if T > cap else 2] * R


@pytest.mark.interp
@pytest.mark.parametrize("payload,scales,T,cap,K,E,R", CAP_CASES)
def test_capacity_interpreter_vs_ref(payload, scales, T, cap, K, E, R):
    check_capacity(payload, scales, T, cap, K, E, R, 256, "cpu", "triton")


def test_capacity_ref_on_cpu():
    check_capacity("fp8-pow2", "ue8m0", 7, 9, 3, 8, 2, 256, "cpu", None)


@pytest.mark.gpu
@pytest.mark.parametrize("payload,scales,T,cap,K,E,R", CAP_CASES + [("fp8-pow2", "ue8m0", 4096, 4096, 8, 256, 4),
                                                                    ("bf16", "none", 300, 512, 8, 256, 8)])
def test_capacity_gpu_vs_ref(payload, scales, T, cap, K, E, R):
    check_capacity(payload, scales, T, cap, K, E, R, 7168 if T >= 300 else 384, "cuda", None)


# Compacted blocks of fewer rows than the capacity (`pack_capacity(rows=B)`)
CAPPED_CASES = [("fp8-pow2", "ue8m0", 40, 48, 3, 8, 2, 30), ("bf16", "none", 37, 37, 2, 8, 4, 12),
                ("fp8-fp32", "fp32", 20, 24, 3, 12, 3, 6), ("fp8-pow2", "ue8m0", 0, 8, 2, 4, 2, 4),
                ("fp8-pow2", "ue8m0", 50, 40, 2, 8, 2, 40), ("bf16", "none", 9, 16, 2, 8, 2, 12),
                ("bf16", "none", 2100, 2100, 2, 8, 2, 1700)]  # the scan across its 1024-token blocks


def check_capped(payload, scales, T, cap, K, E, R, B, H, device, impl):
    """Block r holds the tokens that have an expert on r in token order, up to B of them, then unsent
    rows (ids -1, weights 0); the header at row B; overflow set iff some block had more than B; the
    kernel writes the reference's bytes where it writes; the cached pack of the same routes too."""
    x, idx, w = _capacity_inputs(payload, scales, T, K, E, H, device, seed=T * K + R + B)
    nb = row_bytes(H, K, payload)
    got, gpos, gover = P.pack_capacity(x, idx, w, E, R, cap, nb, scales, impl=impl, rows=B)
    want, wpos, wover = P.pack_capacity_ref(x, idx, w, E, R, cap, nb, scales, rows=B)
    assert got.shape == want.shape == (R * (B + 1), nb) and torch.equal(gpos, wpos) and torch.equal(gover, wover)
    assert torch.equal(got[:, :8 * K], want[:, :8 * K])  # every row's routing fields, the unsent rows' included
    used = 8 * K + (2 * H if payload == "bf16" else H + (H // 128) * (1 if scales == "ue8m0" else 4))
    sent = wpos.reshape(-1).long()
    sent = sent[sent >= 0]
    assert torch.equal(got[sent, :used], want[sent, :used])
    hdr = got.view(R, B + 1, nb)[:, B, 8 * K:8 * K + 8 * P.HDR_WORDS].contiguous().view(torch.int64)
    assert hdr.tolist() == [[P.HDR_MAGIC, nb, B, T, 3 if T > cap else 0, T if T > cap else 0]] * R
    # the reference itself, against the uncapped layout: the same tokens per rank, in order, the first B
    n, El, r = min(T, cap), E // R, torch.arange(R, device=idx.device)
    on_r = ((idx[:n, None, :] >= r[None, :, None] * El) & (idx[:n, None, :] < (r[None, :, None] + 1) * El)).any(-1)
    for rr in range(R):
        toks = on_r[:, rr].nonzero().flatten()
        assert torch.equal(wpos[toks[:B], rr].long(), rr * (B + 1) + torch.arange(min(len(toks), B), device=idx.device))
        assert torch.all(wpos[toks[B:], rr] == -1) and torch.all(wpos[:n][~on_r[:, rr], rr] == -1)
        # the payload of block rr's j-th row is its j-th token's, as the uncapped pack writes it
        full, _, _ = P.pack_capacity_ref(x, idx, w, E, R, cap, nb, scales)
        rows_full = (rr * (cap + 1) + toks[:B]).long()
        assert torch.equal(want[rr * (B + 1) + torch.arange(len(rows_full), device=idx.device), :used],
                           full[rows_full, :used])
    assert int(wover) == int(on_r.sum(0).max() > B if n else 0)
    nb0 = row_bytes(H, None, payload)
    assert torch.equal(P.pack_capacity_cached(x, gpos, B, nb0, scales, impl=impl)[sent, :used - 8 * K],
                       P.pack_capacity_cached_ref(x, gpos, B, nb0, scales)[sent, :used - 8 * K])
    with pytest.raises(ValueError, match=r"rows=%d, expected an integer in \[0, capacity %d\]" % (cap + 1, cap)):
        P.pack_capacity(x, idx, w, E, R, cap, nb, scales, impl=impl, rows=cap + 1)


@pytest.mark.interp
@pytest.mark.parametrize("payload,scales,T,cap,K,E,R,B", CAPPED_CASES)
def test_capped_capacity_interpreter_vs_ref(payload, scales, T, cap, K, E, R, B):
    check_capped(payload, scales, T, cap, K, E, R, B, 256, "cpu", "triton")


@pytest.mark.gpu
@pytest.mark.parametrize("payload,scales,T,cap,K,E,R,B", CAPPED_CASES + [("fp8-pow2", "ue8m0", 4096, 4096, 6, 64, 4, 3840),
                                                                          ("bf16", "none", 4096, 4096, 6, 64, 8, 2560)])
def test_capped_capacity_gpu_vs_ref(payload, scales, T, cap, K, E, R, B):
    check_capped(payload, scales, T, cap, K, E, R, B, 2048 if T >= 300 else 384, "cuda", None)
