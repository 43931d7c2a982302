"""dispatch/hierarchical.py on 4 gloo ranks posing as 2 nodes x 2: the same rows, local ids,
weights and combine sums as the flat all_to_all backend built with the same ranks per node, bit for
bit (FP8 and BF16 rows, BF16 and fp32 combines, the backward's dispatch along the handle), with
empty ranks, unrouted tokens and tokens whose experts sit on one node; inter-node rows one per
(token, remote node hosting one of its experts), against one per (token, remote rank) flat. The
node-grouped flat combine stays within BF16 rounding of the plain rank-order sum."""

import pytest
import torch
import torch.distributed as dist

from moefp8.dispatch.all_to_all import AllToAllDispatcher
from moefp8.dispatch.hierarchical import HierarchicalDispatcher, build_node_groups
from moefp8.kernels.quant import quant_rowwise
from moefp8.testing import rel_err, spawn_group

H, E, K, G = 256, 16, 4, 2


def _inputs(rank: int, T: int, case: str):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g) * torch.exp2(torch.randint(-8, 8, (T, 1), generator=g).float())
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.long)
    if case == "unrouted" and T:
        idx[::5] = -1
        idx[1::5, 1:] = -1
    if case == "one_node" and T:  # every token's experts on node 1 (experts E/2 .. E-1)
        idx = torch.stack([torch.randperm(E // 2, generator=g)[:K] + E // 2 for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    return x.to(torch.bfloat16), idx, w


def _same(a, b) -> bool:
    if hasattr(a, "scale"):
        return torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)
    return torch.equal(a, b)


def _check(rank, world, dev):
    intra, inter = build_node_groups(world, world, G)
    hier = HierarchicalDispatcher(E, intra, inter, "pow2")
    flat = AllToAllDispatcher(E, None, "pow2", mode="exact", ranks_per_node=G)
    plain = AllToAllDispatcher(E, None, "pow2", mode="exact")
    assert hier.num_local_experts == flat.num_local_experts == E // world
    for case, T_r in (("uniform", [37, 5, 64, 1]), ("unrouted", [20, 0, 33, 8]), ("one_node", [9, 16, 0, 12])):
        T = T_r[rank]
        x, idx, w = (a.to(dev) for a in _inputs(rank, T, case))
        for payload in ("fp8", "bf16"):
            xin = quant_rowwise(x, "pow2") if payload == "fp8" else x
            a, b = hier.dispatch(xin, idx, w), flat.dispatch(xin, idx, w)
            assert _same(a.x, b.x) and torch.equal(a.topk_idx, b.topk_idx) and torch.equal(a.topk_w, b.topk_w), (case, payload)
            g = torch.Generator().manual_seed(7 + rank)
            y = torch.randn(a.x.shape[0], H, generator=g).to(dev, torch.bfloat16)
            out_h, out_f = hier.combine(y, a.handle), flat.combine(y, b.handle)
            assert out_h.shape == (T, H) and torch.equal(out_h, out_f), (case, payload)
            dw = torch.randn(a.x.shape[0], K, generator=g).to(dev)  # fp32 rows: the routing weights' gradient
            assert torch.equal(hier.combine(dw, a.handle), flat.combine(dw, b.handle))
            gx = quant_rowwise(torch.randn(T, H, generator=g).to(dev, torch.bfloat16), "pow2")  # the backward's dispatch
            assert _same(hier.dispatch(gx, handle=a.handle).x, flat.dispatch(gx, handle=b.handle).x)
            p = plain.dispatch(xin, idx, w)
            ref = plain.combine(y, p.handle)  # rank order, one rounding: within BF16 rounding of it
            if T:
                assert rel_err(out_f.float(), ref.float()) < 2 ** -7
        # inter-node rows: hierarchical one per (token, remote node), flat one per (token, remote rank)
        node = rank // G
        hosts = [set((e // (E // world)) for e in row.tolist() if e >= 0) for row in idx.cpu()]
        want_h = sum(len({r // G for r in h} - {node}) for h in hosts)
        want_f = sum(len({r for r in h if r // G != node}) for h in hosts)
        a = hier.dispatch(x, idx, w)
        sent_h = sum(n for b_, n in enumerate(a.handle.a.send_splits) if b_ != node)
        sent_f = sum(n for r, n in enumerate(flat.dispatch(x, idx, w).handle.send_splits) if r // G != node)
        assert (sent_h, sent_f) == (want_h, want_f), (case, sent_h, want_h, sent_f, want_f)
    dist.barrier()


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)])
def test_hierarchical_equals_flat_bit_for_bit(backend):
    """gloo on CPU; NCCL on 4 GPUs posing as 2 nodes of 2."""
    if backend == "nccl" and torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    spawn_group(_check, 4, backend=backend, timeout_s=180)


@pytest.mark.parametrize("max_nodes", [0, 1])
def test_bench_dispatch_reports_rows_per_link_class(tmp_path, max_nodes):
    """tools/bench_dispatch.py on 4 gloo ranks posing as 2 nodes of 2: the hierarchical rows beside
    the flat ones, with rows per link class (checked there against the routing); fewer inter-node
    rows than flat; node-limited routing to one node: at most one inter-node row per token."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent.parent
    out = tmp_path / "bd.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                        str(repo / "tools/bench_dispatch.py"), "--smoke", "--backends", "all_to_all", "--modes", "exact",
                        "--ranks-per-node", "2", "--max-nodes", str(max_nodes), "--out", str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=repo)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    by = {row["impl"]: row for row in rows if row["case"].startswith("dispatch fp8 T")}
    flat, hier = by["all_to_all"], by["all_to_all-hierarchical"]
    assert 0 < hier["inter_node_rows"] < flat["inter_node_rows"] and hier["intra_node_rows"] > flat["intra_node_rows"]
    assert hier["inter_node_rows"] == hier["inter_node_rows_expected"] and hier["max_nodes"] == max_nodes
    assert hier["inter_node_rows_per_token_max"] == 1  # 2 nodes: one remote node at most
    assert flat["inter_node_rows_per_token_max"] == 2  # both ranks of the other node
    for row in (flat, hier):  # rows of 560 bytes: FP8 data 512 + UE8M0 scales 4 + routing 32, padded to 16
        assert row["inter_node_fp8_bytes"] == 560 * row["inter_node_rows"]
