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

