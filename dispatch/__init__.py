"""Expert-parallel dispatch backends (docs/design.md §3). Installed as `moefp8.dispatch`.

The interface (`Dispatcher`, two methods and what the MoE layer and the overlap read of it):

* ``dispatch(x, topk_idx, topk_w, handle=None) -> Dispatched``: sends each token's row (an
  "1x128" `Fp8Tensor` in the FP8 recipe, BF16 in the BF16 recipe) to the ranks owning its
  experts; returns the rows this rank received, their top-k expert ids in *local* numbering
  (-1 where the slot's expert lives on another rank), their routing weights, and a handle.
  With ``handle`` given, the routing of that earlier dispatch is reused and ``topk_*`` are
  ignored: that is how the backward pass sends the combine's gradient (FP8) along the same routes.
* ``combine(y, handle) -> out``: sums the rows a rank computed for each token back on the token's
  own rank, in BF16. It is also the backward of ``dispatch``.
* what it was built for (``num_experts``, ``num_local_experts``, ``scale_fmt``, ``communicates``),
  where the next combine's input may be written (``combine_buffer``), the stream its exchanges
  run on (``exchange_stream``, ``packs_on_caller_stream``), and whether a CUDA graph can hold its
  exchanges (``static_exchange``). Every backend implements all of it.

Backends: ``local`` (EP=1, no communication, `local.py`); ``all_to_all`` (torch.distributed
all_to_all_single, `all_to_all.py`; an "exact" mode that exchanges counts first and a
"capacity" mode of fixed-size blocks without a host sync, picked per dispatch; the capacity
mode's blocks can also move on the copy engines, `copy_engine.py`, taking no SMs); ``deepep``
(DeepEP's Buffer, normal intranode kernels, `deepep.py`: needs `deep_ep`, which is not on PyPI).
`build_ep_group` makes the expert-parallel process groups; `node_limited_groups` the router's
groups for node-limited routing.

Handles have a `check()` method: it raises any input error that the dispatch found on any rank
(the same error on every rank). Backends whose dispatch raises at once make it a no-op; the
all_to_all capacity mode calls it at the handle's first use (combine, or a dispatch reusing it).
"""

from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from moefp8.fp8 import Fp8Tensor


class Dispatched(NamedTuple):
    x: "Fp8Tensor | Tensor"  # received rows [T_recv, H]
    topk_idx: Tensor  # int64 [T_recv, K] local expert ids, -1 for experts on other ranks
    topk_w: Tensor  # fp32 [T_recv, K]
    handle: object  # the backend's frozen handle dataclass
    # (token, slot) pairs received per local expert, where the backend has them on the host anyway (the
    # all_to_all exact mode's count exchange, DeepEP's dispatch): the layout then reads back nothing
    counts: list | None = None
    # int32 [1] on the device: 1 where a dispatch of compacted blocks (all_to_all capacity mode, `rows=`)
    # dropped a token of this rank's for want of rows; None where nothing can be dropped
    overflow: Tensor | None = None


