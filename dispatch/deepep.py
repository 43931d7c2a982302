"""Expert parallelism over DeepEP's NVLink kernels (`deep_ep.Buffer`, normal intranode mode): the
`deepep` dispatch backend (docs/design.md §3). DeepEP is not on PyPI: see the README to install it.

The same `Dispatcher` contract as `all_to_all.py` (its exact mode is this backend's reference):

* dispatch(x, topk_idx, topk_w): DeepEP's layout kernel (tokens per rank and per expert, token
  in rank), then its dispatch: each token once per rank owning one of its experts, received in
  (source rank, token) order, the order of the all_to_all backend and of the EP=1 layer on the
  concatenated batch. x is a "1x128" `Fp8Tensor` (sent as DeepEP's FP8 pair: e4m3 data and fp32
  scales [T, H/128], so 4 bytes per scale where all_to_all sends one UE8M0 byte) or BF16. The
  received ids are local (-1 for experts elsewhere); DeepEP zeroes the weights of those slots.
  DeepEP's normal dispatch waits on the host for the counts (it sizes the receive buffer).
* dispatch(x, handle=h): DeepEP's cached dispatch along h's routes (the backward's FP8 gradient).
* combine(y bf16 [T_recv, H], h): DeepEP's combine: each token's rows summed in fp32 over the
  ranks in rank order, rounded once (the all_to_all backend's sum, bit for bit). y fp32
  [T_recv, C <= 32] (the routing weights' gradient, where each (token, column) is nonzero on one
  rank at most): its bytes travel as BF16 columns, one byte per column (integers 0-255 are exact
  in BF16 and the other ranks add zeros), padded to the buffer's row width, through the same BF16
  combine, and are reassembled.
  DeepEP's own fp32 path (combine's top-k weights) returned other tokens' values and garbage for
  some entries on an H200 (v1.2.1 intranode, 2 ranks: 24-181 of 888 entries), so it is not used.

Overlap (optional members, DeepEP's event API): `dispatch_async` / `combine_async` take
`previous_event` (run after it instead of after the current stream) and
`allocate_on_comm_stream`, finish asynchronously on DeepEP's communication stream and return
(result, event); `event.current_stream_wait()` (or `with event:`) before using the result.
`capture()` gives an event on the current stream. `set_num_sms(n)`: SMs of the dispatch/combine
kernels (even; DeepEP's default 20), this dispatcher only; a handle is tied to the SM count it was
made with (DeepEP's channels), so change it between steps, not between a dispatch and its reuse.

Input errors: a bad expert id (outside [-1, E)) on any rank makes every rank raise, at the same
dispatch: a one-launch kernel (`kernels/pack.py:flag_bad_experts`) adds a flag to the token counts
DeepEP exchanges anyway, so no extra collective and no extra host sync (DeepEP itself ignores such
ids). The error names how many ranks passed one; the ranks that did name their largest bad id.

The one singleton: the `deep_ep.Buffer` (NVLink IPC buffers of DeepEP's size hint, 0.34 GB per
GPU at hidden 7168, 8 ranks, 20 SMs) is owned by its dispatcher, allocated at the first dispatch
for that hidden size (collective:
every rank of the group dispatches together) and released by `close()` (collective too; call it on
every rank, or let the process exit).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from moefp8.dispatch import Dispatched
from moefp8.fp8 import FP8_DTYPE, TILE, Fp8Tensor, check_scale_fmt
from moefp8.kernels.pack import BAD_RANK_FLAG, flag_bad_experts


def fp32_to_byte_cols(y: Tensor, min_cols: int = 8) -> Tensor:
    """fp32 [N, C] -> bf16 [N, max(4C, min_cols) rounded up to 8]: byte j of y[:, c] as the integer
    value of column 4c + j (exact in BF16); the padding is 0. A sum over ranks of such rows, where
    at most one rank is nonzero per (row, column), gives the bytes back (`byte_cols_to_fp32`)."""
    N, C = y.shape
    b = y.contiguous().view(torch.int32)
    cols = torch.stack([(b >> s) & 0xFF for s in (0, 8, 16, 24)], dim=-1).reshape(N, 4 * C)
    width = -(-max(4 * C, min_cols) // 8) * 8
    return torch.nn.functional.pad(cols, (0, width - 4 * C)).to(torch.bfloat16)


def byte_cols_to_fp32(cols: Tensor, C: int) -> Tensor:
    b = cols[:, :4 * C].to(torch.int32).reshape(-1, C, 4)
    return (b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)).view(torch.float32)


RANKS = (2, 4, 8)  # group sizes of DeepEP's intranode kernels (all ranks on one node, NVLink)
MAX_LOCAL_EXPERTS = 1024  # DeepEP's NUM_MAX_LOCAL_EXPERTS
MAX_ROW_BYTES = 2 * (8192 - 8)  # the dispatch kernel stages half a row per warp in 8 KB of TMA memory


@dataclass(frozen=True)
class DeepEPHandle:
    """The routes of one dispatch: DeepEP's handle tuple (rank_prefix_matrix, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head) plus what our protocol
    returns with it.

    num_tokens: int               T, rows of x on this rank
    topk_idx:   int64 [T_recv, K]  received local expert ids, -1 for experts on other ranks
    topk_w:     fp32  [T_recv, K]  received routing weights (0 on slots of other ranks' experts)
    """

    deepep: tuple
    num_tokens: int
    topk_idx: Tensor
    topk_w: Tensor

    @property
    def num_recv(self) -> int:
        return self.topk_idx.shape[0]

    def check(self) -> None:
        """Nothing to check: input errors were raised by the dispatch."""


class DeepEPDispatcher:
    """`Dispatcher` over DeepEP's normal intranode kernels in `group` (None: the default group).

    scale_fmt: the layer's FP8 scale format (DeepEP carries fp32 scales, so both formats travel
    exactly; kept for the layer's consistency check). Its calls run on the caller's stream
    (`exchange_stream` stays None); the overlap calls `dispatch_async` / `combine_async` from its
    communication stream and waits for their events where it reads the results (moefp8.overlap)."""

    communicates = True
    exchange_stream = None

    def __init__(self, num_experts: int, group=None, scale_fmt: str = "pow2", num_sms: int = 20):
        import deep_ep

        check_scale_fmt(scale_fmt)
        self.deep_ep = deep_ep
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        if self.world not in RANKS:
            raise ValueError(f"dispatch backend 'deepep' runs DeepEP's intranode kernels, for expert-parallel "
                             f"groups of {', '.join(map(str, RANKS))} ranks on one node; this group has {self.world}: "
                             f"use dispatch backend 'all_to_all'")
        if num_experts < 1 or num_experts % self.world or num_experts // self.world > MAX_LOCAL_EXPERTS:
            raise ValueError(f"DeepEPDispatcher: {num_experts} experts cannot be split evenly over the {self.world} "
                             f"ranks of the expert-parallel group with at most {MAX_LOCAL_EXPERTS} per rank")
        self.num_experts, self.scale_fmt = num_experts, scale_fmt
        self.num_local_experts = num_experts // self.world
        self.buffer, self.hidden_bytes = None, 0
        self.set_num_sms(num_sms)

    # ------------------------------------------------------------------------------------------

    def set_num_sms(self, num_sms: int) -> None:
        """SMs used by this dispatcher's dispatch and combine kernels (even). DeepEP's tuned configs
        for the group size, with this SM count; every rank must set the same."""
        if not isinstance(num_sms, int) or num_sms < 2 or num_sms % 2:
            raise ValueError(f"set_num_sms: {num_sms!r}, expected an even number of SMs >= 2")
        B = self.deep_ep.Buffer
        old, B.num_sms = B.num_sms, num_sms  # get_*_config read the class-wide count: restore it
        try:
            self.configs = (B.get_dispatch_config(self.world), B.get_combine_config(self.world))
        finally:
            B.num_sms = old
        self.num_sms = num_sms
        self.hidden_bytes = 0  # the buffer is sized per config: re-checked at the next dispatch

    def combine_buffer(self, handle: DeepEPHandle, C: int, device) -> None:
        """No send buffer of ours: DeepEP copies y into its own."""
        return None

    def packs_on_caller_stream(self, topk: int) -> bool:
        return False

    def static_exchange(self, topk: int) -> bool:
        return False  # its dispatch reads the received counts on the host

    def flush_checks(self) -> None:
        """Nothing deferred: DeepEP's dispatch checks its inputs itself."""

    def capture(self):
        """A DeepEP event on the current stream (for `previous_event`)."""
        return self.deep_ep.Buffer.capture()

    def close(self) -> None:
        """Releases the DeepEP buffer (collective: every rank of the group calls it)."""
        if self.buffer is not None:
            self.buffer.destroy()
            self.buffer = None

    def _buffer(self, hidden: int):
        """The Buffer, (re)allocated when this hidden size (as BF16) or SM count needs more bytes."""
        need = 2 * hidden  # DeepEP sizes for BF16 rows; FP8 rows + scales fit in that
        if self.buffer is None or need > self.hidden_bytes:
            nvl = max(c.get_nvl_buffer_size_hint(need, self.world) for c in self.configs)
            if self.buffer is None or nvl > self.buffer.num_nvl_bytes:
                self.close()
                self.buffer = self.deep_ep.Buffer(self.group, nvl, 0, explicitly_destroy=True)
            self.hidden_bytes = need
        return self.buffer

    # ------------------------------------------------------------------------------------------

    def _input(self, x):
        if isinstance(x, Fp8Tensor):
            if x.layout != "1x128" or x.data.dim() != 2 or x.data.dtype != FP8_DTYPE:
                raise ValueError(f"dispatch: expected a '1x128' Fp8Tensor [T, H] of {FP8_DTYPE}, got layout "
                                 f"{x.layout!r}, {x.data.dtype} {tuple(x.data.shape)}")
            if x.data.shape[1] % TILE or x.scale.shape != (x.data.shape[0], x.data.shape[1] // TILE):
                raise ValueError(f"dispatch: FP8 scales must be [T, H/{TILE}], got {tuple(x.scale.shape)} for data "
                                 f"{tuple(x.data.shape)}")
            xin = (x.data.contiguous(), x.scale.float())
        elif not isinstance(x, Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
            what = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"dispatch: expected an Fp8Tensor or a bfloat16 tensor [T, H], got {what}")
        else:
            xin = x.contiguous()
        data = xin[0] if isinstance(xin, tuple) else xin
        nb = data.element_size() * data.shape[1]
        if nb % 32 or nb > MAX_ROW_BYTES:  # DeepEP's kernel would trap (a device assert ends the process)
            raise ValueError(f"dispatch: DeepEP's intranode dispatch takes rows of a multiple of 32 bytes, at most "
                             f"{MAX_ROW_BYTES}; got {nb} (H={x.shape[1]})")
        return xin, x.shape

    @staticmethod
    def _output(recv):
        return Fp8Tensor(recv[0], recv[1], "1x128") if isinstance(recv, tuple) else recv

    def _raise_bad(self, per_expert: list, bad_dev: Tensor) -> None:
        """per_expert: the host list DeepEP returns (tokens per local expert, summed over the source
        ranks); local expert 0 carries BAD_RANK_FLAG once per rank that passed a bad id."""
        n_bad = per_expert[0] // BAD_RANK_FLAG if per_expert else 0
        if n_bad:
            code, val = bad_dev.tolist()  # an error path: the host sync costs nothing here
            mine = f"; this rank ({self.rank}) passed expert {val}" if code else ""
            raise ValueError(f"dispatch: {n_bad} rank(s) of the EP group passed topk_idx holding an expert id outside "
                             f"[-1, {self.num_experts}) (-1: no expert){mine}")

    def dispatch_async(self, x, topk_idx: Tensor | None = None, topk_w: Tensor | None = None,
                       handle: DeepEPHandle | None = None, previous_event=None, allocate_on_comm_stream: bool = False,
                       async_finish: bool = True):
        """`dispatch` finishing on DeepEP's stream: -> (Dispatched, event). previous_event: a DeepEP
        event (`capture()`) to start after (default: after the current stream's work)."""
        xin, (T, H) = self._input(x)
        buf = self._buffer(H)
        ev_kw = dict(async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream and async_finish)
        if handle is not None:
            if T != handle.num_tokens:
                raise ValueError(f"dispatch: x has {T} rows but the handle was made for {handle.num_tokens} tokens")
            recv, _, _, _, _, ev = buf.dispatch(xin, handle=handle.deepep, config=self.configs[0],
                                                previous_event=previous_event, **ev_kw)
            return Dispatched(self._output(recv), handle.topk_idx, handle.topk_w, handle), ev
        if topk_idx is None or topk_w is None:
            raise ValueError("dispatch: topk_idx and topk_w are required without a handle")
        if topk_idx.dim() != 2 or topk_idx.shape[0] != T or topk_idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"dispatch: topk_idx must be int32/int64 [T={T}, K], got {topk_idx.dtype} "
                             f"{tuple(topk_idx.shape)}")
        if topk_w.shape != topk_idx.shape or not topk_w.is_floating_point() or topk_idx.shape[1] > 32:
            raise ValueError(f"dispatch: topk_w must be float {tuple(topk_idx.shape)} like topk_idx (K <= 32), got "
                             f"{topk_w.dtype} {tuple(topk_w.shape)}")
        idx, w = topk_idx.long().contiguous(), topk_w.float().contiguous()
        # The layout on DeepEP's stream (after previous_event, or the current stream), then the bad-id
        # flag on the same stream, then the dispatch after both (DeepEP's README chains them so).
        n_rank, _, n_expert, in_rank, ev = buf.get_dispatch_layout(
            idx, self.num_experts, previous_event=previous_event, async_finish=True,
            allocate_on_comm_stream=previous_event is not None)
        with torch.cuda.stream(buf.get_comm_stream()):
            ev.current_stream_wait()
            bad = flag_bad_experts(idx, self.num_experts, self.world, n_expert)
            ev = self.capture()
        recv, r_idx, r_w, per_expert, h, ev = buf.dispatch(
            xin, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
            topk_idx=idx, topk_weights=w, config=self.configs[0], previous_event=ev, **ev_kw)
        self._raise_bad(per_expert, bad)  # DeepEP waited for the counts on the host: every rank knows
        handle = DeepEPHandle(h, T, r_idx, r_w)
        counts = list(per_expert) if len(per_expert) == self.num_local_experts else None  # the layout's, no read-back
        return Dispatched(self._output(recv), r_idx, r_w, handle, counts), ev

    def dispatch(self, x, topk_idx: Tensor | None = None, topk_w: Tensor | None = None,
                 handle: DeepEPHandle | None = None) -> Dispatched:
        """x: "1x128" Fp8Tensor [T, H] or bf16 [T, H]; topk_idx int [T, K] global ids (-1: none);
        topk_w float [T, K] -> Dispatched(rows [T_recv, H] like x, local topk_idx int64 [T_recv, K],
        topk_w fp32 [T_recv, K], DeepEPHandle); with `handle`, its routes (topk_* ignored). The
        result is ready on the current stream."""
        return self.dispatch_async(x, topk_idx, topk_w, handle, async_finish=False)[0]

    def combine_async(self, y: Tensor, handle: DeepEPHandle, previous_event=None,
                      allocate_on_comm_stream: bool = False, async_finish: bool = True):
        """`combine` finishing on DeepEP's stream: -> (out, event)."""
        if not isinstance(y, Tensor) or y.dim() != 2 or y.dtype not in (torch.bfloat16, torch.float32):
            what = f"{y.dtype} {tuple(y.shape)}" if isinstance(y, Tensor) else type(y).__name__
            raise ValueError(f"combine: expected a bfloat16 or float32 tensor [T_recv, C], got {what}")
        if y.shape[0] != handle.num_recv:
            raise ValueError(f"combine: y has {y.shape[0]} rows, the dispatch received {handle.num_recv}")
        kw = dict(handle=handle.deepep, config=self.configs[1], previous_event=previous_event,
                  async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream and async_finish)
        if y.dtype == torch.bfloat16:
            if (2 * y.shape[1]) % 16:
                raise ValueError(f"combine: DeepEP needs rows of a multiple of 16 bytes, got {y.shape[1]} BF16 columns")
            out, _, ev = self._buffer(y.shape[1]).combine(y.contiguous(), **kw)
            return out, ev
        if y.shape[1] > 32:
            raise ValueError(f"combine: fp32 rows (the routing weights' gradient) are at most 32 columns; got "
                             f"{y.shape[1]}")
        # As wide as the buffer's rows (the forward's payload): 8-16 column payloads also came back
        # with wrong rows on an H200 (v1.2.1, 2 and 4 ranks), full-width rows never did; not understood.
        # Its bytes are repacked on the current stream, so DeepEP must follow the current stream, not
        # previous_event (with one, DeepEP would not wait for the repacking): the current stream waits for it.
        if previous_event is not None:
            previous_event.current_stream_wait()
        payload = fp32_to_byte_cols(y, min_cols=self.hidden_bytes // 2)
        out, ev = self.combine_async(payload, handle, async_finish=False)  # then reassembled on the current stream
        return byte_cols_to_fp32(out, y.shape[1]), self.capture()

    def combine(self, y: Tensor, handle: DeepEPHandle) -> Tensor:
        """y [T_recv, C] bf16 (or fp32, C <= 32) in received order -> [T, C] like y: each token's rows
        summed over the ranks that received it, in rank order, in fp32, rounded once."""
        return self.combine_async(y, handle, async_finish=False)[0]
