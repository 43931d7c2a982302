"""Expert-parallel dispatch backends (DESIGN.md §3). Installed as `moefp8.dispatch`.

The interface (`Dispatcher`, two methods):

* ``dispatch(x, topk_idx, topk_w, handle=None) -> Dispatched``: sends each token's row (an
  "1x128" `Fp8Tensor` in the FP8 recipe, BF16 in the BF16 recipe) to the ranks owning its
  experts; returns the rows this rank received, their top-k expert ids in *local* numbering
  (-1 where the slot's expert lives on another rank), their routing weights, and a handle.
  With ``handle`` given, the routing of that earlier dispatch is reused and ``topk_*`` are
  ignored: that is how the backward pass sends the combine's gradient (FP8) along the same routes.
* ``combine(y, handle) -> out``: sums the rows a rank computed for each token back on the token's
  own rank, in BF16. It is also the backward of ``dispatch``.

Backends: ``local`` (EP=1, no communication, here); ``all_to_all`` (torch.distributed) and
``deepep`` (DeepEP's Buffer) land with the expert-parallel issue.
"""

from typing import NamedTuple, Protocol

from torch import Tensor

from moefp8.fp8 import Fp8Tensor


class Dispatched(NamedTuple):
    x: "Fp8Tensor | Tensor"  # received rows [T_recv, H]
    topk_idx: Tensor  # int64 [T_recv, K] local expert ids, -1 for experts on other ranks
    topk_w: Tensor  # fp32 [T_recv, K]
    handle: object  # the backend's frozen handle dataclass


class Dispatcher(Protocol):
    num_local_experts: int
    communicates: bool  # False: rows never leave the process (gradients arrive unquantized)

    def dispatch(self, x, topk_idx: Tensor | None = None, topk_w: Tensor | None = None,
                 handle: object | None = None) -> Dispatched: ...

    def combine(self, y: Tensor, handle: object) -> Tensor: ...


def build_dispatcher(backend: str, num_experts: int, group=None) -> Dispatcher:
    """The dispatcher for a backend name; ``group`` is the expert-parallel process group."""
    if backend == "local":
        from moefp8.dispatch.local import LocalDispatcher

        if group is not None and group.size() > 1:
            raise ValueError(f"dispatch backend 'local' is for EP=1, but the expert-parallel group has "
                             f"{group.size()} ranks: use 'all_to_all' or 'deepep'")
        return LocalDispatcher(num_experts)
    if backend in ("all_to_all", "deepep"):
        raise NotImplementedError(f"dispatch backend {backend!r} is not implemented yet; use 'local' (EP=1)")
    raise ValueError(f"unknown dispatch backend {backend!r}: expected 'local', 'all_to_all' or 'deepep'")
