"""EP=1: every expert is local, nothing is sent. The reference for the other backends."""

from dataclasses import dataclass

from torch import Tensor

from moefp8.dispatch import Dispatched


@dataclass(frozen=True)
class LocalHandle:
    topk_idx: Tensor  # [T, K]
    topk_w: Tensor  # [T, K]

    def check(self) -> None:
        """Nothing to check (no input errors travel)."""


class LocalDispatcher:
    """`Dispatcher` for EP=1: every expert is local; dispatch returns its inputs, combine its input."""

    communicates = False
    scale_fmt = None  # no row travels: any scale format
    exchange_stream = None  # nothing is exchanged

    def __init__(self, num_experts: int):
        self.num_experts = self.num_local_experts = num_experts

    def dispatch(self, x, topk_idx: Tensor | None = None, topk_w: Tensor | None = None,
                 handle: LocalHandle | None = None) -> Dispatched:
        if handle is None:
            if topk_idx is None or topk_w is None:
                raise ValueError("dispatch: topk_idx and topk_w are required without a handle")
            handle = LocalHandle(topk_idx, topk_w)
        return Dispatched(x, handle.topk_idx, handle.topk_w, handle)

    def combine(self, y: Tensor, handle: LocalHandle) -> Tensor:
        return y

    def combine_buffer(self, handle: LocalHandle, C: int, device) -> None:
        """No send buffer: y is any tensor."""
        return None

    def packs_on_caller_stream(self, topk: int) -> bool:
        return False

    def static_exchange(self, topk: int) -> bool:
        return True  # nothing travels

    def flush_checks(self) -> None:
        """Nothing deferred."""