class Dispatcher(Protocol):
    num_experts: int  # E, the global experts it routes to
    num_local_experts: int  # E_l = E / group size: this rank's experts [rank * E_l, (rank + 1) * E_l)
    scale_fmt: str | None  # the FP8 scale format it sends ("pow2" | "fp32"); None: any (nothing travels)
    communicates: bool  # False: rows never leave the process (gradients arrive unquantized)
    # The CUDA stream the exchanges run on, set by the caller around its calls (moefp8.overlap does,
    # for dispatchers that `packs_on_caller_stream`); None: the caller's stream. Backends that never
    # split their work across streams (local, deepep) keep it None.
    exchange_stream: "torch.cuda.Stream | None"

    def dispatch(self, x, topk_idx: Tensor | None = None, topk_w: Tensor | None = None,
                 handle: object | None = None) -> Dispatched: ...

    def combine(self, y: Tensor, handle: object) -> Tensor: ...

    def combine_buffer(self, handle: object, C: int, device: torch.device) -> Tensor | None:
        """A bf16 [T_recv, C] tensor to write the next combine's input into (a transport's send
        slot, so that the combine moves it without staging it), or None: any tensor will do."""
        ...

    def packs_on_caller_stream(self, topk: int) -> bool:
        """Whether a dispatch of CUDA tensors with top-k `topk`, with `exchange_stream` set,
        quantizes and packs on the caller's stream and only exchanges and unpacks on
        `exchange_stream` (else all of it belongs on one stream)."""
        ...

    def static_exchange(self, topk: int) -> bool:
        """Whether a dispatch of CUDA tensors with top-k `topk`, and the combine and the backward's
        dispatch through its handle, run with sizes known on the host and no host sync: then a CUDA graph
        can hold them (moefp8.graphs, whole blocks under EP)."""
        ...

    def flush_checks(self) -> None:
        """Raises the input errors of exchanges whose check was deferred (the all_to_all capacity
        mode's headers, read without waiting where their exchange had not finished). The training
        loop calls it once per step, after its host sync."""
        ...


DEEPEP_INSTALL = ("DeepEP is not on PyPI: build it by hand from https://github.com/deepseek-ai/DeepEP "
                  "(clone it, install NVSHMEM if you need internode RDMA, then `python setup.py install` in the "
                  "same environment as torch), or use dispatch backend 'all_to_all'")


def build_dispatcher(backend: str, num_experts: int, group=None, scale_fmt: str = "pow2",
                     capacity: int | None = None, mode: str = "auto", transport: str = "collective",
                     slots: int = 4, ranks_per_node: int | None = None, node_groups: tuple | None = None) -> Dispatcher:
    """The dispatcher for a backend name; ``group`` is the expert-parallel process group (None:
    the default group for the communicating backends); ``scale_fmt`` the FP8 recipe's scale format
    (it fixes how scales travel). ``capacity`` (the most tokens any rank passes to one dispatch),
    ``mode`` ("auto" | "exact" | "capacity"), ``transport`` ("collective" | "copy_engine") and
    ``slots`` (the copy engines' send slots) select the all_to_all backend's mode and how its bytes
    move (see `all_to_all.py`); ``ranks_per_node`` (a group spanning nodes) fixes its combine's
    summation order; ``node_groups`` (intra, inter: `hierarchical.build_node_groups`) makes it the
    hierarchical dispatch (`hierarchical.py`). The other backends ignore them."""
    if backend == "local":
        from moefp8.dispatch.local import LocalDispatcher

        if group is not None and group.size() > 1:
            raise ValueError(f"dispatch backend 'local' is for EP=1, but the expert-parallel group has "
                             f"{group.size()} ranks: use 'all_to_all' or 'deepep'")
        return LocalDispatcher(num_experts)
    if backend == "all_to_all":
        if node_groups is not None:
            from moefp8.dispatch.hierarchical import HierarchicalDispatcher

            return HierarchicalDispatcher(num_experts, *node_groups, scale_fmt)
        from moefp8.dispatch.all_to_all import AllToAllDispatcher

        return AllToAllDispatcher(num_experts, group, scale_fmt, capacity, mode, transport, slots, ranks_per_node)
    if backend == "deepep":
        try:
            import deep_ep  # noqa: F401
        except ImportError as e:
            raise ImportError(f"dispatch backend 'deepep' needs DeepEP, but `import deep_ep` failed ({e}). "
                              f"{DEEPEP_INSTALL}") from e
        from moefp8.dispatch.deepep import DeepEPDispatcher

        return DeepEPDispatcher(num_experts, group, scale_fmt)
    raise ValueError(f"unknown dispatch backend {backend!r}: expected 'local', 'all_to_all' or 'deepep'")


