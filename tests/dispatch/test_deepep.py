"""The `deepep` dispatch backend (`moefp8.dispatch.deepep`) against `all_to_all` and `local`.

GPU tests (marker `gpu`, NCCL, one process per GPU, skipped when `deep_ep` does not import):
data movement equal to the all_to_all backend's exact mode on the same inputs (rows, scales,
local ids, weights of local slots, cached dispatch, BF16 and fp32 combine, bit for bit; async
events; another SM count), a bad expert id on one rank raising on every rank, and the MoE layer
(forward and gradients) equal to the all_to_all layer bit for bit and to EP=1 `local` within the
all_to_all test's bounds.

CPU (gloo): the same checks of the wrapper's plumbing against `fake_deep_ep` (DeepEP's Python API
over the all_to_all backend), so that the wrapper runs in CI.
"""

import sys

import pytest
import torch

from test_all_to_all import (CASES_2, CASES_4, H, _layer_case, _need_gpus, _tokens, layer_token_counts, print_report,
                             spawn)

from moefp8.dispatch import build_dispatcher
from moefp8.dispatch.all_to_all import AllToAllDispatcher


def _use_fake():
    import fake_deep_ep

    sys.modules["deep_ep"] = fake_deep_ep


def _sources(T_r, E, K, case, world, dev):
    return {s: _tokens(T_r, E, K, case, s, dev) for s in range(world)}


def _check_data(rank, world, dev, T_r, E, K, case, dep):
    """deepep vs all_to_all (exact) on the same inputs: equal bit for bit."""
    a2a = AllToAllDispatcher(E, None, mode="exact")
    x8, idx, w = _tokens(T_r, E, K, case, rank, dev)
    da, dd = a2a.dispatch(x8, idx, w), dep.dispatch(x8, idx, w)
    assert torch.equal(dd.x.data.view(torch.uint8), da.x.data.view(torch.uint8))
    assert torch.equal(dd.x.scale, da.x.scale) and torch.equal(dd.topk_idx, da.topk_idx)
    local = da.topk_idx >= 0  # DeepEP zeroes the weights of slots whose expert lives elsewhere
    assert torch.equal(dd.topk_w[local], da.topk_w[local]) and torch.all(dd.topk_w[~local] == 0)
    xb = (torch.arange(T_r[rank], device=dev, dtype=torch.float32)[:, None] + 0.5 * rank).expand(-1, H)
    xb = xb.bfloat16().contiguous()
    assert torch.equal(dep.dispatch(xb, handle=dd.handle).x, a2a.dispatch(xb, handle=da.handle).x)
    x16 = x8.dequantize(torch.bfloat16)
    d16a, d16d = a2a.dispatch(x16, idx, w), dep.dispatch(x16, idx, w)
    assert torch.equal(d16d.x, d16a.x)
    y = (d16a.x.float() * (rank + 1)).bfloat16()
    assert torch.equal(dep.combine(y, dd.handle), a2a.combine(y, da.handle))
    dw = torch.where(local, da.topk_w, 0.0)
    back = dep.combine(dw, dd.handle)
    assert back.dtype == torch.float32 and torch.equal(back, a2a.combine(dw, da.handle))
    # the event API: start after a captured event, finish on DeepEP's stream, wait, same results
    d2, ev = dep.dispatch_async(x8, idx, w, previous_event=dep.capture(), allocate_on_comm_stream=True)
    ev.current_stream_wait()
    assert torch.equal(d2.x.data.view(torch.uint8), da.x.data.view(torch.uint8))
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


def _layer_cases(rank, world, dev, fake):
    """The MoE layer with deepep: equal to the all_to_all layer bit for bit, within bounds of local."""
    if fake:
        _use_fake()
    Ts = layer_token_counts(world, dev)
    report = []
    cases = ((Ts[0], 4 * world, 3, False, 1), (Ts[1], 2 * world, 2, True, 0))
    for recipe in ("fp8",) if fake else ("fp8", "bf16"):  # fake: the plumbing once (its data moves by all_to_all)
        for T_r, E, K, skew, shared in cases[:1] if fake else cases:
            a = _layer_case(rank, world, dev, recipe, T_r, E, K, skew, report, n_shared=shared)
            b = _layer_case(rank, world, dev, recipe, T_r, E, K, skew, report, n_shared=shared, backend="deepep")
            for name, u, v in zip(("out", "dx", "dW1", "dW2", "drouter"), a, b):
                assert torch.equal(u, v), f"{recipe} {name}: deepep differs from all_to_all ({T_r}, skew={skew})"
    print_report(rank, world, dev, report)


def _fake_cases(rank, world, dev):
    _data_cases(rank, world, dev, True)
    _layer_cases(rank, world, dev, True)


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
