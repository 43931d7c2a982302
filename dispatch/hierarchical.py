"""Hierarchical expert-parallel dispatch for EP groups that span nodes (DeepSeek-V3's scheme),
built from two `AllToAllDispatcher`s (docs/multinode.md). The EP group's R ranks are N nodes of G
consecutive ranks; rank (node b, local rank l) is group rank b * G + l.

dispatch(x, topk_idx, topk_w):
  A. over the *inter-node* group (the N ranks of local rank l, one per node): each token goes once
     to every node hosting one of its experts, to the rank of its own local rank there, with its
     FP8 row (UE8M0 scales), its routing weights and node-local expert ids (an AllToAllDispatcher
     whose "ranks" are the nodes, E / N experts each). Rows arrive by source node, then token.
  B. over the *intra-node* group (the G ranks of node b): each received row is forwarded to the
     node's ranks hosting its experts (an AllToAllDispatcher over E / N experts), with their local
     ids. Rows arrive by forwarding rank l, then source node a, then token.
  C. one gather puts them in the flat backend's order, by source rank a * G + l, then token, with
     the per-(l, a) counts from one small exchange in the node: the rows, local ids and weights
     are the flat dispatch's, bit for bit, and so is everything the layer computes from them.
  Inter-node rows: one per (token, remote node hosting one of its experts), against one per
  (token, remote rank) in the flat mode (`tools/plan_ep.py` has the expectation).

combine(y, handle): the reverse. B's combine sums a token's rows over the node's ranks in local
rank order (fp32, rounded once to BF16: the row that crosses the network), then A's over the
nodes in node order (fp32, rounded once). The flat backend built with the same `ranks_per_node`
sums in that same order (`sum_over_ranks`), so the two agree bit for bit; with one node it is the
flat rule as it always was. fp32 rows (the routing weights' gradient) are summed the same way.

Exact mode only (counts exchanged, host syncs); the exchanges run on the caller's stream.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from moefp8.dispatch import Dispatched
from moefp8.dispatch.all_to_all import AllToAllDispatcher, AllToAllHandle
from moefp8.fp8 import Fp8Tensor


@dataclass(frozen=True)
class HierarchicalHandle:
    """A: the inter-node dispatch's handle; B: the intra-node one's; order: int64 [T_recv], row i of
    the flat order is row order[i] of B's arrival order."""

    a: AllToAllHandle
    b: AllToAllHandle
    order: Tensor
    topk_idx: Tensor
    topk_w: Tensor

    @property
    def num_tokens(self) -> int:
        return self.a.num_tokens

    @property
    def num_recv(self) -> int:
        return self.order.shape[0]

    def check(self) -> None:
        """Nothing to check: exact-mode dispatches raise input errors at once."""


