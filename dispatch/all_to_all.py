"""Expert parallelism over `torch.distributed` all-to-all (NCCL on GPUs, gloo on CPU): the
reference for the DeepEP backend (docs/design.md §3).

Experts are sharded contiguously: rank r of the EP group (R ranks) owns the global experts
[r * E_l, (r + 1) * E_l), E_l = E / R.

Two modes, the same results (rows, order, combine sums bit for bit):

* "exact": only the routed tokens travel; their counts first (a small all_to_all and one host
  sync: they size the receive buffer), then the payload.
* "capacity": a fixed-size exchange, no count exchange and no host sync (DeepEP's
  `num_worst_tokens` idea). Each rank sends every rank a block of `cap + 1` rows, `cap` (the
  dispatcher's `capacity`) >= the tokens any rank passes: row t of block r holds token t if one of
  its experts lives on rank r, else only routing fields saying "no expert" (ids -1, the data left
  unwritten); the last row is a header (row bytes, cap, T, an input error code and value). The
  receiver gets R * (cap + 1) rows, in the same (source rank, token) order as the exact mode with
  the unsent slots interleaved as rows whose local ids are all -1: the MoE layer's permute skips
  them. Input errors travel in the headers, which reach the host (a pinned copy and an event, no
  stream sync) and are checked at the handle's first use (its combine or the dispatch reusing it)
  if the exchange has finished, else by `flush_checks()` (the training loop's, after its step's
  host sync): every rank raises the same error. The first header of each kind (row bytes,
  capacity, tokens) is always waited for at first use, so ranks whose exchanges would not line up
  stop before the next collective; after that no combine waits on the host for an exchange.

  What it costs: bytes on the wire per rank and dispatch, at hidden 7168, top-8 of 256 experts,
  T = cap = 4096 tokens per rank, routing uniform, one packed row nb = 7296 bytes (FP8 pow2 with
  routing fields): exact sends nb * p * R * T, capacity nb * R * (cap + 1), where p = 1 -
  C(E - E/R, K) / C(E, K) is the chance that a token has an expert on a given rank: p = 0.997 at
  R = 2 (capacity sends 0.3% more), 0.904 at R = 4 (+11%), 0.662 at R = 8 (+51%), 0.408 at R = 16
  (2.5x). The combine and the backward's dispatch move fixed blocks too (the same ratios). Hence
  the default ("auto"): capacity when the dispatcher has a capacity, R <= K (p >= 1 - 1/e) and
  the tensors are on a GPU (gloo is synchronous: no host sync to save on CPU), else exact.
  What it buys: no count exchange and no host sync (the host keeps queueing work, which the
  two-micro-batch overlap needs): at EP4 on H200s they were ~260 of the exact mode's 608 us
  per full FP8 dispatch (bench/notes/dispatch.md has the measurements of both modes).
  The receive buffer and the rows saved for backward hold R * (cap + 1) rows instead of ~p * R * T.

dispatch(x [T, H], topk_idx [T, K] global ids, topk_w [T, K]), exact mode:
  1. Each token goes ONCE to every rank owning at least one of its experts (as DeepEP does): the
     per-expert fan-out happens after receipt, by the layer's permute, from the local ids.
     Send order: grouped by destination rank (rank order), ascending token index within, so a
     rank receives rank 0's tokens first, then rank 1's, ... (the order the EP=1 layer would
     see if the ranks' batches were concatenated: the per-expert segments come out identical).
  2. One all_to_all_single of int64 [R, 2] = (rows, bytes per row) per peer: the split sizes
     (the host sync is unavoidable: they size the receive buffer) and a format check.
  3. One all_to_all_single of uint8 rows, everything a row needs packed in one buffer:

       with routing (forward):  | topk_w fp32 4K | topk_idx int32 4K (local) | data | scales | pad |
       reusing a handle:        | data | scales | pad |

     data: FP8 H bytes, or BF16 2H bytes; scales (FP8 only): UE8M0 one byte per 128 elements
     (`pack_ue8m0`, the pow2 recipe) or, with scale_fmt="fp32", the fp32 scales (4 bytes each:
     amax/448 is not a power of two and has no byte form). Rows are padded to 16 bytes so every
     field can be viewed in place (no unpacking copy except the UE8M0 -> fp32 scales).
     Bytes per token at H=7168, K=8: FP8 pow2 7296, BF16 14400 (ratio 0.507); backward (no
     routing fields) FP8 7232.
  The sender writes each row's expert ids as its destination rank's local ids (-1 for slots
  whose expert lives elsewhere), in the pack kernel: the receiver uses them as they arrive.

Capacity mode: the same row format; one all_to_all_single of R x (cap + 1) rows
(`kernels/pack.py:pack_capacity` packs them with the routes and the checks in one launch), or,
with transport="copy_engine", the same exchange as NVLink peer copies (`copy_engine.py`): no
kernel spinning on SMs while peers lag, which is what NCCL's kernels cost an overlapped
persistent GEMM (bench/notes/overlap.md).

combine(y [T_recv, H], handle): the reverse all_to_all of the rows (each already the weighted
sum over this rank's local experts), then each token's rows are summed over source ranks in
rank order, in fp32, rounded once to BF16: deterministic, no atomics. y may also be fp32 (the
MoE layer sends the routing weights' gradient [T_recv, K] back this way): summed in fp32 and
returned fp32.

All ranks of the group must call dispatch and combine the same number of times in the same
order (they are collectives), including ranks with zero tokens, with the same payload kind,
hidden size, top-k and (capacity mode) capacity: the exact mode checks this in its count exchange,
the capacity mode in the headers, after the fact (a transport that refuses mismatched sizes may
fail first).
"""
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from moefp8.dispatch import Dispatched
from moefp8.dispatch.copy_engine import check_slots
from moefp8.fp8 import FP8_DTYPE, TILE, Fp8Tensor, check_scale_fmt, record_stream, unpack_ue8m0
from moefp8.kernels.pack import (ERR_BAD_EXPERT, ERR_BAD_SCALE, ERR_OVER_CAPACITY, HDR_MAGIC, HDR_WORDS,
                                 dispatch_layout, pack_capacity, pack_capacity_cached, pack_rows, pairs_per_expert)