def ep_group_ranks(world_size: int, ep_size: int, num_experts: int) -> list[list[int]]:
    """The expert-parallel groups: consecutive ranks [i * ep_size, (i + 1) * ep_size) (on one node
    when ep_size <= GPUs per node, as torchrun numbers ranks), world_size / ep_size of them."""
    for name, v in (("world size", world_size), ("ep size", ep_size), ("expert count", num_experts)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"EP groups: {name} must be a positive integer, got {v!r}")
    if world_size % ep_size:
        raise ValueError(f"EP groups: ep size {ep_size} does not divide the world size {world_size}")
    if num_experts % ep_size:
        raise ValueError(f"EP groups: ep size {ep_size} does not divide the expert count {num_experts}")
    return [list(range(i, i + ep_size)) for i in range(0, world_size, ep_size)]


def build_ep_group(world_size: int, ep_size: int, num_experts: int, timeout=None, nccl_ctas: int = 0):
    """This rank's expert-parallel process group (torch.distributed must be initialized; every rank
    must call this, in the same order: new_group is collective). ep_size == world_size: a group of
    all ranks of its own, not the default group: a process group runs its collectives on one NCCL
    stream in the order issued, so on the default group each dispatch and combine of the backward
    would queue behind the data-parallel gradient all-reduces started before it (moefp8.grad_sync),
    on the step's critical path. timeout: a datetime.timedelta every collective of the group waits
    for its peers at most (None: torch's default for new groups, 30 min on gloo, not the default
    group's). nccl_ctas: on NCCL, the most CTAs each of the group's collectives may use (ncclConfig
    max_ctas; the SMs left to the compute beside an overlapped exchange); 0: NCCL's choice."""
    import torch.distributed as dist

    groups = ep_group_ranks(world_size, ep_size, num_experts)
    if dist.get_world_size() != world_size:
        raise ValueError(f"EP groups: world size {world_size} given, but torch.distributed has {dist.get_world_size()}")
    opts = None
    if nccl_ctas and dist.get_backend() == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.min_ctas, opts.config.max_ctas = 1, nccl_ctas
    mine = None
    for ranks in groups:
        g = dist.new_group(ranks, timeout=timeout, pg_options=opts)
        if dist.get_rank() in ranks:
            mine = g
    return mine


def node_limited_groups(ep_size: int, ranks_per_node: int, num_experts: int, topk: int, max_nodes: int) -> tuple:
    """Node-limited routing (DeepSeek-V3 caps each token at 4 nodes) as the router's group-limited
    top-k: -> (n_groups, topk_groups) for `moefp8.router.Router`.

    Experts are sharded contiguously over the EP group's ranks and the group's ranks are consecutive
    (`ep_group_ranks`), so the experts of node n of the group are the contiguous block
    [n * E / N, (n + 1) * E / N), N = ep_size / ranks_per_node nodes: one router group per node,
    and picking experts from the best `max_nodes` groups sends a token to at most that many nodes.
    max_nodes = 0 (off) or an EP group within one node: (1, 1), plain top-k. ValueError naming the
    value when the group does not cover whole nodes or top-k experts do not fit in max_nodes nodes."""
    for name, v in (("dispatch.max_nodes", max_nodes), ("ranks per node", ranks_per_node), ("ep size", ep_size)):
        if not isinstance(v, int) or v < (0 if name == "dispatch.max_nodes" else 1):
            raise ValueError(f"{name}={v!r}: must be an integer >= {0 if name == 'dispatch.max_nodes' else 1}")
    if max_nodes == 0 or ep_size <= ranks_per_node:
        return 1, 1
    if ep_size % ranks_per_node:
        raise ValueError(f"dispatch.max_nodes={max_nodes}: the EP group of {ep_size} ranks does not cover whole nodes "
                         f"of {ranks_per_node} ranks, so its experts do not split by node; make dispatch.ep_size a "
                         f"multiple of the ranks per node")
    nodes = ep_size // ranks_per_node
    per_node = num_experts // nodes
    if topk > min(max_nodes, nodes) * per_node:
        raise ValueError(f"dispatch.max_nodes={max_nodes}: top-{topk} experts cannot come from {min(max_nodes, nodes)} "
                         f"node(s) of {per_node} experts each; raise dispatch.max_nodes")
    return nodes, min(max_nodes, nodes)
