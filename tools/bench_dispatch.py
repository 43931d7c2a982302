"""Expert-parallel dispatch/combine bandwidth, modeled on DeepEP's intranode test.

    torchrun --nproc_per_node 4 tools/bench_dispatch.py            # GPUs, NCCL, DeepSeek-V3 shapes
    torchrun --nproc_per_node 2 tools/bench_dispatch.py --smoke    # CPU (gloo), tiny shapes

Traffic: 4096 tokens per rank, hidden 7168, top-8 of 256 experts (rounded down to a multiple
of the rank count), random routing (top-k of |randn| + 1 scores, as DeepEP's test). In one run,
for each implementation: dispatch FP8, dispatch BF16 (full, with the routing; and reusing the
handle, as the backward does and as DeepEP tunes), combine BF16. Implementations (`impl`, and
`mode` in the JSON rows): `all_to_all` (its exact mode: count exchange + host sync, then the
payload; the figures of earlier runs), `all_to_all-capacity` (fixed blocks of capacity + 1 rows,
capacity = --tokens, no count exchange, no host sync; one more row: the full FP8 dispatch
followed by its error check, the one host sync of that mode, which in the MoE layer happens at
the combine), `all_to_all-capped` (in `--modes`, default off: the capacity mode's blocks of
--send-factor x p x capacity rows, compacted, as `dispatch.send_factor` trains: p the chance that a
token has an expert on a given rank; a block too small exits with a message), `deepep` (the deepep backend, DeepEP's normal intranode kernels, when `deep_ep`
imports). Time: per rank the median of CUDA-event timings over --iters iterations after
--warmup, then the max over ranks. GB/s counted as DeepEP does, on the useful bytes, per rank:
dispatch = bytes of the tokens this rank receives (BF16 2H per token; FP8 H + 4H/128, DeepEP's
FP8 format with fp32 scales, so figures compare with DeepEP's printout), combine = bytes of the
BF16 rows this rank sends back; the same for every implementation, whatever it moves. What each
one really moves is `wire_bytes_per_rank` (ours: UE8M0 scales, routing fields, 16-byte padding,
and in capacity mode the unsent slots and headers; DeepEP's: fp32 scales, int64 ids, fp32
weights, an int32 source index), printed beside. The FP8 wire row must be <= 0.55x the BF16 one
(asserted).

Speed of light: the NCCL all-reduce bus bandwidth measured in the same run
(busbw = 2 (n-1)/n * bytes / t, --allreduce-mb); ratio = GB/s / busbw.
Rank 0 prints the table and writes bench/results/dispatch-<device>-ep<N>.json (docs/design.md §6).
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, as tools/profile_step.py
from moefp8.dispatch.all_to_all import AllToAllDispatcher, row_bytes  # noqa: E402
from moefp8.dispatch.hierarchical import HierarchicalDispatcher, build_node_groups  # noqa: E402
from moefp8.kernels.quant import quant_rowwise  # noqa: E402
from moefp8.kernels.route import route_select  # noqa: E402
from moefp8.testing import print_table, results_path, save_results  # noqa: E402


def init_torchrun(bind_cpus: bool = False) -> tuple[int, int, torch.device]:
    """The process group of a torchrun launch (env://; NCCL with one GPU per rank, gloo on CPU)
    -> (rank, world size, this rank's device). Shared by the multi-GPU benchmarks. bind_cpus: pin
    each local rank to CPUs near its GPU first (moefp8.affinity)."""
    cuda = torch.cuda.is_available()
    if bind_cpus:
        from moefp8.affinity import bind_cpus as bind

        cpus = bind(int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        print(f"local rank {os.environ.get('LOCAL_RANK', 0)}: pinned to CPUs {cpus[0]}-{cpus[-1]} ({len(cpus)})", flush=True)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), dev


def timed(fn, warmup: int, iters: int, dev, per_rank: list | None = None, aligned: bool = False) -> float:
    """Median seconds of fn() on this rank, max over the ranks (every rank's median appended to
    `per_rank` if given). Iterations run back to back; aligned=True starts every one on every rank
    together instead (a barrier and a device synchronization before each), which leaves the
    host's run-ahead and the ranks' drift between iterations out."""
    for _ in range(warmup):
        fn()
    dist.barrier()
    times = []
    if dev.type == "cuda" and aligned:
        for _ in range(iters):
            dist.barrier()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    elif dev.type == "cuda":
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for a, b in ev:
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) / 1e3 for a, b in ev]
    else:
        for _ in range(iters):
            if aligned:
                dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=dev)
    if per_rank is not None:
        every = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(every, t)
        per_rank.extend(float(v) for v in every)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def allreduce_busbw(nbytes: int, warmup: int, iters: int, dev) -> tuple[float, float]:
    """(bus bandwidth GB/s, seconds) of an all-reduce of nbytes of BF16."""
    n = dist.get_world_size()
    buf = torch.randn(nbytes // 2, device=dev).bfloat16()
    t = timed(lambda: dist.all_reduce(buf), warmup, iters, dev)
    return (2 * (n - 1) / n * nbytes / t / 1e9 if n > 1 else float("nan")), t


def _rows(disp, x, x8, idx, w, warmup, iters, dev, wire, rows=None):
    """The five cases of one dispatcher -> [(case, seconds, DeepEP-counted bytes, wire bytes)]; wire(kind,
    d) gives the bytes the implementation moves for a dispatch result d ("fp8" | "bf16" | "fp8 cached" |
    "bf16 cached" | "combine"). rows: the all_to_all capacity mode's compacted blocks (`dispatch(rows=)`)."""
    H = x.shape[1]
    kw = {} if rows is None else {"rows": rows}
    d16 = disp.dispatch(x, idx, w, **kw)
    if d16.overflow is not None:  # a rank's own flag: every rank must agree to stop (or the others wait forever)
        over = d16.overflow.clone()
        dist.all_reduce(over, op=dist.ReduceOp.MAX)
        if int(over.max()):  # (said once, by rank 0)
            raise SystemExit(1 if dist.get_rank() else f"bench_dispatch: blocks of {rows} rows were too small for this "
                             f"routing on some rank: raise --send-factor")
    n_recv = int((d16.topk_idx >= 0).any(1).sum())  # tokens received (capacity mode: its sent slots)
    b16, b8 = n_recv * 2 * H, n_recv * (H + 4 * H // 128)  # DeepEP's byte counts
    y = d16.x.contiguous()  # the rows a rank sends back in combine
    out = []
    for case, fn, nbytes, kind in (
            ("dispatch fp8", lambda: disp.dispatch(x8, idx, w, **kw), b8, "fp8"),
            ("dispatch bf16", lambda: disp.dispatch(x, idx, w, **kw), b16, "bf16"),
            ("dispatch fp8, cached handle", lambda: disp.dispatch(x8, handle=d16.handle), b8, "fp8 cached"),
            ("dispatch bf16, cached handle", lambda: disp.dispatch(x, handle=d16.handle), b16, "bf16 cached"),
            ("combine bf16", lambda: disp.combine(y, d16.handle), b16, "combine")):
        out.append((case, timed(fn, warmup, iters, dev), nbytes, wire(kind, d16)))
    return out


def link_rows(disp, handle, G: int) -> tuple[int, int]:
    """Rows this rank sends per dispatch (routes of `handle`) over inter-node and intra-node links,
    for nodes of G ranks: flat, to each remote rank and to its node's other ranks; hierarchical,
    to each remote node (stage A) and, forwarding, to its node's other ranks (stage B)."""
    rank = dist.get_rank()
    node, local = divmod(rank, G)
    if isinstance(disp, HierarchicalDispatcher):
        inter = sum(s for b, s in enumerate(handle.a.send_splits) if b != node)
        return inter, sum(s for l, s in enumerate(handle.b.send_splits) if l != local)
    sends = handle.send_splits
    return (sum(s for r, s in enumerate(sends) if r // G != node),
            sum(s for r, s in enumerate(sends) if r // G == node and r != rank))


def expected_inter_rows(idx, E: int, n: int, G: int, hierarchical: bool) -> tuple[int, int]:
    """From the routing alone: the inter-node rows this rank must send, one per (token, distinct
    remote node hosting one of its experts) hierarchical, one per (token, distinct remote rank)
    flat; and the most any one token sends."""
    node = dist.get_rank() // G
    hosts = (idx.clamp(min=0) // (E // n)).masked_fill(idx < 0, -1).cpu()
    rows = [{(r // G if hierarchical else r) for r in h.tolist() if r >= 0 and r // G != node} for h in hosts]
    return sum(map(len, rows)), max(map(len, rows), default=0)


def bench_all_to_all(x, x8, idx, w, E, warmup, iters, dev, mode="exact", G=None, node_groups=None,
                     send_factor: float = 1.1):
    """-> list of (case, seconds, DeepEP-counted bytes, wire bytes) for this rank's traffic. G: ranks
    per node (the combine sums per node); node_groups: the hierarchical mode's groups; mode "capped":
    the capacity mode's compacted blocks of send_factor x p x capacity rows."""
    if node_groups is not None:
        disp = HierarchicalDispatcher(E, *node_groups)
        H, K = x.shape[1], idx.shape[1]
        per_row = {"fp8": row_bytes(H, K, "fp8-pow2"), "bf16": row_bytes(H, K, "bf16"), "combine": 2 * H,
                   "fp8 cached": row_bytes(H, None, "fp8-pow2"), "bf16 cached": row_bytes(H, None, "bf16")}
        # the wire: the rows of both stages (stage A's include the ones a rank keeps in its node)
        return _rows(disp, x, x8, idx, w, warmup, iters, dev,
                     lambda kind, d: (d.handle.a.num_recv + d.handle.b.num_recv) * per_row[kind])
    fixed = mode in ("capacity", "capped")
    disp = AllToAllDispatcher(E, None, capacity=x.shape[0] if fixed else None, mode="capacity" if fixed else mode,
                              ranks_per_node=G)
    H, K = x.shape[1], idx.shape[1]
    per_row = {"fp8": row_bytes(H, K, "fp8-pow2"), "bf16": row_bytes(H, K, "bf16"), "combine": 2 * H,
               "fp8 cached": row_bytes(H, None, "fp8-pow2"), "bf16 cached": row_bytes(H, None, "bf16")}
    rows = disp.compacted_rows(K, send_factor) if mode == "capped" else None  # as training sizes them
    # rows received: exact, the routed tokens; capacity, R blocks of capacity (capped: rows) + 1 rows
    out = _rows(disp, x, x8, idx, w, warmup, iters, dev, lambda kind, d: d.handle.num_recv * per_row[kind], rows)
    if mode == "capacity":
        b8, wire8 = out[0][2], out[0][3]
        t = timed(lambda: disp.dispatch(x8, idx, w).handle.check(), warmup, iters, dev)
        out.insert(1, ("dispatch fp8 + error check (host sync)", t, b8, wire8))
    return out


def bench_deepep(x, x8, idx, w, E, warmup, iters, dev):
    """The deepep backend (DeepEP's normal intranode kernels, its default configs); the same traffic."""
    from moefp8.dispatch.deepep import DeepEPDispatcher

    disp = DeepEPDispatcher(E, None)
    H, K, G = x.shape[1], idx.shape[1], x.shape[1] // 128
    # DeepEP's rows: data, fp32 scales, int32 source index, and with the routing int64 ids + fp32 weights
    per_row = {"fp8": H + 4 * G + 4 + 12 * K, "bf16": 2 * H + 4 + 12 * K, "fp8 cached": H + 4 * G + 4,
               "bf16 cached": 2 * H + 4, "combine": 2 * H}
    try:
        return _rows(disp, x, x8, idx, w, warmup, iters, dev, lambda kind, d: d.handle.num_recv * per_row[kind])
    finally:
        dist.barrier()
        disp.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256, help="rounded down to a multiple of the rank count")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--allreduce-mb", type=int, default=256)
    p.add_argument("--backends", default="all_to_all,deepep",
                   help="comma list; deepep is skipped if it does not import")
    p.add_argument("--modes", default="exact,capacity", help="all_to_all modes to run (comma list of exact, "
                   "capacity, capped)")
    p.add_argument("--send-factor", type=float, default=1.1, help="the capped mode's blocks: this x p x capacity "
                   "rows (dispatch.send_factor)")
    p.add_argument("--ranks-per-node", type=int, default=0, help="pose as nodes of this many ranks (0: torchrun's "
                   "LOCAL_WORLD_SIZE): adds the hierarchical mode and rows per link class when the ranks span nodes")
    p.add_argument("--max-nodes", type=int, default=0, help="node-limited routing (with nodes): each token's "
                   "experts on at most this many nodes, as dispatch.max_nodes (0: off)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU/gloo smoke test)")
    p.add_argument("--out", default=None, help="results JSON path (default bench/results/dispatch-<device>-ep<N>.json)")
    a = p.parse_args()
    if a.smoke:
        a.tokens, a.hidden, a.topk, a.experts, a.warmup, a.iters, a.allreduce_mb = 64, 512, 4, 32, 1, 3, 1

    rank, n, dev = init_torchrun()
    E = (a.experts // n) * n
    if E < n or a.topk > E or a.hidden % 128:
        raise SystemExit(f"bench_dispatch: experts {a.experts} (-> {E} for {n} ranks), top-k {a.topk}, hidden "
                         f"{a.hidden}: need at least one expert per rank, top-k <= experts, hidden % 128 == 0")
    ratio8 = row_bytes(a.hidden, a.topk, "fp8-pow2") / row_bytes(a.hidden, a.topk, "bf16")
    assert ratio8 <= 0.55, f"FP8 dispatch row is {ratio8:.3f}x the BF16 row, more than 0.55x"

    torch.manual_seed(rank)
    x = torch.randn(a.tokens, a.hidden, device=dev).bfloat16()
    x8 = quant_rowwise(x)
    scores = torch.randn(a.tokens, E, device=dev).abs() + 1
    G = a.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", n))
    nodes = G < n and n % G == 0
    if a.max_nodes and not (nodes and 0 < a.max_nodes <= n // G):
        raise SystemExit(f"bench_dispatch: --max-nodes {a.max_nodes} needs ranks posing as nodes (--ranks-per-node) "
                         f"and at most their {n // G if nodes else 1} nodes")
    if a.max_nodes:  # the router's node-limited selection: the groups are the nodes
        idx = route_select(scores, torch.zeros(E, device=dev), a.topk, n // G, a.max_nodes)[0]
    else:
        idx = scores.topk(a.topk, dim=-1, sorted=False).indices
    w = torch.rand(a.tokens, a.topk, device=dev)

    busbw, t_ar = allreduce_busbw(a.allreduce_mb << 20, a.warmup, a.iters, dev)
    groups = build_node_groups(n, n, G) if nodes else None  # collective: every rank, before any timing
    backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    runs = []  # (impl, mode, fn)
    for backend in backends:
        if backend == "all_to_all":
            for mode in (m.strip() for m in a.modes.split(",") if m.strip()):
                if mode not in ("exact", "capacity", "capped"):
                    raise SystemExit(f"bench_dispatch: unknown all_to_all mode {mode!r} (exact, capacity, capped)")
                impl = "all_to_all" if mode == "exact" else f"all_to_all-{mode}"
                runs.append((impl, mode, lambda *args, mode=mode: bench_all_to_all(
                    *args, mode=mode, G=G if nodes else None, send_factor=a.send_factor)))
            if nodes:
                runs.append(("all_to_all-hierarchical", "exact",
                             lambda *args: bench_all_to_all(*args, G=G, node_groups=groups)))
        elif backend == "deepep":
            try:
                import deep_ep  # noqa: F401
            except ImportError as e:
                if rank == 0:
                    print(f"deepep: skipped (`import deep_ep` failed: {e})")
                continue
            runs.append(("deepep", "normal", bench_deepep))
        else:
            raise SystemExit(f"bench_dispatch: unknown backend {backend!r} (all_to_all, deepep)")
    rows = []
    for impl, mode, fn in runs:
        try:
            results = fn(x, x8, idx, w, E, a.warmup, a.iters, dev)
        except Exception as e:  # noqa: BLE001  (an API mismatch with the installed DeepEP: keep the other rows)
            if impl != "deepep":
                raise
            print(f"rank {rank}: {impl} failed: {type(e).__name__}: {e}")
            continue
        links = {}
        if nodes and impl in ("all_to_all", "all_to_all-hierarchical"):
            disp = (HierarchicalDispatcher(E, *groups) if impl.endswith("hierarchical")
                    else AllToAllDispatcher(E, None, mode="exact", ranks_per_node=G))
            inter, intra = link_rows(disp, disp.dispatch(x8, idx, w).handle, G)
            want, most = expected_inter_rows(idx, E, n, G, impl.endswith("hierarchical"))
            assert inter == want, f"rank {rank} {impl}: {inter} inter-node rows sent, the routing asks {want}"
            assert not (a.max_nodes and impl.endswith("hierarchical") and most > a.max_nodes), (most, a.max_nodes)
            links = {"ranks_per_node": G, "max_nodes": a.max_nodes, "inter_node_rows": inter,
                     "inter_node_rows_expected": want, "inter_node_rows_per_token_max": most, "intra_node_rows": intra,
                     "inter_node_fp8_bytes": inter * row_bytes(a.hidden, a.topk, "fp8-pow2"),
                     "intra_node_fp8_bytes": intra * row_bytes(a.hidden, a.topk, "fp8-pow2")}
        for case, t, nbytes, wire in results:
            gbs = nbytes / t / 1e9
            rows.append({"case": f"{case} T{a.tokens} H{a.hidden} top{a.topk}/E{E} EP{n}", "impl": impl, "mode": mode,
                         "value": round(gbs, 1 if gbs >= 1 else 4), "unit": "GB/s", "time_us": round(t * 1e6, 1),
                         "bytes_per_rank": nbytes, "wire_bytes_per_rank": wire,
                         "wire_over_useful": round(wire / nbytes, 3) if nbytes else None,
                         "baseline": f"{dist.get_backend()} all-reduce busbw {a.allreduce_mb} MB", "baseline_value": round(busbw, 1),
                         "ratio": round(gbs / busbw, 3) if busbw == busbw else None, **links})
    # the received-token count differs per rank; the table shows rank 0's bytes with the max time
    if rank == 0:
        print(f"EP={n} on {dev.type}; all-reduce {a.allreduce_mb} MB: {t_ar * 1e6:.0f} us, busbw {busbw:.1f} GB/s; "
              f"wire bytes/token FP8 {row_bytes(a.hidden, a.topk, 'fp8-pow2')} vs BF16 "
              f"{row_bytes(a.hidden, a.topk, 'bf16')} ({ratio8:.3f}x)")
        print_table(rows, ["case", "impl", "time_us", "value", "unit", "baseline_value", "ratio", "wire_over_useful"]
                    + (["inter_node_rows", "intra_node_rows"] if nodes else []))
        peak = {"what": f"{dist.get_backend()} all-reduce bus bandwidth, {a.allreduce_mb} MB, {n} ranks", "value": round(busbw, 1),
                "unit": "GB/s"}
        path = save_results("bench_dispatch", rows, peak, path=a.out or results_path("dispatch", ep=n),
                            ranks=n, tokens_per_rank=a.tokens, hidden=a.hidden, topk=a.topk, experts=E,
                            wire_bytes_per_token={"fp8": row_bytes(a.hidden, a.topk, "fp8-pow2"),
                                                  "bf16": row_bytes(a.hidden, a.topk, "bf16"),
                                                  "fp8_cached_handle": row_bytes(a.hidden, None, "fp8-pow2")})
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
