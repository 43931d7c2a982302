"""The `deepep` dispatch backend (`moefp8.dispatch.deepep`) against `all_to_all` and `local`.

GPU tests (marker `gpu`, NCCL, one process per GPU, skipped when `deep_ep` does not import):
data movement equal to the all_to_all backend's exact mode on the same inputs (rows, scales,
local ids, weights of local slots, cached dispatch, BF16 and fp32 combine, bit for bit; async
events; another SM count), a bad expert id on one rank raising on every rank, the MoE layer's
routed path stage by stage (dispatch, experts, combine, the gradient's cached FP8 dispatch, dw, the
fp32 dw combine) equal to all_to_all bit for bit, naming the first stage that differs, and the
layer (forward and gradients) equal to the all_to_all layer bit for bit and to EP=1 `local` within
the all_to_all test's bounds. Rows are compared as bytes: the FP8 test rows hold E4M3 NaNs (token
127 mod 256 encodes as 0x7F), which torch.equal never calls equal.

CPU (gloo): the same checks of the wrapper's plumbing against `fake_deep_ep` (DeepEP's Python API
over the all_to_all backend), so that the wrapper runs in CI.
"""

import sys

import pytest
import torch
import torch.distributed as dist

from test_all_to_all import (CASES_2, CASES_4, H, I, _layer_case, _need_gpus, _tokens, layer_token_counts, print_report,
                             spawn)

from moefp8.dispatch import build_dispatcher
from moefp8.dispatch.all_to_all import AllToAllDispatcher
from moefp8.moe import MoELayer
from moefp8.moe_stages import bwd_combine, bwd_dispatch, bwd_experts, fwd_dispatch, fwd_experts, fwd_layout
from moefp8.overlap import OverlapPolicy, serialized
from moefp8.recipe import Recipe


def _use_fake():
    import fake_deep_ep

    sys.modules["deep_ep"] = fake_deep_ep


def _sources(T_r, E, K, case, world, dev):
    return {s: _tokens(T_r, E, K, case, s, dev) for s in range(world)}


def _bits(t):
    """A tensor's bytes: bitwise equality, NaNs included (torch.equal says NaN != NaN)."""
    return t.contiguous().view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)


def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _check_data(rank, world, dev, T_r, E, K, case, dep):
    """deepep vs all_to_all (exact) on the same inputs: equal bit for bit."""
    a2a = AllToAllDispatcher(E, None, mode="exact")
    x8, idx, w = _tokens(T_r, E, K, case, rank, dev)
    da, dd = a2a.dispatch(x8, idx, w), dep.dispatch(x8, idx, w)
    assert _same(dd.x.data, da.x.data)
    assert torch.equal(dd.x.scale, da.x.scale) and torch.equal(dd.topk_idx, da.topk_idx)
    local = da.topk_idx >= 0  # DeepEP zeroes the weights of slots whose expert lives elsewhere
    assert torch.equal(dd.topk_w[local], da.topk_w[local]) and torch.all(dd.topk_w[~local] == 0)
    xb = (torch.arange(T_r[rank], device=dev, dtype=torch.float32)[:, None] + 0.5 * rank).expand(-1, H)
    xb = xb.bfloat16().contiguous()
    assert torch.equal(dep.dispatch(xb, handle=dd.handle).x, a2a.dispatch(xb, handle=da.handle).x)
    # the backward's FP8 dispatch along a handle: other rows and scales than the forward's
    g8, _, _ = _tokens(T_r * 2, E, K, case, rank + world, dev)  # T_r[rank] rows, another seed
    gd, ga = dep.dispatch(g8, handle=dd.handle).x, a2a.dispatch(g8, handle=da.handle).x
    assert _same(gd.data, ga.data) and torch.equal(gd.scale, ga.scale)
    # A fresh BF16 dispatch. x8's bytes 1-2 encode the token index: token 127 (mod 256) is 0x7F, an
    # E4M3 NaN, so x16 has NaN rows at the GPU sizes; a few more here so that every size has some.
    # Bytes are compared (NaN != NaN for torch.equal), NaN-free values are combined.
    x16 = x8.dequantize(torch.bfloat16)
    x16[::5, 7] = float("nan")
    d16a, d16d = a2a.dispatch(x16, idx, w), dep.dispatch(x16, idx, w)
    assert _same(d16d.x, d16a.x) and torch.equal(d16d.topk_idx, d16a.topk_idx)
    y = (d16a.x.float().nan_to_num(0.0) * (rank + 1)).bfloat16()
    assert torch.equal(dep.combine(y, dd.handle), a2a.combine(y, da.handle))
    # the routing weights' gradient: nonzero only on this rank's slots, as the layer's dw
    dw = torch.where(local, da.topk_w * (rank + 1) + 0.25, 0.0)
    back = dep.combine(dw, dd.handle)
    assert back.dtype == torch.float32 and _same(back, a2a.combine(dw, da.handle))
    back2 = dep.combine(dw, d16d.handle)  # the handle of another dispatch along the same routes
    assert _same(back2, back)
    # the event API: start after a captured event, finish on DeepEP's stream, wait, same results
    d2, ev = dep.dispatch_async(x8, idx, w, previous_event=dep.capture(), allocate_on_comm_stream=True)
    ev.current_stream_wait()
    assert _same(d2.x.data, da.x.data)
    out, ev = dep.combine_async(y, d2.handle, previous_event=dep.capture())
    ev.current_stream_wait()
    assert torch.equal(out, a2a.combine(y, da.handle))


