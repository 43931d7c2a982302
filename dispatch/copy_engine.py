"""An all-to-all of equal blocks whose transfers take no SMs: NVLink peer copies on the copy
engines, ordered by stream memory operations. The all_to_all backend's capacity mode uses it with
``transport="copy_engine"`` (its blocks are equal by construction); one host, CUDA only.

Why: NCCL's all-to-all is a kernel. Overlapped with computation (moefp8.overlap) it holds SMs
for as long as it waits for the slowest peer, and a persistent GEMM (one CTA per SM, static
tiles) that cannot place its CTA on those SMs ends that much later: at EP4 on H200s the
communication stayed exposed however its SMs were capped (bench/notes/overlap.md, session 17).
Here the bytes move by `cudaMemcpyAsync` between peer-mapped buffers (the copy engines) and the
ranks synchronize with `cuStreamWaitValue32` / `cuStreamWriteValue32` on flags in the same
buffers: a waiting stream holds no SM, it is parked in the GPU's front end. The local copies
(the own block, each received block out of the slot) are the driver's device-to-device copies:
those do run on SMs (in a trace they crawl under a persistent GEMM); they move each received byte
once more, quickly when the calling stream has a high priority (moefp8.overlap.SIDE_STREAM_PRIORITY).

The buffer (torch symmetric memory, one per group, mapped into every peer) per rank:

    | ready flags int32 [S, R], padded to 4 KiB | slots uint8 [S, R * block bytes] |

Exchange k (blocks of b bytes) uses slot s = k % S, generation g = k // S + 1 (S = 2 slots), its
R blocks dense at the slot's start. Rank i, for each peer p, on one side stream per peer (the
copies run on several copy engines at once), after an event on the calling stream: copy block p
of the send buffer to p's slot s at i * b (a peer write over NVLink), then write g into p's
ready[s][i] (after the copy: stream order and the write's memory barrier). On the calling stream:
wait until its own ready[s][p] >= g for every peer p, copy the slot's R blocks out into the
result in one copy, then its own block over block i; finally wait for the side streams.

Why no "slot free" handshake: rank i writes p's slot s at exchange k only after its calling
stream waited for p's ready flag of exchange k - 1, which p's side stream wrote after p's event
at the start of exchange k - 1, which follows p's copies out of exchange k - 2 = the last use of
slot s (S = 2). So every write into a slot happens after its previous contents were read, by
the chain of waits the exchange has anyway (each exchange's start also waits for the end of
the one before, so this holds when callers switch streams between exchanges). Every wait is
for something every rank enqueues in the same exchange order (all ranks call `__call__` the same number of times with the same sizes:
capacity mode guarantees it), so no exchange waits on a later one. A rank that stops calling
leaves its peers' streams waiting (no timeout: the host sees it at its next synchronization, as
with a hung collective). Host cost, per exchange: R - 1 stream writes, R - 1 stream waits and
R + 1 copies, each one driver call through ctypes (no torch op or stream switch per copy: the
overlapped schedule is host-paced), no kernel.

The buffer is allocated at the first exchange (collective), sized for the largest block seen or
`reserve`d; a larger block later reallocates it after a device synchronization and a barrier.
"""

import ctypes
import socket
import warnings

import torch
import torch.distributed as dist
from torch import Tensor

SLOTS = 2
FLAG_BYTES = 4096  # the ready flags, ahead of the slots (keeps the slots 4 KiB-aligned)
_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0
_DRIVER = None


def _driver():
    """libcuda's stream memory operations (the _v2 entry points, always available on sm70+ since
    CUDA 11.7) through ctypes: torch has no wait-value binding."""
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


class CopyEngineExchange:
    """``exchange(send)``: uint8 [R * n, row bytes] (block p for rank p of `group`) -> the same shape,
    block p from rank p: `dist.all_to_all_single` with equal splits, on the copy engines.
    Enqueued on the current stream (and one side stream per peer), no host synchronization."""

    def __init__(self, group=None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.block = 0  # bytes per (slot, source rank)
        self.reserved = 0
        self.calls = 0
        self.buf = self.hdl = None
        self.streams: list = []
        self.done = None  # an event at the end of the last exchange, on the stream that ran it

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
        self.buf = symm_mem.empty(FLAG_BYTES + SLOTS * self.world * self.block, dtype=torch.uint8, device=device)
        self.buf[:FLAG_BYTES].zero_()
        torch.cuda.synchronize(device)  # the flags are zero before any peer can write them
        self.hdl = symm_mem.rendezvous(self.buf, name)
        self.calls, self.done = 0, None
        self.peer_ptrs = list(self.hdl.buffer_ptrs)

    def _flag(self, rank: int, slot: int, src: int) -> int:
        """Device address of rank `rank`'s ready[slot][src] flag."""
        return self.peer_ptrs[rank] + 4 * (slot * self.world + src)

    def __call__(self, send: Tensor) -> Tensor:
        R, me = self.world, self.rank
        if not send.is_cuda or send.dtype != torch.uint8 or send.dim() != 2 or send.shape[0] % R:
            raise ValueError(f"copy_engine exchange: expected CUDA uint8 [R * n, row bytes] with R = {R}, got "
                             f"{send.dtype} {tuple(send.shape)} on {send.device}")
        send = send.contiguous()
        blk = send.numel() // R
        if self.buf is None or blk > self.block:
            self._allocate(blk, send.device)
        k = self.calls
        self.calls += 1
        slot, gen = k % SLOTS, k // SLOTS + 1
        out = torch.empty_like(send)
        src, dst = send.data_ptr(), out.data_ptr()
        base = FLAG_BYTES + slot * R * self.block  # this exchange's R blocks lie dense from here
        main = torch.cuda.current_stream(send.device)
        if self.done is not None:  # the ordering argument needs exchange k - 1 done, whatever stream ran it
            main.wait_event(self.done)
        start = torch.cuda.Event()
        start.record(main)
        for i, st in enumerate(self.streams):  # peer p = me + 1 + i: each rank starts at a different peer
            p = (me + 1 + i) % R
            st.wait_event(start)
            _copy(st.cuda_stream, self.peer_ptrs[p] + base + me * blk, src + p * blk, blk)
            _call("cuStreamWriteValue32", st.cuda_stream, self._flag(p, slot, me), gen)
        h = main.cuda_stream
        for p in range(R):
            if p != me:
                _call("cuStreamWaitValue32", h, self._flag(me, slot, p), gen, _GEQ)
        _copy(h, dst, self.peer_ptrs[me] + base, R * blk)  # all R blocks (row `me` of the slot is stale)
        _copy(h, dst + me * blk, src + me * blk, blk)  # then the own block
        for st in self.streams:  # the send buffer is read until here
            main.wait_stream(st)
        self.done = torch.cuda.Event()
        self.done.record(main)
        return out
