"""An all-to-all of equal blocks whose transfers take no SMs: NVLink peer copies on the copy
engines, ordered by stream memory operations. The all_to_all backend's capacity mode uses it with
``transport="copy_engine"`` (its blocks are equal by construction); one host, CUDA only.

Why: NCCL's all-to-all is a kernel. Overlapped with computation (moefp8.overlap) it holds SMs
for as long as it waits for the slowest peer, and a persistent GEMM (one CTA per SM, static
tiles) that cannot place its CTA on those SMs ends that much later: at EP4 on H200s the
communication stayed exposed however its SMs were capped (bench/notes/overlap.md, session 17).
Here the bytes move by `cudaMemcpyAsync` between peer-mapped buffers (the copy engines) and the
ranks synchronize with `cuStreamWaitValue32` / `cuStreamWriteValue32` on flags in the same
buffers: a waiting stream holds no SM, it is parked in the GPU's front end.

Pull, not push: each rank's send blocks lie in its own slot of a buffer every peer maps, and each
receiver copies its block out of every peer's slot straight into its result (a peer read over
NVLink, on a copy engine). The one same-device copy left is the own block (1/R of the bytes):
same-device copies are the driver's copy kernels, which run on SMs and crawl under a persistent
GEMM (session 18 pushed into the peers' slots and copied each slot out again on SMs, 1.25x the
received bytes). A producer can write its send rows into the slot directly (`send_buffer`: the
dispatch's pack kernels, the combine's input), so nothing is staged; any other tensor is copied
into a slot first (a same-device copy of the whole send buffer).

The buffer (torch symmetric memory, one per group, mapped into every peer) per rank:

    | ready int32 [S, R], pulled int32 [S, R] (padded to 4 KiB) | slots uint8 [S, R * block bytes] |

Exchange k (blocks of b bytes) uses slot s = k % S, generation g = k // S + 1 (S slots, default 4), its
R send blocks dense at the slot's start (block p for rank p). Rank i:
  * before its producer writes slot s (`send_buffer`, on the producer's stream): wait until every
    peer p's pulled[s][p] >= g - 1 (they copied exchange k - S out of the slot) and for its own
    read of exchange k - S (an event);
  * exchange, on the calling stream (after the producer): write g into every peer p's
    ready[s][i]; then on one side stream per peer p (the copies run on several copy engines at
    once): wait until its own ready[s][p] >= g, copy block i of p's slot s into row block p of
    the result, write g into p's pulled[s][i]; on the calling stream: copy its own block, then
    wait for the side streams.
Every wait is for something every rank enqueues in the same exchange order (all ranks claim
and exchange the same number of times with the same sizes: the capacity mode guarantees it), and
a slot is claimed again (k + S) only once exchange k was enqueued (checked: `send_buffer` raises
otherwise), so no wait depends on a later exchange. A rank that stops calling leaves its peers'
streams waiting (no timeout: the host sees it at its next synchronization, as with a hung
collective). Host cost per exchange: 3(R - 1) stream memory operations, R copies, one driver
call each through ctypes (no torch op per copy: the overlapped schedule is host-paced), no kernel.

More slots decouple the ranks: a producer's wait for exchange k - S to be pulled by every peer is
a wait for the slowest peer, on the producer's stream (the compute stream, when the pack or the
unpermute writes the slot). With S = 2 the backward's first gradient packs wait for the peers'
pulls of the forward's last combines, and a step's first packs for the previous step's last
exchanges; S = 4 moves those waits back to exchanges the peers finished long before. Memory:
S x R x block bytes per rank (R x block = one exchange's send buffer).

The buffer is allocated at the first claim (collective), sized for the largest block seen
or `reserve`d; a larger block later reallocates it after a device synchronization and a barrier
(with no claim outstanding).
"""

import ctypes
import socket
import warnings

import torch
import torch.distributed as dist
from torch import Tensor

SLOTS = 4  # the default ring depth (bench/notes/overlap.md, session 21)
FLAG_BYTES = 4096  # the flags, ahead of the slots (keeps the slots 4 KiB-aligned; 2 x S x R int32)
_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0
_DRIVER = None


def _driver():
    """libcuda's stream memory operations (the _v2 entry points, always available on sm70+ since
    CUDA 11.7) and cuMemcpyAsync through ctypes: torch has no wait-value binding."""
    global _DRIVER
    if _DRIVER is None:
        lib = ctypes.CDLL("libcuda.so.1")
        fns = {}
        for name in ("cuStreamWaitValue32", "cuStreamWriteValue32"):
            fn = getattr(lib, name + "_v2", None) or getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
            fns[name] = fn
        fn = lib.cuMemcpyAsync  # (dst, src, bytes, stream): unified addresses, peer or local
        fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        fns["cuMemcpyAsync"] = fn
        err = lib.cuGetErrorString
        err.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        fns["error"] = err
        _DRIVER = fns
    return _DRIVER