def _data_cases(rank, world, dev, fake):
    if fake:
        _use_fake()
    cases = CASES_2 if world == 2 else CASES_4
    if dev == "cuda":
        cases = [(tuple(8 * t for t in T_r), E, K, c) for T_r, E, K, c in cases]
    for i, (T_r, E, K, case) in enumerate(cases):
        dep = build_dispatcher("deepep", E, None)
        _check_data(rank, world, dev, T_r, E, K, case, dep)
        if i == 0:
            dep.set_num_sms(24)  # another SM count: new configs, the buffer re-sized if it needs to be
            _check_data(rank, world, dev, T_r, E, K, case, dep)
            _check_bad_id(rank, dev, dep)
        dep.close()


def _check_bad_id(rank, dev, dep):
    """A bad expert id on rank 1 only: every rank raises at that dispatch; rank 1 names the id."""
    E = dep.num_experts
    x = torch.zeros(3, H, dtype=torch.bfloat16, device=dev)
    idx = torch.tensor([[0, E + 3 if rank == 1 else 1]] * 3, device=dev)
    msg = r"1 rank\(s\) of the EP group passed topk_idx holding an expert id outside"
    with pytest.raises(ValueError, match=msg) as e:
        dep.dispatch(x, idx, torch.ones(3, 2, device=dev))
    assert (f"this rank (1) passed expert {E + 3}" in str(e.value)) == (rank == 1)
    d = dep.dispatch(x + 1, idx.clamp(max=1), torch.ones(3, 2, device=dev))  # and it still works afterwards
    assert torch.equal(dep.combine(d.x, d.handle), x + 1)  # experts 0 and 1 live on rank 0: one row each