from moefp8.kernels.permute import PermuteLayout, unpermute_combine

ROW_ALIGN = 16  # bytes: every field of a packed row starts 4-aligned, rows 16-aligned for the copy engines
MODES = ("auto", "exact", "capacity")
TRANSPORTS = ("collective", "copy_engine")
_SCALES = {"bf16": "none", "fp8-pow2": "ue8m0", "fp8-fp32": "fp32"}  # payload -> how scales travel


@dataclass(frozen=True)
class AllToAllHandle:
    """The routes of one exact-mode dispatch, reused by its combine and by the backward's dispatch.

    send_tok:    int64 [S]     token (row of x) of each sent row, grouped by destination rank
    pos_TR:      int32 [T, R]  index into the sent rows of (token t, rank r); -1 if t is not sent to r
    send_splits: tuple[int]    rows sent to each rank (len R)
    recv_splits: tuple[int]    rows received from each rank (len R)
    num_tokens:  int           T, rows of x on this rank
    topk_idx:    int64 [T_recv, K]  received local expert ids, -1 for experts on other ranks
    topk_w:      fp32  [T_recv, K]  received routing weights (all K slots)
    """

    send_tok: Tensor
    pos_TR: Tensor
    send_splits: tuple
    recv_splits: tuple
    num_tokens: int
    topk_idx: Tensor
    topk_w: Tensor

    @property
    def num_recv(self) -> int:
        return sum(self.recv_splits)

    def check(self) -> None:
        """Nothing to check: the exact mode raised input errors in its dispatch."""


MAX_PENDING_CHECKS = 512  # deferred header checks kept before the oldest is waited for