def build_node_groups(world_size: int, ep_size: int, ranks_per_node: int, timeout=None):
    """This rank's (intra-node group, inter-node group) inside its EP group: every rank must call
    it, in the same order (new_group is collective). EP groups are consecutive ranks
    (`ep_group_ranks`), nodes consecutive ranks_per_node of them."""
    G, rank = ranks_per_node, dist.get_rank()
    if ep_size % G or ep_size <= G:
        raise ValueError(f"hierarchical dispatch: the EP group of {ep_size} ranks must span several whole nodes of "
                         f"{G} ranks")
    intra = inter = None
    for base in range(0, world_size, ep_size):
        for b in range(ep_size // G):  # the ranks of each node
            ranks = list(range(base + b * G, base + (b + 1) * G))
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                intra = g
        for l in range(G):  # the ranks of each local rank, one per node
            ranks = list(range(base + l, base + ep_size, G))
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                inter = g
    return intra, inter


def _take(x, idx: Tensor):
    """Rows idx of x (an Fp8Tensor's data and scales alike)."""
    if isinstance(x, Fp8Tensor):
        return Fp8Tensor(x.data[idx], x.scale[idx], x.layout)
    return x[idx]


class HierarchicalDispatcher:
    """`Dispatcher` for an EP group of N nodes x G ranks: intra, inter: this rank's node group and
    local-rank group (`build_node_groups`); scale_fmt as `AllToAllDispatcher`'s."""

    communicates = True

    def __init__(self, num_experts: int, intra, inter, scale_fmt: str = "pow2"):
        self.G, self.N = dist.get_world_size(intra), dist.get_world_size(inter)
        self.local, self.node = dist.get_rank(intra), dist.get_rank(inter)
        if num_experts % (self.G * self.N):
            raise ValueError(f"HierarchicalDispatcher: {num_experts} experts cannot be split evenly over "
                             f"{self.N} nodes x {self.G} ranks")
        self.a = AllToAllDispatcher(num_experts, inter, scale_fmt, mode="exact")  # nodes as ranks
        self.b = AllToAllDispatcher(num_experts // self.N, intra, scale_fmt, mode="exact")  # inside the node
        self.intra = intra
        self.num_experts, self.scale_fmt = num_experts, scale_fmt
        self.num_local_experts = num_experts // (self.G * self.N)
        self._stream = None

    @property
    def exchange_stream(self):
        return self._stream

    @exchange_stream.setter
    def exchange_stream(self, s) -> None:  # both stages run on it (their exact mode wholly does)
        self._stream = self.a.exchange_stream = self.b.exchange_stream = s

    def packs_on_caller_stream(self, topk: int) -> bool:
        return False

    def static_exchange(self, topk: int) -> bool:
        return False  # its stages run the exact mode (a count exchange and its host sync)

    def flush_checks(self) -> None:
        """Its two stages run the exact mode: nothing deferred (delegated all the same)."""
        self.a.flush_checks()
        self.b.flush_checks()

    def combine_buffer(self, handle, C: int, device) -> None:
        return None

    def _flat_order(self, hb: AllToAllHandle, a_splits: tuple) -> Tensor:
        """The gather from B's arrival order (forwarding rank l, source node a, token) to the flat
        order (source rank a * G + l, token); counts per (l, a) exchanged in the node."""
        G, N = self.G, self.N
        dev = hb.pos_TR.device
        seg = torch.repeat_interleave(torch.arange(N, device=dev), torch.tensor(a_splits, device=dev))  # source node
        sent = (hb.pos_TR >= 0).long()  # [T_A, G]: row t forwarded to local rank l'
        cnt = torch.zeros(N, G, dtype=torch.long, device=dev).index_add_(0, seg, sent)
        mine = cnt.t().contiguous()  # [l', a]: rows of source node a this rank forwards to l'
        got = torch.empty_like(mine)
        dist.all_to_all_single(got, mine, group=self.intra)  # [l, a]: rows of node a forwarded to me by l
        got = got.tolist()
        starts, off = {}, 0
        for l in range(G):  # B's arrival order
            for a in range(N):
                starts[l, a] = off
                off += got[l][a]
        idx = [torch.arange(starts[l, a], starts[l, a] + got[l][a]) for a in range(N) for l in range(G)]
        return (torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)).to(dev)

    def dispatch(self, x, topk_idx: Tensor | None = None, topk_w: Tensor | None = None,
                 handle: HierarchicalHandle | None = None) -> Dispatched:
        """As `AllToAllDispatcher.dispatch` (the flat backend's rows, ids and weights, in its order)."""
        if handle is not None:
            xa = self.a.dispatch(x, handle=handle.a).x
            xb = self.b.dispatch(xa, handle=handle.b).x
            return Dispatched(_take(xb, handle.order), handle.topk_idx, handle.topk_w, handle)
        da = self.a.dispatch(x, topk_idx, topk_w)  # ids now node-local, -1 for other nodes
        db = self.b.dispatch(da.x, da.topk_idx, da.topk_w)
        order = self._flat_order(db.handle, da.handle.recv_splits)
        idx, w = db.topk_idx[order], db.topk_w[order]
        h = HierarchicalHandle(da.handle, db.handle, order, idx, w)
        return Dispatched(_take(db.x, order), idx, w, h)

    def combine(self, y: Tensor, handle: HierarchicalHandle) -> Tensor:
        """y [T_recv, C] bf16 (or fp32) in the flat order -> [T, C]: sums per node, then over nodes."""
        if not isinstance(y, Tensor) or y.dim() != 2 or y.shape[0] != handle.num_recv:
            what = f"{y.dtype} {tuple(y.shape)}" if isinstance(y, Tensor) else type(y).__name__
            raise ValueError(f"combine: expected [T_recv={handle.num_recv}, C] rows, got {what}")
        arrived = torch.empty_like(y)
        arrived[handle.order] = y
        return self.a.combine(self.b.combine(arrived, handle.b), handle.a)