def _check_layer_stages(rank, world, dev, T_r, E, K, recipe):
    """The routed path stage by stage (moefp8.moe_stages's fwd_*/bwd_* functions, as RoutedExperts runs
    them), all_to_all (exact) vs deepep on the same inputs: every intermediate bit for bit (the
    received weights on local slots only), so that a layer difference names its stage."""
    layers = []
    for backend in ("all_to_all", "deepep"):
        torch.manual_seed(0)
        layers.append(MoELayer(H, I, E, K, n_shared=0, recipe=Recipe(recipe),
                               dispatcher=build_dispatcher(backend, E, None, mode="exact")).to(dev))
    a, b = layers
    with torch.no_grad():
        b.load_state_dict(a.state_dict())
    g = torch.Generator().manual_seed(200 + rank)
    x = torch.randn(T_r[rank], H, generator=g).bfloat16().to(dev)
    dout = torch.randn(T_r[rank], H, generator=g).bfloat16().to(dev)
    with torch.no_grad():
        r = a.router(x)
    res = []
    for L_ in layers:
        with torch.no_grad():  # the stages as RoutedExperts runs them, outside autograd
            d = fwd_dispatch(L_, x, r.topk_idx_TK, r.topk_w_TK.detach())
            lay = fwd_layout(L_, d)
            z, s = fwd_experts(L_, d, lay, L_.w1, L_.w2, want_dw=True, gemm=L_.gemm)
            out = L_.dispatcher.combine(z, d.handle)
            dz = bwd_dispatch(L_, dout, s)
            dx_rows, dw, dw1, dw2 = bwd_experts(L_, dz, dout, s, L_.w1, L_.w2, want_dx=True, gemm=L_.gemm)
            dx, dw_T = bwd_combine(L_, dx_rows, dw, s, dout.dtype)
            res.append(dict(idx=d.topk_idx, w=d.topk_w, x=d.x, z=z, out=out, dz=dz, dx_rows=dx_rows, dw=dw, dW1=dw1,
                            dW2=dw2, dx=dx, dw_T=dw_T))
    u, v = res
    local = u["idx"] >= 0
    assert torch.equal(u["idx"], v["idx"]) and torch.equal(u["w"][local], v["w"][local]), "dispatch: routes"
    for name in ("x", "z", "out", "dz", "dx_rows", "dw", "dW1", "dW2", "dx", "dw_T"):
        p, q = u[name], v[name]
        if isinstance(p, tuple):  # Fp8Tensor
            same = _same(p.data, q.data) and _same(p.scale.float(), q.scale.float())
        else:
            same = _same(p, q)
        if not same:
            pf = (p.dequantize() if isinstance(p, tuple) else p).float()
            qf = (q.dequantize() if isinstance(q, tuple) else q).float()
            diff = (pf - qf).abs().nan_to_num(float("inf"))
            bad = diff.reshape(diff.shape[0], -1).amax(1) > 0 if diff.dim() else diff > 0
            raise AssertionError(f"{recipe} stage {name!r}: deepep differs from all_to_all on rank {rank} "
                                 f"(max abs diff {diff.max().item():.3e}, {int(bad.sum())} of {diff.shape[0]} rows, "
                                 f"first rows {bad.nonzero().flatten()[:8].tolist()})")
    for L_ in layers:
        if hasattr(L_.dispatcher, "close"):
            L_.dispatcher.close()


def _layer_cases(rank, world, dev, fake):
    """The MoE layer with deepep: stage by stage and end to end equal to the all_to_all layer bit
    for bit, within bounds of local."""
    if fake:
        _use_fake()
    Ts = layer_token_counts(world, dev)
    for recipe in ("fp8",) if fake else ("fp8", "bf16"):
        _check_layer_stages(rank, world, dev, Ts[0], 4 * world, 3, recipe)
        _check_layer_stages(rank, world, dev, Ts[1], 2 * world, 2, recipe)
    report = []
    cases = ((Ts[0], 4 * world, 3, False, 1), (Ts[1], 2 * world, 2, True, 0))
    for recipe in ("fp8",) if fake else ("fp8", "bf16"):  # fake: the plumbing once (its data moves by all_to_all)
        for T_r, E, K, skew, shared in cases[:1] if fake else cases:
            a = _layer_case(rank, world, dev, recipe, T_r, E, K, skew, report, n_shared=shared)
            b = _layer_case(rank, world, dev, recipe, T_r, E, K, skew, report, n_shared=shared, backend="deepep")
            for name, u, v in zip(("out", "dx", "dW1", "dW2", "drouter"), a, b):
                assert torch.equal(u, v), f"{recipe} {name}: deepep differs from all_to_all ({T_r}, skew={skew})"
    print_report(rank, world, dev, report)