class _Headers:
    """The R headers a capacity-mode dispatch received, on their way to the host (a pinned copy
    queued after the exchange and an event: reading them waits for the exchange, not for the work
    queued after it), checked once. Mutable, so that the frozen handle can hold it. kind: what
    must match on every rank for the exchanges to line up (row bytes, capacity, tokens): the
    dispatcher waits for the first check of each kind and defers the later ones."""

    def __init__(self, hdr_RW: Tensor, raise_bad, kind: tuple = ()):
        self.raise_bad, self.done, self.event, self.kind = raise_bad, False, None, kind
        self.queued = False  # left for the dispatcher's flush_checks
        if hdr_RW.is_cuda and torch.cuda.is_current_stream_capturing():
            # in a CUDA graph (moefp8.graphs: whole blocks under EP) no pinned copy can be made, and a replay
            # runs no Python to read one: the replays' inputs go unchecked. Every exchange's first of each kind
            # was checked before (the capture's eager warm-up), and the eager steps check theirs as ever.
            self.done, self.host = True, None
        elif hdr_RW.is_cuda:
            self.host = torch.empty(hdr_RW.shape, dtype=hdr_RW.dtype, pin_memory=True)
            self.host.copy_(hdr_RW, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = hdr_RW.clone()

    def check(self, wait: bool = True) -> bool:
        """Raises the reported input error; -> whether checked (wait=False: not if the exchange
        has not finished yet)."""
        if self.done:
            return True
        if self.event is not None:
            if wait:
                self.event.synchronize()
            elif not self.event.query():
                return False
        self.raise_bad(self.host.tolist())
        self.done = True
        return True


@dataclass(frozen=True)
class CapacityHandle:
    """The routes of one capacity-mode dispatch (module docstring), reused like AllToAllHandle.

    pos_TR:     int32 [T, R]  row of (token t, rank r) in the exchanged blocks, r * (cap + 1) + t
                              (compacted blocks, `dispatch(rows=)`: r * (cap + 1) + its place among
                              the tokens sent to r); -1 if t is not sent to r
    cap:        int           rows per block, the header excluded (the capacity, or `rows`)
    num_tokens: int           T, rows of x on this rank
    topk_idx:   int64 [R * (cap + 1), K]  received local expert ids; -1 for experts on other ranks
                              and on every slot of the unsent and header rows
    topk_w:     fp32  [R * (cap + 1), K]  received routing weights (0 on unsent and header rows)
    headers:    the received headers; `check()` raises their input errors (once, on every rank)
    """

    pos_TR: Tensor
    cap: int
    num_tokens: int
    topk_idx: Tensor
    topk_w: Tensor
    headers: _Headers

    @property
    def num_recv(self) -> int:
        return self.topk_idx.shape[0]

    def check(self) -> None:
        """Raises the input error that any rank's dispatch reported (the same on every rank);
        waits for this dispatch's exchange. (The dispatcher's own combines and dispatches check
        through `AllToAllDispatcher._check`, which defers what it can to `flush_checks`.)"""
        self.headers.check()


def row_bytes(H: int, K: int | None, payload: str) -> int:
    """Bytes of one packed row: payload "fp8-pow2" | "fp8-fp32" | "bf16"; K=None: no routing fields."""
    if payload == "bf16":
        n = 2 * H
    elif payload in ("fp8-pow2", "fp8-fp32"):
        n = H + (H // TILE) * (1 if payload == "fp8-pow2" else 4)
    else:
        raise ValueError(f"row_bytes: payload={payload!r}, expected 'fp8-pow2', 'fp8-fp32' or 'bf16'")
    if K is not None:
        n += 8 * K
    return -(-n // ROW_ALIGN) * ROW_ALIGN


class AllToAllDispatcher:
    """`Dispatcher` over all_to_all_single in `group` (None: the default group).

    scale_fmt: the FP8 recipe's scale format, which fixes the wire format of the scales
    ("pow2": UE8M0 bytes; "fp32": 4-byte scales); every rank must use the same.
    capacity: the most tokens any rank of the group passes to one dispatch (the same on every
    rank; e.g. micro-batch x sequence length), which enables the capacity mode; None: exact only.
    mode: "exact", "capacity" (needs capacity) or "auto" (capacity on GPUs when there is one and
    the group has at most top-k ranks, else exact; decided per dispatch, the same on every rank).
    transport: how the bytes move: "collective" (`dist.all_to_all_single`: NCCL kernels on GPUs,
    gloo on CPU) or "copy_engine" (`copy_engine.py`: NVLink peer copies, no kernel waiting on
    SMs; one host, CUDA; the capacity mode only, so it makes "auto" capacity and refuses "exact").
    slots: the copy-engine transport's ring of send slots (`copy_engine.py`: more slots, fewer
    waits for the slowest peer on the producer's stream; each slot one send buffer of memory)."""

    communicates = True

    def __init__(self, num_experts: int, group=None, scale_fmt: str = "pow2", capacity: int | None = None,
                 mode: str = "auto", transport: str = "collective", slots: int = 4, ranks_per_node: int | None = None):
        check_scale_fmt(scale_fmt)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if num_experts < 1 or num_experts % self.world:
            raise ValueError(f"AllToAllDispatcher: {num_experts} experts cannot be split evenly over the "
                             f"{self.world} ranks of the expert-parallel group")
        if mode not in MODES:
            raise ValueError(f"AllToAllDispatcher: mode={mode!r}, expected one of {MODES}")
        if capacity is not None and (not isinstance(capacity, int) or capacity < 0):
            raise ValueError(f"AllToAllDispatcher: capacity={capacity!r}, expected None or an integer >= 0 "
                             f"(the most tokens a rank passes to one dispatch)")
        if mode == "capacity" and capacity is None:
            raise ValueError("AllToAllDispatcher: mode='capacity' needs a capacity (the most tokens any rank "
                             "passes to one dispatch)")
        if transport not in TRANSPORTS:
            raise ValueError(f"AllToAllDispatcher: transport={transport!r}, expected one of {TRANSPORTS}")
        if transport == "copy_engine" and (mode == "exact" or capacity is None):
            raise ValueError(f"AllToAllDispatcher: transport='copy_engine' moves the capacity mode's equal blocks "
                             f"only; got mode={mode!r}, capacity={capacity!r}: give a capacity and mode 'capacity' "
                             f"or 'auto', or use transport='collective'")
        self.num_experts, self.scale_fmt, self.capacity, self.mode = num_experts, scale_fmt, capacity, mode
        check_slots(slots, "AllToAllDispatcher")  # here, not at the first exchange
        self.transport, self.slots = transport, slots
        if ranks_per_node is not None and (ranks_per_node < 1 or self.world % ranks_per_node):
            raise ValueError(f"AllToAllDispatcher: ranks_per_node={ranks_per_node!r} does not divide the group's "
                             f"{self.world} ranks into nodes")
        # a group spanning nodes: the combine sums per node first (`sum_over_ranks`), as the hierarchical mode must
        self.ranks_per_node = ranks_per_node if ranks_per_node and ranks_per_node < self.world else None
        self._ce = None  # the CopyEngineExchange, made at the first exchange
        # A CUDA stream for the communication (set by moefp8.overlap around its calls): the
        # capacity mode then packs on the caller's stream and exchanges and unpacks on this one
        # (results valid on it); the exact mode and the combine run wholly on it. None: all on
        # the caller's stream.
        self.exchange_stream = None
        self.num_local_experts = num_experts // self.world
        # capacity mode: header checks left for `flush_checks` (their exchange had not finished when
        # first used), and the header kinds (row bytes, capacity, tokens) already seen to match
        self._pending: list[_Headers] = []
        self._kinds_checked: set[tuple] = set()

    def _check(self, handle) -> None:
        """At a handle's first use (its combine, a dispatch reusing it): the exact mode checked its
        inputs already; the capacity mode's headers are checked now if their exchange has finished,
        else left for `flush_checks` -- but the first of each kind (row bytes, capacity, tokens) is
        waited for, so that a rank whose exchanges would not line up with the others' stops at its
        first one, before the next collective. A later input error (a bad expert id, a scale that
        is not a power of two) is raised by `flush_checks`, on every rank alike: the exchange moved
        fixed blocks, so nothing hangs or reads out of bounds meanwhile."""
        if not isinstance(handle, CapacityHandle) or handle.headers.done:
            return
        h = handle.headers
        if h.kind not in self._kinds_checked:
            h.check()
            self._kinds_checked.add(h.kind)
        elif not h.queued and not h.check(wait=False):
            h.queued = True
            self._pending.append(h)
            while len(self._pending) > MAX_PENDING_CHECKS:  # nobody flushes (a benchmark loop): the oldest
                self._pending.pop(0).check()

    def flush_checks(self) -> None:
        """Checks the headers `_check` deferred (waiting for their exchanges) and raises the first
        input error. The training loop calls it after its step's host sync (by then nothing waits)."""
        pending, self._pending = self._pending, []
        for h in pending:
            h.check()

    def mode_for(self, K: int, cuda: bool = True) -> str:
        """The mode a dispatch with top-k K (of CUDA tensors, or not) runs in: "exact" or "capacity".
        "auto" picks capacity on GPUs only: gloo's collectives are synchronous, so on CPU there is no
        host sync to save and the fixed blocks would only cost bytes."""
        if self.mode != "auto":
            return self.mode
        if self.transport == "copy_engine":
            return "capacity"
        return "capacity" if self.capacity is not None and self.world <= K and cuda else "exact"

    def compacted_rows(self, topk: int, factor: float) -> int | None:
        """The rows of compacted send blocks (`dispatch(rows=)`) for top-k routing: factor x p x capacity,
        p = 1 - C(E - E_l, K) / C(E, K) the chance that a token has an expert on a given rank under uniform
        routing, at most the capacity; the same on every rank. None without a capacity."""
        if not self.capacity:
            return None
        E, E_l = self.num_experts, self.num_local_experts
        p = 1 - math.comb(E - E_l, topk) / math.comb(E, topk)
        return min(self.capacity, math.ceil(factor * p * self.capacity))

    def packs_on_caller_stream(self, topk: int) -> bool:
        """The capacity mode packs on the caller's stream and exchanges and unpacks on
        `exchange_stream`; the exact mode runs wholly on it (its count exchange comes first)."""
        return self.mode_for(topk, True) == "capacity"

    def static_exchange(self, topk: int) -> bool:
        """The capacity mode over NCCL: fixed blocks, no count exchange, its headers read without a
        sync (and not at all inside a CUDA graph, `_Headers`). The copy engines' transport claims
        send slots and waits for its peers' pulls on the host: not in a graph."""
        return self.mode_for(topk, True) == "capacity" and self.transport == "collective"

    # ------------------------------------------------------------------------------------------

    def _payload(self, x) -> str:
        if isinstance(x, Fp8Tensor):
            if x.layout != "1x128" or x.data.dim() != 2 or x.data.dtype != FP8_DTYPE:
                raise ValueError(f"dispatch: expected a '1x128' Fp8Tensor [T, H] of {FP8_DTYPE}, got layout "
                                 f"{x.layout!r}, {x.data.dtype} {tuple(x.data.shape)}")
            return f"fp8-{self.scale_fmt}"
        if not isinstance(x, Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
            what = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"dispatch: expected an Fp8Tensor or a bfloat16 tensor [T, H], got {what}")
        return "bf16"

    def _check_topk(self, T: int, topk_idx, topk_w) -> None:
        """Shapes and dtypes, on the host; the id range is checked on the device and reported with
        the count exchange or the headers, so that every rank raises together."""
        if topk_idx is None or topk_w is None:
            raise ValueError("dispatch: topk_idx and topk_w are required without a handle")
        if topk_idx.dim() != 2 or topk_idx.shape[0] != T or topk_idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"dispatch: topk_idx must be int32/int64 [T={T}, K], got {topk_idx.dtype} "
                             f"{tuple(topk_idx.shape)}")
        if topk_w.shape != topk_idx.shape or not topk_w.is_floating_point():
            raise ValueError(f"dispatch: topk_w must be float {tuple(topk_idx.shape)} like topk_idx, got "
                             f"{topk_w.dtype} {tuple(topk_w.shape)}")

    def _raise_bad(self, bad: list) -> None:
        """bad: (code, value) per source rank, in rank order; raises the first error."""
        for src, (code, val) in enumerate(bad):
            if code == ERR_OVER_CAPACITY:
                raise ValueError(f"dispatch: rank {src} of the EP group passed {val} tokens, more than the "
                                 f"dispatcher's capacity {self.capacity}: build it with a capacity >= the most tokens "
                                 f"a rank passes to one dispatch, or mode='exact'")
            if code == ERR_BAD_EXPERT:
                raise ValueError(f"dispatch: rank {src} of the EP group passed topk_idx holding expert {val}, "
                                 f"expected -1 (no expert) or an id in [0, {self.num_experts})")
            if code == ERR_BAD_SCALE:
                raise ValueError(f"dispatch: rank {src} of the EP group passed FP8 scales that are not powers of "
                                 f"two, but this dispatcher sends UE8M0 scales (scale_fmt='pow2'); build it with "
                                 f"scale_fmt='fp32' for the fp32-scale recipe")

    def _raise_bad_headers(self, nb: int, payload: str, H: int, K: int, rows: int, headers: list) -> None:
        """headers: int64 [magic, row bytes, rows per block, T, code, value] per source rank (capacity mode)."""
        for src, (magic, b, cap, _, _, _) in enumerate(headers):
            if magic != HDR_MAGIC or b != nb or cap != rows:
                raise ValueError(f"dispatch: rank {src} of the EP group sent a capacity-mode block that does not "
                                 f"match this rank's ({self.rank}: rows of {nb} bytes, {payload}, H={H}, K={K}, "
                                 f"blocks of {rows} rows, capacity {self.capacity}); got {b} bytes, {cap} rows: every "
                                 f"rank must dispatch the same payload kind, scale format, hidden size and top-k, with "
                                 f"the same capacity and block rows")
        self._raise_bad([h[4:] for h in headers])

    def _unpack(self, buf: Tensor, H: int, K: int | None, payload: str):
        """uint8 [N, row_bytes] -> (x, topk_w, local topk_idx) as views of buf (scales: UE8M0 unpacked)."""
        off, w, idx = 0, None, None
        if K is not None:
            w = buf[:, :4 * K].view(torch.float32)
            idx = buf[:, 4 * K:8 * K].view(torch.int32)
            off = 8 * K
        if payload == "bf16":
            return buf[:, off:off + 2 * H].view(torch.bfloat16), w, idx
        G = H // TILE
        data = buf[:, off:off + H].view(FP8_DTYPE)
        off += H
        if payload == "fp8-pow2":
            scale = unpack_ue8m0(buf[:, off:off + G])
        else:
            scale = buf[:, off:off + 4 * G].view(torch.float32)
        return Fp8Tensor(data, scale, "1x128"), w, idx

    @contextmanager
    def _on_exchange_stream(self, *inputs):
        """Run the body on `exchange_stream` (if set) after the caller's stream, `inputs` (tensors or
        Fp8Tensors made on the caller's stream) kept alive for it."""
        s = self.exchange_stream
        if s is None:
            yield
            return
        s.wait_stream(torch.cuda.current_stream(s.device))
        record_stream(s, *inputs)
        with torch.cuda.stream(s):
            yield

    def _copy_engine(self):
        if self._ce is None:
            from moefp8.dispatch.copy_engine import CopyEngineExchange

            self._ce = CopyEngineExchange(self.group, self.slots)
        return self._ce

    def _send_buffer(self, rows: int, nb: int, device) -> Tensor | None:
        """Where the capacity mode's pack writes its send buffer: the copy engines' send slot (then
        nothing is staged), else None (a new tensor)."""
        if self.transport != "copy_engine" or device.type != "cuda":
            return None
        return self._copy_engine().send_buffer(rows, nb, device)

    def combine_buffer(self, handle, C: int, device) -> Tensor | None:
        """A bf16 [T_recv, C] to write the next combine's input y into (`unpermute_combine(out=)`),
        or None (then y is any tensor). With transport='copy_engine' it is the exchange's send
        slot: the combine then moves y without staging it. Call it right before making y, and
        pass y to the next combine on every rank (the slots are claimed in call order)."""
        if not isinstance(handle, CapacityHandle):
            return None
        buf = self._send_buffer(handle.num_recv, 2 * C, device)
        return None if buf is None else buf.view(torch.bfloat16)

    def _exchange(self, send: Tensor, send_splits, recv_splits) -> Tensor:
        if self.transport == "copy_engine":  # capacity mode: equal splits
            if not send.is_cuda:
                raise ValueError(f"dispatch: transport='copy_engine' needs CUDA tensors, got {send.device}: use "
                                 f"transport='collective' on CPU")
            return self._copy_engine()(send)
        recv = torch.empty(sum(recv_splits), send.shape[1], dtype=torch.uint8, device=send.device)
        dist.all_to_all_single(recv, send, list(recv_splits), list(send_splits), group=self.group)
        return recv

    # ------------------------------------------------------------------------------------------

    def dispatch(self, x, topk_idx: Tensor | None = None, topk_w: Tensor | None = None,
                 handle: AllToAllHandle | CapacityHandle | None = None, rows: int | None = None) -> Dispatched:
        """x: "1x128" Fp8Tensor [T, H] or bf16 [T, H]; topk_idx int [T, K] global expert ids (-1: none);
        topk_w float [T, K]. -> Dispatched(rows [T_recv, H] like x, local topk_idx int64 [T_recv, K]
        (-1 for experts on other ranks), topk_w fp32 [T_recv, K], handle). With `handle`, its routes
        are reused (topk_* ignored) and only the rows travel. In capacity mode T_recv = R * (cap + 1)
        and the rows of unsent slots (all their ids -1) hold unwritten data: use them only through
        the ids, as the layer's permute does.
        rows (capacity mode; the same on every rank): blocks of `rows` rows instead of cap + its
        header, compacted (`pack_capacity`): fewer bytes where a token reaches a rank with probability
        p < 1 (1 - C(E - E_l, K) / C(E, K): 0.84 at top-6 of 64 experts over 4 ranks, 0.57 over 8).
        A token that finds its block full is dropped and `Dispatched.overflow` (int32 [1], on the
        device, no sync) is 1 on the sending rank: the caller must not use that step's results (the
        training loop runs it again without `rows`, `moe_stages.RowCap`). Ignored in exact mode,
        which sends only the routed tokens anyway."""
        payload = self._payload(x)
        T, H = x.shape
        if handle is not None:
            if T != handle.num_tokens:
                raise ValueError(f"dispatch: x has {T} rows but the handle was made for {handle.num_tokens} tokens")
            self._check(handle)
            if isinstance(handle, CapacityHandle):
                R, cap = self.world, handle.cap
                nb = row_bytes(H, None, payload)
                send = pack_capacity_cached(x, handle.pos_TR, cap, nb, _SCALES[payload],
                                            out=self._send_buffer(R * (cap + 1), nb, x.data.device))
                with self._on_exchange_stream(send):
                    recv = self._exchange(send, [cap + 1] * R, [cap + 1] * R)
                    xr, _, _ = self._unpack(recv, H, None, payload)
            else:
                with self._on_exchange_stream(x):
                    send = pack_rows(x, handle.send_tok, row_bytes(H, None, payload), _SCALES[payload])
                    recv = self._exchange(send, handle.send_splits, handle.recv_splits)
                    xr, _, _ = self._unpack(recv, H, None, payload)
            return Dispatched(xr, handle.topk_idx, handle.topk_w, handle)
        self._check_topk(T, topk_idx, topk_w)
        if self.mode_for(topk_idx.shape[1], topk_idx.is_cuda) == "capacity":
            return self._dispatch_capacity(x, payload, topk_idx, topk_w, rows)
        with self._on_exchange_stream(x, topk_idx, topk_w):
            return self._dispatch_exact(x, payload, topk_idx, topk_w)

    def _dispatch_exact(self, x, payload: str, topk_idx: Tensor, topk_w: Tensor) -> Dispatched:
        T, H = x.shape
        K, R = topk_idx.shape[1], self.world
        nb = row_bytes(H, K, payload)
        # One launch computes the routes (each token once per destination rank), the send order
        # (rank, then token), the positions, the input checks and this rank's row of the count
        # exchange; one more packs the send buffer (destination-local ids). Then one exchange of
        # (rows, bytes per row, error code, offending value) and the one host sync: a bad input
        # on any rank makes every rank raise the same error (no rank left waiting).
        meta, pos_TR, send_tok, dest, n_send = dispatch_layout(topk_idx, self.num_experts, R, nb,
                                                              x.scale if payload == "fp8-pow2" else None)
        packed = pack_rows(x, send_tok, nb, _SCALES[payload], topk_idx, topk_w, dest, self.num_local_experts,
                           n_valid=n_send)
        # and each destination's pairs per local expert, so that the receiver's layout needs no read-back
        # of its own (bad ids counted nowhere: the meta's error code raises below)
        El = self.num_local_experts
        meta = torch.cat([meta, pairs_per_expert(topk_idx, self.num_experts).view(R, El)], dim=1)
        meta_in = torch.empty_like(meta)
        dist.all_to_all_single(meta_in, meta, group=self.group)
        both = torch.cat([meta[:, 0], meta_in.reshape(-1)]).tolist()  # the host sync
        send_splits = tuple(both[:R])
        W = 4 + El
        recv_meta = [both[R + W * i:R + W * i + 4] for i in range(R)]
        counts = [sum(both[R + W * i + 4 + e] for i in range(R)) for e in range(El)]
        self._raise_bad([m[2:] for m in recv_meta])
        for src, (_, b, _, _) in enumerate(recv_meta):
            if b != nb:
                raise ValueError(f"dispatch: rank {src} of the EP group sends rows of {b} bytes, this rank "
                                 f"({self.rank}) packs {nb} ({payload}, H={H}, K={K}): every rank must dispatch "
                                 f"the same payload kind, scale format, hidden size and top-k")
        recv_splits = tuple(m[0] for m in recv_meta)
        S = sum(send_splits)
        xr, w, local = self._unpack(self._exchange(packed[:S], send_splits, recv_splits), H, K, payload)
        local = local.long()  # already the local ids: the sender wrote them for this rank
        handle = AllToAllHandle(send_tok[:S], pos_TR, send_splits, recv_splits, T, local, w)
        return Dispatched(xr, local, w, handle, counts)

    def _dispatch_capacity(self, x, payload: str, topk_idx: Tensor, topk_w: Tensor, rows: int | None) -> Dispatched:
        T, H = x.shape
        K, R = topk_idx.shape[1], self.world
        cap = self.capacity if rows is None else min(rows, self.capacity)  # rows per block
        nb = row_bytes(H, K, payload)
        if nb - 8 * K < 8 * HDR_WORDS:
            raise ValueError(f"dispatch: capacity mode needs rows of at least {8 * HDR_WORDS} data bytes for its "
                             f"header, got {nb - 8 * K} ({payload}, H={H}); use mode='exact'")
        # One launch: routes, local ids, positions, the checks into each block's header, the send
        # buffer; then the exchange of fixed blocks. No host sync: the headers are read when the
        # handle is first used (a bad input on any rank makes every rank raise there).
        if self.transport == "copy_engine":  # its buffer sized for this dispatch's combine too (BF16 rows)
            self._copy_engine().reserve((cap + 1) * max(nb, 2 * H))
        send, pos_TR, overflow = pack_capacity(x, topk_idx, topk_w, self.num_experts, R, self.capacity, nb,
                                               _SCALES[payload], check_scales=payload == "fp8-pow2",
                                               out=self._send_buffer(R * (cap + 1), nb, topk_idx.device),
                                               rows=None if cap == self.capacity else cap)
        with self._on_exchange_stream(send):
            recv = self._exchange(send, [cap + 1] * R, [cap + 1] * R)
            xr, w, local = self._unpack(recv, H, K, payload)
            local = local.long()
            hdr = recv.view(R, cap + 1, nb)[:, cap, 8 * K:8 * K + 8 * HDR_WORDS].view(torch.int64)
            headers = _Headers(hdr, lambda h: self._raise_bad_headers(nb, payload, H, K, cap, h), kind=(nb, cap, T))
        handle = CapacityHandle(pos_TR, cap, T, local, w, headers)
        return Dispatched(xr, local, w, handle, overflow=overflow)

    def combine(self, y: Tensor, handle: AllToAllHandle | CapacityHandle) -> Tensor:
        """y [T_recv, C] bf16 (or fp32) in received order -> [T, C] like y: out[t] = sum over the
        ranks r that received t, in rank order, of their row for t; fp32 sums, one rounding. Rows
        of unsent slots (capacity mode) are sent back and ignored."""
        if not isinstance(y, Tensor) or y.dim() != 2 or y.dtype not in (torch.bfloat16, torch.float32):
            what = f"{y.dtype} {tuple(y.shape)}" if isinstance(y, Tensor) else type(y).__name__
            raise ValueError(f"combine: expected a bfloat16 or float32 tensor [T_recv, C], got {what}")
        if y.shape[0] != handle.num_recv:
            raise ValueError(f"combine: y has {y.shape[0]} rows, the dispatch received {handle.num_recv}")
        self._check(handle)
        with self._on_exchange_stream(y):
            if isinstance(handle, CapacityHandle):
                splits = [handle.cap + 1] * self.world
                back = self._exchange(_as_bytes(y), splits, splits)
            else:
                back = self._exchange(_as_bytes(y), handle.recv_splits, handle.send_splits)
            return sum_over_ranks(back.view(y.dtype), handle.pos_TR, y.shape[1], self.ranks_per_node)


def _as_bytes(t: Tensor) -> Tensor:
    """[N, C] of any dtype -> uint8 [N, C * itemsize], a view where possible (empty tensors can have
    any strides, which view(uint8) refuses)."""
    if t.numel() == 0:
        return torch.empty(t.shape[0], t.shape[1] * t.element_size(), dtype=torch.uint8, device=t.device)
    return t.contiguous().view(torch.uint8)


def sum_over_ranks(rows_SC: Tensor, pos_TR: Tensor, C: int, ranks_per_node: int | None = None) -> Tensor:
    """rows [S, C] (row pos[t, r] belongs to token t, from rank r) -> [T, C] like rows: the sum over r
    in rank order, in fp32, rounded once. BF16 goes through the permute module's combine kernel
    (weights 1.0: exact products), fp32 through the PyTorch loop. ranks_per_node G (a group spanning
    nodes): each node's G ranks summed so first (rounded to the rows' dtype), then the nodes' sums
    the same way over the nodes that hold a row for t: the hierarchical dispatch's order
    (dispatch/hierarchical.py), so that the two modes agree bit for bit."""
    T, R = pos_TR.shape
    if ranks_per_node is not None and ranks_per_node < R:
        G = ranks_per_node
        parts = [sum_over_ranks(rows_SC, pos_TR[:, n:n + G].contiguous(), C) for n in range(0, R, G)]
        held = (pos_TR.view(T, R // G, G) >= 0).any(-1)  # [T, N]: node n holds a row for t
        rows_NC = torch.cat(parts) if parts else rows_SC.new_zeros(0, C)
        pos_TN = torch.where(held, torch.arange(R // G, device=pos_TR.device) * T + torch.arange(T, device=pos_TR.device)[:, None],
                             -1).to(pos_TR.dtype)
        return sum_over_ranks(rows_NC, pos_TN, C)
    if rows_SC.shape[0] == 0:  # nothing came back (no token of this rank had an expert anywhere)
        return torch.zeros(T, C, dtype=rows_SC.dtype, device=rows_SC.device)
    if rows_SC.dtype == torch.bfloat16:
        layout = PermuteLayout(pos_TR, pos_TR.new_empty(0), pos_TR.new_empty(0), [], rows_SC.shape[0])
        return unpermute_combine(rows_SC, layout, torch.ones(T, R, dtype=torch.float32, device=rows_SC.device))
    out = torch.zeros(T, C, dtype=torch.float32, device=rows_SC.device)
    for r in range(R):
        p = pos_TR[:, r].long()
        out += torch.where((p >= 0)[:, None], rows_SC[p.clamp(min=0)].float(), 0.0)
    return out.to(rows_SC.dtype)