def _check(name: str, rc: int) -> None:
    if rc:
        msg = ctypes.c_char_p()
        _driver()["error"](rc, ctypes.byref(msg))
        raise RuntimeError(f"copy_engine transport: {name} failed with CUDA error {rc} "
                           f"({(msg.value or b'?').decode()})")


def _call(name: str, stream: int, addr: int, value: int, flags: int = 0) -> None:
    """A stream memory operation on the raw stream handle `stream`."""
    _check(name, _driver()[name](stream, addr, value & 0xFFFFFFFF, flags))


def _copy(stream: int, dst: int, src: int, nbytes: int) -> None:
    """cudaMemcpyAsync by address (a peer or a local copy), without torch's per-op cost."""
    if nbytes:
        _check("cuMemcpyAsync", _driver()["cuMemcpyAsync"](dst, src, nbytes, stream))


def check_slots(slots, who: str) -> None:
    """Raises unless `slots` is a ring depth the exchange takes (an integer >= 2)."""
    if not isinstance(slots, int) or isinstance(slots, bool) or slots < 2:
        raise ValueError(f"{who}: slots={slots!r}, expected an integer >= 2 (send slots in the copy_engine "
                         f"transport's ring; each holds one exchange's send buffer)")


class CopyEngineExchange:
    """``exchange(send)``: uint8 [R * n, row bytes] (block p for rank p of `group`) -> the same shape,
    block p from rank p: `dist.all_to_all_single` with equal splits, on the copy engines.
    ``send_buffer(rows, row_bytes)`` gives the next exchange's send slot to write `send` into
    (then nothing is staged). Enqueued on the current stream (and one side stream per peer), no
    host synchronization."""

    def __init__(self, group=None, slots: int = SLOTS):
        check_slots(slots, "copy_engine exchange")
        self.slots = slots
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        if 8 * slots * self.world > FLAG_BYTES:
            raise ValueError(f"copy_engine exchange: slots={slots} x {self.world} ranks need {8 * slots * self.world} "
                             f"bytes of flags, more than the buffer's {FLAG_BYTES}")
        self.block = 0  # bytes per (slot, destination rank)
        self.reserved = 0
        self.calls = 0  # send slots claimed so far (k of the next exchange)
        self.pending: dict[int, tuple] = {}  # k -> (slot address, bytes) claimed, not yet exchanged
        self.read = [None] * slots  # per slot: an event after the own block's copy out of it
        self.buf = self.hdl = None
        self.streams: list = []

    def reserve(self, block_bytes: int) -> None:
        """Size the buffer for blocks of at least this many bytes when it is (re)allocated (avoids a
        reallocation when the first exchange is not the largest)."""
        self.reserved = max(self.reserved, block_bytes)

    # ------------------------------------------------------------------------------------------

    def _check_one_host(self) -> None:
        hosts = [None] * self.world
        dist.all_gather_object(hosts, socket.gethostname(), group=self.group)
        if len(set(hosts)) > 1:
            raise ValueError(f"dispatch transport 'copy_engine' maps peer GPUs' memory, so every rank of the EP "
                             f"group must be on one host; the group spans {sorted(set(hosts))}: use "
                             f"dispatch.transport=collective across nodes")

    def _allocate(self, block: int, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        if self.pending:
            raise RuntimeError(f"copy_engine exchange: a block of {block} bytes needs a larger buffer, but send "
                               f"buffers {sorted(self.pending)} are claimed and not exchanged yet: reserve() the "
                               f"largest block before the first exchange")
        if self.buf is None:
            self._check_one_host()
            self.streams = [torch.cuda.Stream(device) for _ in range(self.world - 1)]
        else:  # every rank reaches this exchange: nothing of the old buffer may be in flight anywhere
            torch.cuda.synchronize(device)
            dist.barrier(group=self.group)
        self.buf = self.hdl = None
        name = self.group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed before torch 2.8, deprecated (a no-op) since
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                enable(name)
        self.block = -(-max(block, self.reserved) // 4096) * 4096
        self.buf = symm_mem.empty(FLAG_BYTES + self.slots * self.world * self.block, dtype=torch.uint8, device=device)
        self.buf[:FLAG_BYTES].zero_()
        torch.cuda.synchronize(device)  # the flags are zero before any peer can write them
        self.hdl = symm_mem.rendezvous(self.buf, name)
        self.calls, self.read = 0, [None] * self.slots
        self.peer_ptrs = list(self.hdl.buffer_ptrs)

    def _flag(self, rank: int, kind: int, slot: int, src: int) -> int:
        """Device address of rank `rank`'s flag `kind` (0 ready, 1 pulled) [slot][src]."""
        return self.peer_ptrs[rank] + 4 * ((kind * self.slots + slot) * self.world + src)

    def _slot(self, rank: int, slot: int) -> int:
        return self.peer_ptrs[rank] + FLAG_BYTES + slot * self.world * self.block

    def _claim(self, blk: int, device: torch.device) -> int:
        """The next exchange's index k; its slot is writable on the current stream from here."""
        if self.buf is None or blk > self.block:
            self._allocate(blk, device)
        k, S = self.calls, self.slots
        if k - S in self.pending:
            raise RuntimeError(f"copy_engine exchange: send buffer {k} reuses the slot of send buffer {k - S}, "
                               f"which was claimed but never exchanged (at most {S} claims may be outstanding)")
        self.calls += 1
        slot, gen = k % S, k // S + 1
        cur = torch.cuda.current_stream(device)
        if self.read[slot] is not None:
            cur.wait_event(self.read[slot])
        if gen > 1:
            for p in range(self.world):
                if p != self.rank:
                    _call("cuStreamWaitValue32", cur.cuda_stream, self._flag(self.rank, 1, slot, p), gen - 1, _GEQ)
        self.pending[k] = (self._slot(self.rank, slot), self.world * blk)
        return k

    def send_buffer(self, rows: int, row_bytes: int, device: torch.device) -> Tensor:
        """uint8 [rows, row_bytes] (rows a multiple of R): the next exchange's send slot, writable on
        the current stream. Write the send buffer into it and pass it to the exchange (in the same
        order on every rank); the slot is claimed again `slots` claims later."""
        if rows % self.world:
            raise ValueError(f"copy_engine send_buffer: {rows} rows do not split into {self.world} equal blocks")
        k = self._claim(rows // self.world * row_bytes, device)
        off = self.pending[k][0] - self.peer_ptrs[self.rank]
        return self.buf[off:off + rows * row_bytes].view(rows, row_bytes)

    def __call__(self, send: Tensor) -> Tensor:
        R, me = self.world, self.rank
        if not send.is_cuda or send.dtype != torch.uint8 or send.dim() != 2 or send.shape[0] % R:
            raise ValueError(f"copy_engine exchange: expected CUDA uint8 [R * n, row bytes] with R = {R}, got "
                             f"{send.dtype} {tuple(send.shape)} on {send.device}")
        blk = send.numel() // R
        k = next((k for k, (ptr, n) in self.pending.items()  # an empty view's data_ptr() is 0: any empty slot
                  if n == send.numel() and (n == 0 or ptr == send.data_ptr())), None)
        if k is None:  # not written into a slot: stage it
            send = send.contiguous()
            k = self._claim(blk, send.device)
            _copy(torch.cuda.current_stream(send.device).cuda_stream, self.pending[k][0], send.data_ptr(), R * blk)
        del self.pending[k]
        slot, gen = k % self.slots, k // self.slots + 1
        out = torch.empty_like(send)
        dst = out.data_ptr()
        main = torch.cuda.current_stream(send.device)
        h = main.cuda_stream
        for i in range(1, R):  # the send blocks are written: tell every peer
            p = (me + i) % R
            _call("cuStreamWriteValue32", h, self._flag(p, 0, slot, me), gen)
        start = torch.cuda.Event()  # `out` is the calling stream's from here
        start.record(main)
        for i, st in enumerate(self.streams):  # peer p = me + 1 + i: each rank starts at a different peer
            p = (me + 1 + i) % R
            s = st.cuda_stream
            st.wait_event(start)
            _call("cuStreamWaitValue32", s, self._flag(me, 0, slot, p), gen, _GEQ)
            _copy(s, dst + p * blk, self._slot(p, slot) + me * blk, blk)
            _call("cuStreamWriteValue32", s, self._flag(p, 1, slot, me), gen)
        _copy(h, dst + me * blk, self._slot(me, slot) + me * blk, blk)
        self.read[slot] = torch.cuda.Event()
        self.read[slot].record(main)
        for st in self.streams:
            main.wait_stream(st)
        return out