def _overlap_case(rank, world, dev, recipe, T_r, E, K, backend):
    """The MoE layer (one shared expert) with the two micro-batch overlap on, over `backend` (all_to_all
    in exact mode): checked bit for bit against the serialized schedule on the same dispatcher, then
    repeated; -> (out, dx, every parameter's gradient) of the overlapped run. With deepep the
    overlap must have gone through DeepEP's event API (`dispatch_async` / `combine_async` after a
    captured event), not the synchronous calls."""
    torch.manual_seed(0)
    layer = MoELayer(H, I, E, K, n_shared=1, recipe=Recipe(recipe),
                     dispatcher=build_dispatcher(backend, E, None, mode="exact")).to(dev)
    disp, evented = layer.dispatcher, []
    for name in ("dispatch_async", "combine_async") if backend == "deepep" else ():
        def spy(*a, _f=getattr(disp, name), _name=name, **kw):
            if kw.get("previous_event") is not None and kw.get("async_finish", True):
                evented.append(_name)
            return _f(*a, **kw)
        setattr(disp, name, spy)
    g = torch.Generator().manual_seed(300 + rank)
    x = torch.randn(T_r[rank], H, generator=g).bfloat16().to(dev)
    dout = torch.randn(T_r[rank], H, generator=g).bfloat16().to(dev)

    def run(fn):
        layer.zero_grad()
        xg = x.clone().requires_grad_()
        out = fn(xg)
        out.backward(dout)
        return [out, xg.grad] + [p.grad.clone() for p in layer.parameters()]

    names = ["out", "dx"] + [n for n, _ in layer.named_parameters()]
    layer.overlap = OverlapPolicy()
    got = run(lambda t: layer(t).out)
    if backend == "deepep":  # forward: A's and B's dispatch and combine; backward: their dispatches and combines
        assert evented.count("dispatch_async") >= 4 and evented.count("combine_async") >= 4, \
            f"the overlap did not use DeepEP's event API: {evented}"
    layer.overlap = None
    want = run(lambda t: serialized(layer, t))
    for n, u, v in zip(names, got, want):
        assert torch.isfinite(u.float()).all(), f"{recipe} {backend} {n}: non-finite values"
        assert _same(u, v), f"{recipe} {backend} {n}: overlapped != serialized on rank {rank}"
    layer.overlap = OverlapPolicy()
    for _ in range(3 if dev == "cpu" else 20):  # repeats without hanging (x without grad: no dx combine)
        layer.zero_grad()
        layer(x).out.backward(dout)
    dist.barrier()
    if hasattr(disp, "close"):
        disp.close()
    return got


def _overlap_cases(rank, world, dev, fake):
    """overlap + deepep == overlap + all_to_all bit for bit (issue 48), ragged and zero-token ranks."""
    if fake:
        _use_fake()
    Ts = layer_token_counts(world, dev)
    for recipe in ("fp8",) if fake else ("fp8", "bf16"):
        for T_r, E, K in ((Ts[0], 4 * world, 3), (Ts[1], 2 * world, 2)):
            a = _overlap_case(rank, world, dev, recipe, T_r, E, K, "all_to_all")
            b = _overlap_case(rank, world, dev, recipe, T_r, E, K, "deepep")
            for i, (u, v) in enumerate(zip(a, b)):
                assert _same(u, v), f"{recipe} T={T_r} tensor {i}: overlap + deepep != overlap + all_to_all on rank {rank}"


def _fake_cases(rank, world, dev):
    _data_cases(rank, world, dev, True)
    _layer_cases(rank, world, dev, True)
    _overlap_cases(rank, world, dev, True)


def test_deepep_wrapper_on_fake_gloo():
    """The wrapper's plumbing on CPU (2 gloo ranks): data movement, events, SM counts, errors, the layer."""
    spawn(_fake_cases, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_deepep_data_nccl(world):
    pytest.importorskip("deep_ep")
    _need_gpus(world)
    spawn(_data_cases, world, False, backend="nccl")


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_deepep_layer_nccl(world):
    pytest.importorskip("deep_ep")
    _need_gpus(world)
    spawn(_layer_cases, world, False, backend="nccl")


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_deepep_overlap_nccl(world):
    """The overlapped MoE layer over DeepEP's event API: bit for bit the serialized schedule and the
    overlapped all_to_all layer, FP8 and BF16, forward and gradients (issue 48)."""
    pytest.importorskip("deep_ep")
    _need_gpus(world)
    spawn(_overlap_cases, world, False, backend="nccl")


def test_fp32_rows_as_byte_columns_survive_a_sum_with_zeros():
    """The deepep backend's fp32 combine (the routing weights' gradient): every bit pattern (NaN,
    -0, Inf, subnormals) comes back exactly after the BF16 combine's fp32 sum with the other
    ranks' zero rows and its rounding to BF16."""
    from moefp8.dispatch.deepep import byte_cols_to_fp32, fp32_to_byte_cols

    y = torch.randn(64, 5, generator=torch.Generator().manual_seed(0)) * 1e3
    y[0, 0], y[1, 1], y[2, 2], y[3, 3], y[4] = float("nan"), -0.0, float("-inf"), 1e-42, 3.0e38
    cols = fp32_to_byte_cols(y)
    assert cols.dtype == torch.bfloat16 and cols.shape == (64, 24)  # 4 x 5 columns, padded to 8
    summed = (torch.zeros_like(cols, dtype=torch.float32) + cols.float() + 0.0).bfloat16()  # as DeepEP's reduce
    assert torch.equal(byte_cols_to_fp32(summed, 5).view(torch.int32), y.view(torch.int32))
