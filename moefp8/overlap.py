"""Two micro-batch overlap (docs/design.md §4): one micro-batch's dispatch or combine runs while the
other computes, in forward and backward.

Two schedules, the same stages:
* `OverlappedBlock`, what training runs (moefp8.model.Block with overlap on and at least two
  sequences): a transformer block over the halves of its batch; B's attention hides A's
  dispatch in the forward and A's gradient combine in the backward, the experts hide the rest
  (its docstring has the order); consecutive blocks pass a `Handoff`, so that a block's B combine
  runs behind the next block's A attention.
* `OverlappedMoE`, the MoE layer alone (a lone sequence, or `MoELayer(overlap=OverlapPolicy())`
  used by itself), below: only the shared experts are there to hide A's dispatch and B's combine.

The MoE layer's tokens are split in two micro-batches A (first half) and B. Their stages (moefp8.moe_stages:
dispatch, layout, experts, combine; the shared experts of each half, moefp8.mlp) run in an explicit order on
three streams (compute, communication, layouts), so that one micro-batch's communication runs
while something else computes:

  forward   comm:     dispatch A, dispatch B       | combine A      | combine B
            compute:  shared A    | experts A      | experts B      | shared B
  backward  comm:     dispatch dA, dB              | combine A      | combine B
            compute:  shared A bwd | experts A bwd | experts B bwd  | shared B bwd

B's dispatch hides behind A's experts, A's combine behind B's experts, A's dispatch and B's
combine behind the shared experts of A and B (they need no communication). Each micro-batch's
layout (the permutation of its received rows, whose per-expert counts the host reads) runs on
a third stream as soon as its rows have arrived, so that neither the host's wait for the counts
nor the layout's kernels queue behind the other micro-batch's exchange or expert compute. The
host enqueues both dispatches before it first blocks, and a micro-batch's compute before the
communication that waits for it (every stage is host-paced: a stage the host enqueues late
starts late). The backward is one autograd node with this order written out (autograd would
run the two micro-batches' nodes one after the other on one stream).

On CUDA the communication stages run on a side stream and the layouts on another (one each per
device, at high priority: `OverlapPolicy.side_stream_priority`), ordered against the compute stream by events;
tensors crossing streams are handed over with `record_stream`. In the all_to_all capacity mode a
dispatch's quantize and pack kernels run on the compute stream right behind its inputs and only
its exchange and unpacking on the communication stream (`_Streams.packs_on_compute`,
`Dispatcher.packs_on_caller_stream`); with
`dispatch.transport=copy_engine` that exchange's transfers take no SMs (dispatch/copy_engine.py).
A dispatcher with an event API of its own (the deepep backend: DeepEP's `dispatch_async` /
`combine_async`, `_Streams.evented`) is called from the communication stream as the others, after an
event captured there, and finishes on its own stream: the stages that read its results wait for
the event it hands back (the synchronous calls would make the communication stream wait for them).
On the CPU (gloo) there are no streams: the same order runs serially.
Either way the arithmetic is that of running the two micro-batches one after the other
(`serialized`, the reference): outputs and gradients are bit-exact against it. Against the
unsplit layer the weight gradients differ: their col-wise FP8 tiles (128 tokens of one expert)
group other tokens once split, and dW_A + dW_B adds in another fp32 order (measured on 4x H200:
2.4e-3 relative on dW1).

What the schedules run with is the layer's `OverlapPolicy` (`MoELayer.overlap`, None: the plain
schedule): the side streams' priority, the SMs the GEMMs leave free, a `Timeline` to record.

Host syncs: the layout stage reads the per-expert counts on the host (one sync per micro-batch,
on the layout stream: it waits for that micro-batch's dispatch only), and the exact-mode
all_to_all dispatch reads its counts (on the communication stream); the host waits for those
streams while the compute stream keeps working.
"""

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from moefp8.fp8 import record_stream
from moefp8.graphs import replays
from moefp8.kernels.grouped_gemm import GemmPolicy
from moefp8.mlp import mlp_backward, mlp_forward
from moefp8.moe_stages import (RoutedExperts, bwd_combine, bwd_dispatch, bwd_experts, exchanging, fwd_dispatch,
                               fwd_experts, fwd_layout, restore, save)

_SIDE_STREAMS: dict = {}  # (device index, role, priority) -> stream: a cache, made once per key


@contextmanager
def _cublas_sm_carveout(n: int):
    """Inside: cuBLAS leaves n SMs free (torch's SM carveout, where torch has the knob); 0: nothing."""
    carve = getattr(torch._C, "_set_sm_carveout_experimental", None) if n else None
    old = torch._C._get_sm_carveout_experimental() if carve else None
    if carve:
        carve(n)
    try:
        yield
    finally:
        if carve:
            carve(old)


def side_stream(device: torch.device, role: str, priority: int):
    """The side stream that `role` ("comm": communication stages, "layout": the layouts) uses on
    `device` at `priority` (None on CPU)."""
    if device.type != "cuda":
        return None
    key = (device.index if device.index is not None else torch.cuda.current_device(), role, priority)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=key[0], priority=priority)
    return _SIDE_STREAMS[key]


class Timeline:
    """Where an overlapped step's time goes (tools/bench_overlap.py --timeline): marks at the
    schedule's stage boundaries, each a CUDA timing event on the compute or the comm stream (the
    host clock on CPU), in the order the host enqueues them. On the compute stream, the interval
    from one mark to the next is the GPU time of what was enqueued between them: a stage's work
    under its label, `wait ...` the stream waiting for another (an exchange), `/...` the time after
    a stage until the next mark, when nothing was enqueued in between (nonzero: the stream ran
    dry, the host was late: host-paced), `... done` what follows the schedule in the same autograd
    call and the engine's own work up to the next mark. Each mark also keeps the host clock when it
    was enqueued. Recorded only where an `OverlapPolicy` carries one; one event record per mark then."""

    def __init__(self):
        self.marks: list = []  # (label, stream name, event or None on CPU, host seconds)

    def mark(self, label: str, name: str, stream) -> None:
        ev = None
        if stream is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream)
        self.marks.append((label, name, ev, time.perf_counter()))

    def times_ms(self) -> list[tuple[str, str, float, float]]:
        """[(label, stream name, ms after the first mark on the GPU, ms after it on the host)]
        (on CPU both the host's); synchronizes (marks on several streams)."""
        if not self.marks:
            return []
        ev0, h0 = self.marks[0][2:]
        if ev0 is None:
            return [(lab, nm, (h - h0) * 1e3, (h - h0) * 1e3) for lab, nm, _, h in self.marks]
        torch.cuda.synchronize()
        return [(lab, nm, ev0.elapsed_time(ev), (h - h0) * 1e3) for lab, nm, ev, h in self.marks]


@dataclass(frozen=True)
class OverlapPolicy:
    """How the two micro-batch schedules run (a `MoELayer.overlap`; the model passes one to every
    MoE layer, tools/bench_overlap.py its variants). The defaults are what training runs.

    gemm_sm_reserve: SMs the GEMMs leave free while an overlapped layer runs, for the concurrent
      all-to-alls: the warp-specialized grouped GEMMs' persistent grids (`GemmPolicy.sm_reserve` of
      the GEMMs of the MoE stages and shared experts) and, where torch has the knob, cuBLAS's (its
      SM carveout, for every cuBLAS GEMM inside the schedule; `OverlappedBlock`'s attention
      projections keep their own GEMM policy, so only the carveout applies to them). A persistent
      GEMM whose CTA cannot start on an SM that a communication kernel holds ends that much later.
      0: all SMs. tools/bench_overlap.py --gemm-sm-reserve measures other values.
    side_stream_priority: of the side streams (CUDA: lower is higher,
      torch.cuda.Stream.priority_range()). Their kernels are short (quantize, pack, the receive
      side's copies and sums, the layouts the host waits for); at the default priority they queue
      behind the compute stream's next kernel, a persistent GEMM that holds every SM for
      milliseconds. At a higher one they take the SMs at the next kernel boundary. 0: the default
      priority. tools/bench_overlap.py --side-priorities.
    timeline: a `Timeline` the schedules mark their stages in (tools/bench_overlap.py --timeline);
      None: nothing recorded.
    """

    gemm_sm_reserve: int = 0
    side_stream_priority: int = -1
    timeline: Timeline | None = None

    def __post_init__(self):
        if not isinstance(self.gemm_sm_reserve, int) or self.gemm_sm_reserve < 0:
            raise ValueError(f"OverlapPolicy: gemm_sm_reserve={self.gemm_sm_reserve!r}, expected an integer >= 0")


class _Streams:
    """compute (the current stream), comm and layout; on CPU all are None and every call is a no-op
    (but `tick`, which then reads the host clock). gemm: the GEMM policy the schedule's GEMMs run
    with (the layer's, with the policy's SM reserve)."""

    def __init__(self, device: torch.device, policy: OverlapPolicy, gemm: GemmPolicy):
        self.comm = side_stream(device, "comm", policy.side_stream_priority)
        self.layout = side_stream(device, "layout", policy.side_stream_priority)
        self.compute = torch.cuda.current_stream(device) if self.comm is not None else None
        self.tl = policy.timeline
        self.gemm = replace(gemm, sm_reserve=policy.gemm_sm_reserve)

    def tick(self, label: str, comm: bool = False) -> None:
        """A `Timeline` mark on the compute (or comm) stream, when one is being recorded."""
        if self.tl is not None:
            self.tl.mark(label, "comm" if comm else "compute", self.comm if comm else self.compute)

    @contextmanager
    def stage(self, label: str, comm: bool = False):
        """`tick`s at the start (label) and the end ("/" + label) of the stage inside."""
        self.tick(label, comm)
        yield
        self.tick("/" + label, comm)

    def on_comm(self):
        return self.on(self.comm)

    def on(self, stream):
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def mark(self, stream):
        """An event at this point of `stream` (None on CPU)."""
        if stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait(self, stream, *events) -> None:
        """`stream` waits for each event (lists of them too): ours (`mark`; None on CPU) or a
        dispatcher's (DeepEP's, `evented`), whose `current_stream_wait` makes the current stream wait."""
        for ev in events:
            if isinstance(ev, (list, tuple)):
                self.wait(stream, *ev)
            elif isinstance(ev, torch.cuda.Event):
                if stream is not None:
                    stream.wait_event(ev)
            elif ev is not None:
                with self.on(stream):
                    ev.current_stream_wait()

    @staticmethod
    def evented(layer) -> bool:
        """Whether the layer's dispatcher has an event API of its own (the deepep backend's
        `dispatch_async` / `combine_async` / `capture`): its dispatches and combines, enqueued on the
        comm stream as the others', then finish on the dispatcher's own stream and hand back an
        event that the stages reading their results wait for (instead of the comm stream waiting
        for them: the synchronous call's end)."""
        return hasattr(layer.dispatcher, "dispatch_async")

    def packs_on_compute(self, layer) -> bool:
        """Whether the layer's dispatches split: quantize and pack on the compute stream, exchange
        and unpack on the comm stream (the all_to_all capacity mode; `exchanging`). On the comm
        stream those two kernels wait for the compute stream's running persistent GEMM to end
        (it holds every SM), which delays the exchange by up to a GEMM; on the compute stream,
        enqueued right after their inputs, they run at once (~0.1 ms per dispatch at EP4)."""
        return self.comm is not None and layer.dispatcher.packs_on_caller_stream(layer.topk)

    @contextmanager
    def sending(self, disp, split: bool, label: str, ev_in):
        """Where a dispatch (forward or gradient) is enqueued: split (`packs_on_compute`), its
        quantize and pack on the compute stream (a `Timeline` stage under `label`) and its exchange
        on the comm stream; else all of it on the comm stream, after `ev_in` (its inputs made)."""
        if split:
            with self.exchanging(disp), self.stage(label):
                yield
        else:
            with self.on_comm():
                self.wait(self.comm, ev_in)
                yield

    def exchanging(self, disp):
        """Calls of `disp` inside run their exchanges on the comm stream (results valid there)."""
        return exchanging(disp, self.comm)

    def hand_to(self, stream, *objs) -> None:
        """Tensors made on one stream and read on `stream`: tell the caching allocator, so their
        memory is not reused before `stream` is done with them."""
        record_stream(stream, *objs)


def halves(n: int) -> list[slice]:
    """The two micro-batches of n rows (tokens, or sequences): [0, ceil(n/2)) and the rest."""
    h = (n + 1) // 2
    return [slice(0, h), slice(h, n)]


class Handoff:
    """What an overlapped block hands the next one (moefp8.model.Transformer's loop passes one
    along its blocks): the block's output half B (its second micro-batch) is finished on the
    communication stream behind B's combine, so the compute stream does not wait there and the
    next block's micro-batch A attention hides B's combine (DeepSeek-V3's cross-layer overlap).
    `event`: the point of the communication stream after which that half is written (None: the
    whole output is ready on the compute stream). Whoever reads the B half next calls `wait()`
    first: the next overlapped block before B's attention, a plain block at its start, the model
    after its last block."""

    def __init__(self):
        self.event = None

    def wait(self) -> None:
        """The current stream waits for the pending half (no-op when none); clears it."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
            self.event = None


class _MoEForward:
    """The MoE layer's forward stages for two micro-batches: each call enqueues one stage of
    micro-batch i on its stream; the caller writes the order. xs[i] [T_i, H], idx[i], w[i]: the
    micro-batch's MoE input and routes (no autograd history); `inputs_ready(i)` marks the point of
    the compute stream after which they exist (its dispatch waits for that point only)."""

    def __init__(self, layer, st: _Streams, xs, idx, w, w1, w2, sw1, sw2, want_dw: bool):
        self.layer, self.st, self.xs, self.idx, self.w = layer, st, xs, idx, w
        self.w1, self.w2, self.sw1, self.sw2, self.want_dw = w1, w2, sw1, sw2, want_dw
        self.ev_in, self.d, self.L, self.z, self.saves, self.out, self.s_out, self.s_saved = ([None] * 2
                                                                                              for _ in range(8))
        self.ev_s, self.ev_d, self.ev_z, self.ev_c = ([None] * 2 for _ in range(4))
        self.split, self.evented = st.packs_on_compute(layer), st.evented(layer)

    def inputs_ready(self, i: int) -> None:
        self.ev_in[i] = self.st.mark(self.st.compute)
        self.st.hand_to(self.st.comm, self.xs[i], self.idx[i], self.w[i])

    def send(self, i: int) -> None:  # no host sync in capacity mode; exact mode reads its counts
        st = self.st
        with st.sending(self.layer.dispatcher, self.split, f"{'AB'[i]} pack", self.ev_in[i]):
            if self.evented:
                self.d[i], self.ev_s[i] = fwd_dispatch(self.layer, self.xs[i], self.idx[i], self.w[i], evented=True)
            else:
                self.d[i] = fwd_dispatch(self.layer, self.xs[i], self.idx[i], self.w[i])
                self.ev_s[i] = st.mark(st.comm)
        st.tick(f"{'AB'[i]} dispatched", comm=True)
        st.hand_to(st.layout, self.d[i].topk_idx)

    def layout(self, i: int) -> None:  # the host waits for this micro-batch's rows (the layout stream only)
        st, d = self.st, self.d[i]
        with st.on(st.layout):
            st.wait(st.layout, self.ev_s[i])
            self.L[i] = L = fwd_layout(self.layer, d)
            self.ev_d[i] = st.mark(st.layout)
        st.hand_to(st.compute, d.x, d.topk_idx, d.topk_w, L.row_TK, L.src_M, L.offsets)

    def experts(self, i: int) -> None:
        st = self.st
        st.tick(f"wait {'AB'[i]} rows")
        st.wait(st.compute, self.ev_d[i])  # implies ev_s[i]: the layout stream waited for the dispatch first
        with st.stage(f"{'AB'[i]} experts"):
            self.z[i], self.saves[i] = fwd_experts(self.layer, self.d[i], self.L[i], self.w1, self.w2, self.want_dw,
                                                   st.gemm)
        self.ev_z[i] = st.mark(st.compute)
        st.hand_to(st.comm, self.z[i])

    def combine(self, i: int) -> None:
        st = self.st
        with st.on_comm():
            st.wait(st.comm, self.ev_z[i])
            disp = self.layer.dispatcher
            with st.stage(f"{'AB'[i]} combine", comm=True):
                if self.evented:
                    self.out[i], self.ev_c[i] = disp.combine_async(self.z[i], self.d[i].handle,
                                                                   previous_event=disp.capture(),
                                                                   allocate_on_comm_stream=True)
                else:
                    self.out[i] = disp.combine(self.z[i], self.d[i].handle)
                    self.ev_c[i] = st.mark(st.comm)
        st.hand_to(st.compute, self.out[i])

    def shared(self, i: int) -> None:  # no communication: fills the compute stream while the comm stream works
        if self.layer.shared is not None:
            with self.st.stage(f"{'AB'[i]} shared"):
                self.s_out[i], self.s_saved[i] = mlp_forward(self.layer.shared, self.xs[i], self.sw1, self.sw2,
                                                                self.st.gemm)

    def routed(self, i: int) -> Tensor:
        """Micro-batch i's combined routed output, once the compute stream may read it."""
        self.st.tick(f"wait {'AB'[i]} combine")
        self.st.wait(self.st.compute, self.ev_c[i])
        self.st.tick(f"{'AB'[i]} output")
        return self.out[i]

    def save(self, ctx, *extra) -> None:
        """What the backward needs on ctx (moefp8.moe_stages.save), `extra` tensors after the weights."""
        sh = self.layer.shared is not None
        save(ctx, self.saves, self.w1, self.w2,
             *((self.sw1, self.sw2, *self.s_saved[0], *self.s_saved[1]) if sh else ()), *extra)


class _MoEBackward:
    """The MoE layer's backward stages for two micro-batches (as `_MoEForward`). douts[i] [T_i, H]:
    micro-batch i's gradient of the MoE output, contiguous, ready at construction; params: what
    `_MoEForward.save` saved after the Saved of each micro-batch (moefp8.moe_stages.restore)."""

    def __init__(self, layer, st: _Streams, douts, saves, params, want_dx: bool):
        self.layer, self.st, self.douts, self.saves, self.want_dx = layer, st, douts, saves, want_dx
        self.w1, self.w2 = params[:2]
        self.has_shared = layer.shared is not None
        self.sparams = params[2:12] if self.has_shared else None  # sw1, sw2, saved A (4), saved B (4)
        self.ev_in = st.mark(st.compute)
        self.dz, self.ev_dz, self.res, self.ev_res, self.comb, self.ev_comb, self.sh = ([None] * 2 for _ in range(7))
        self.split, self.evented = st.packs_on_compute(layer), st.evented(layer)

    def send(self, i: int) -> None:
        st = self.st
        with st.sending(self.layer.dispatcher, self.split, f"{'AB'[i]} grad pack", self.ev_in):
            if self.evented:
                self.dz[i], self.ev_dz[i] = bwd_dispatch(self.layer, self.douts[i], self.saves[i], evented=True)
            else:
                self.dz[i] = bwd_dispatch(self.layer, self.douts[i], self.saves[i])
                self.ev_dz[i] = st.mark(st.comm)
        st.tick(f"{'AB'[i]} grad dispatched", comm=True)
        st.hand_to(st.compute, self.dz[i])

    def experts(self, i: int) -> None:
        st = self.st
        st.tick(f"wait {'AB'[i]} grad rows")
        st.wait(st.compute, self.ev_dz[i])
        st.tick(f"{'AB'[i]} experts bwd")
        # FP8: the second micro-batch's wgrad GEMMs add into the first one's dW (the same fp32 sums
        # as dW_A + dW_B, without reading two full fp32 copies: ~2.3 ms per block at EP4)
        first = self.res[1 - i]
        into = first[2:] if first is not None and self.layer.recipe.fp8 else None
        self.res[i] = bwd_experts(self.layer, self.dz[i], self.douts[i], self.saves[i], self.w1, self.w2,
                                  self.want_dx, st.gemm, dw_into=into)
        st.tick(f"/{'AB'[i]} experts bwd")
        self.ev_res[i] = st.mark(st.compute)
        st.hand_to(st.comm, self.res[i][:2])

    def combine(self, i: int) -> None:
        st = self.st
        with st.on_comm():
            st.wait(st.comm, self.ev_res[i])
            with st.stage(f"{'AB'[i]} grad combine", comm=True):
                if self.evented:  # dx on the dispatcher's stream (its event), dw on this one (the mark)
                    self.comb[i], evs = bwd_combine(self.layer, self.res[i][0], self.res[i][1], self.saves[i],
                                                    self.douts[i].dtype, evented=True)
                    self.ev_comb[i] = [*evs, st.mark(st.comm)]
                else:
                    self.comb[i] = bwd_combine(self.layer, self.res[i][0], self.res[i][1], self.saves[i],
                                               self.douts[i].dtype)
                    self.ev_comb[i] = st.mark(st.comm)
        st.hand_to(st.compute, self.comb[i])

    def shared(self, i: int) -> None:
        if self.has_shared:
            sw1, sw2, saved = self.sparams[0], self.sparams[1], self.sparams[2 + 4 * i:6 + 4 * i]
            with self.st.stage(f"{'AB'[i]} shared bwd"):
                self.sh[i] = mlp_backward(self.layer.shared, self.douts[i], saved, sw1, sw2, self.want_dx,
                                             self.st.gemm)

    def routed(self, i: int) -> tuple:
        """(dx [T_i, H] or None, d topk_w [T_i, K] or None) of micro-batch i's routed path, once the
        compute stream may read them."""
        self.st.tick(f"wait {'AB'[i]} grad combine")
        self.st.wait(self.st.compute, self.ev_comb[i])
        self.st.tick(f"{'AB'[i]} grad output")
        return self.comb[i]

    def weight_grads(self) -> tuple:
        """(dW1, dW2, shared dW1, shared dW2) summed over the micro-batches (A + B), in the weights' dtypes."""
        if self.res[0][2] is self.res[1][2]:  # added in place by the second micro-batch's wgrad (experts())
            dw1, dw2 = self.res[0][2].to(self.w1.dtype), self.res[0][3].to(self.w2.dtype)
        else:
            dw1 = (self.res[0][2] + self.res[1][2]).to(self.w1.dtype)
            dw2 = (self.res[0][3] + self.res[1][3]).to(self.w2.dtype)
        if not self.has_shared:
            return dw1, dw2, None, None
        sw1, sw2 = self.sparams[:2]
        return dw1, dw2, (self.sh[0][1] + self.sh[1][1]).to(sw1.dtype), (self.sh[0][2] + self.sh[1][2]).to(sw2.dtype)


class OverlappedMoE(torch.autograd.Function):
    """Routed experts of two micro-batches (token halves) + the shared experts, overlapped.
    -> routed(x) + shared(x) (shared omitted when the layer has none)."""

    @staticmethod
    def forward(ctx, x_TH, topk_w_TK, w1, w2, sw1, sw2, topk_idx_TK, layer):
        ctx.policy = layer.overlap  # the backward runs with the forward's
        with _cublas_sm_carveout(ctx.policy.gemm_sm_reserve):
            return OverlappedMoE._forward(ctx, x_TH, topk_w_TK, w1, w2, sw1, sw2, topk_idx_TK, layer)

    @staticmethod
    def backward(ctx, dout):
        with _cublas_sm_carveout(ctx.policy.gemm_sm_reserve):
            return OverlappedMoE._backward(ctx, dout)

    @staticmethod
    def _forward(ctx, x_TH, topk_w_TK, w1, w2, sw1, sw2, topk_idx_TK, layer):
        st = _Streams(x_TH.device, ctx.policy, layer.gemm)
        parts = halves(x_TH.shape[0])
        f = _MoEForward(layer, st, [x_TH[p] for p in parts], [topk_idx_TK[p] for p in parts],
                        [topk_w_TK[p] for p in parts], w1, w2, sw1, sw2, want_dw=ctx.needs_input_grad[1])
        st.tick("forward")
        f.inputs_ready(0)
        f.inputs_ready(1)
        # Host-paced: enqueue both dispatches before the first block (a layout's count read-back),
        # and each expert stage before the communication that waits for it.
        f.send(0)
        if f.split:  # B's packing ahead of A's shared experts on the compute stream
            f.send(1)
        f.shared(0)  # overlaps A's dispatch
        if not f.split:
            f.send(1)  # right behind A's on the comm stream: overlaps A's experts
        f.layout(0)
        f.experts(0)
        f.layout(1)  # the host waits for B's rows while A's experts run
        f.combine(0)
        f.experts(1)  # overlaps A's combine
        f.combine(1)
        f.shared(1)  # overlaps B's combine
        y = torch.cat([f.routed(0), f.routed(1)])
        if layer.shared is not None:
            y = y + torch.cat(f.s_out)
        st.tick("forward done")
        f.save(ctx)
        ctx.layer = layer
        return y

    @staticmethod
    def _backward(ctx, dout):
        layer = ctx.layer
        saves, params = restore(ctx)
        dout = dout.contiguous()
        parts = halves(dout.shape[0])
        st = _Streams(dout.device, ctx.policy, layer.gemm)
        b = _MoEBackward(layer, st, [dout[p] for p in parts], saves, params, want_dx=ctx.needs_input_grad[0])
        st.tick("backward")
        b.send(0)
        b.shared(0)  # overlaps A's gradient dispatch
        b.send(1)
        b.experts(0)  # overlaps B's
        b.combine(0)
        b.experts(1)  # overlaps A's combine
        b.combine(1)
        b.shared(1)  # overlaps B's combine
        comb = [b.routed(0), b.routed(1)]
        dx = torch.cat([c[0] for c in comb]) if ctx.needs_input_grad[0] else None
        if dx is not None and b.has_shared:
            dx = dx + torch.cat([h[0] for h in b.sh])
        dw = torch.cat([c[1] for c in comb]) if comb[0][1] is not None else None
        st.tick("weight grads")
        wg = b.weight_grads()
        st.tick("backward done")
        return dx, dw, *wg, None, None


def serialized(layer, x_TH: Tensor) -> Tensor:
    """The serialized schedule, the reference `OverlappedMoE` must equal bit for bit: micro-batch
    A then B through the plain routed path on one stream, then the shared experts of A and B.
    layer: a moefp8.moe.MoELayer; x [T, H] -> routed + shared [T, H]."""
    r = layer.router(x_TH)
    parts = halves(x_TH.shape[0])
    out = torch.cat([RoutedExperts.apply(x_TH[p], r.topk_w_TK[p], layer.w1, layer.w2, r.topk_idx_TK[p], layer)
                     for p in parts])
    return out + torch.cat([layer.shared(x_TH[p]) for p in parts]) if layer.shared is not None else out


class OverlappedBlock(torch.autograd.Function):
    """A transformer block with a MoE layer (moefp8.model.Block) over two micro-batches, the halves
    of its batch, overlapped: besides the experts, the other micro-batch's attention hides the
    exchanges that `OverlappedMoE` can only put behind the small shared experts:

      forward   comm:              dispatch A | dispatch B | combine A | combine B, out B ->
                compute:  attn A | attn B     | experts A  | experts B | shared A, shared B, out A
                next block (with a `Handoff`):                         | attn A  | attn B ...
      backward  comm:     dispatch dB, dA               | combine B | combine A
                compute:  shared B, A bwd   | experts B | experts A | attn B bwd | attn A bwd

    ("attn": the block up to the router: attention norm, attention, residual, MLP norm, router;
    "out": the block's output half, residual + routed + shared.) Without a handoff, B's combine is
    exposed behind the shared experts; between blocks of a model, the next block's A attention
    runs meanwhile.
    The attention part of each micro-batch is recorded as an ordinary autograd graph (built here,
    from a detached copy of its input) and run backward by `torch.autograd.grad` at its place in
    the order above; the MoE stages are `_MoEForward`/`_MoEBackward`'s. Every parameter of the
    block is an input, so their gradients come back through this node.

    apply(x [B, S, H] bf16, cos, sin, block, handoff, *block.parameters()) -> (out [B, S, H], aux
    [2] (each micro-batch's balance loss) or None, load_E int64, attention output non-finite, MLP
    output non-finite (bool scalars)). Bit-exact against `serialized_block`.
    handoff: None, or the `Handoff` between consecutive blocks: the input's B half is read only
    after the previous block's pending event, and this block's output B half (and the MLP
    non-finite flag) is finished on the communication stream, its event left in `handoff` (on
    CPU there are no streams: everything is ready on return either way)."""

    @staticmethod
    def forward(ctx, x_BSH, cos, sin, block, handoff, *params):
        ctx.policy = block.mlp.overlap  # the backward runs with the forward's
        with _cublas_sm_carveout(ctx.policy.gemm_sm_reserve):
            return OverlappedBlock._forward(ctx, x_BSH, cos, sin, block, handoff, params)

    @staticmethod
    def backward(ctx, dy, daux, *_):
        with _cublas_sm_carveout(ctx.policy.gemm_sm_reserve):
            return OverlappedBlock._backward(ctx, dy, daux)

    @staticmethod
    def _forward(ctx, x, cos, sin, block, handoff, params):
        layer, st = block.mlp, _Streams(x.device, ctx.policy, block.mlp.gemm)
        B, S, H = x.shape
        parts = halves(B)
        sh = layer.shared
        f = _MoEForward(layer, st, [None] * 2, [None] * 2, [None] * 2, layer.w1, layer.w2,
                        sh.w1 if sh else None, sh.w2 if sh else None, want_dw=False)
        pre, nf_a = [None] * 2, []

        def attention(i):  # an autograd graph of its own, run backward in OverlappedBlock._backward
            with st.stage(f"{'AB'[i]} attn"):
                with torch.enable_grad():
                    xi = x[parts[i]].detach().requires_grad_(ctx.needs_input_grad[0])
                    # train.cuda_graphs: this half's graph (evaluation: x, made without autograd, needs no
                    # grad, nor does xi: the eager path)
                    run = block.graphed_halves[i][0] if replays(block, xi, half=i) else block.attend_checked
                    h, m, nf = run(xi, cos, sin)
                    m = m.view(-1, H)
                    r = layer.router(m, S)
                nf_a.append(nf)
            pre[i] = (xi, h, m, r)
            f.xs[i], f.idx[i], f.w[i] = m.detach(), r.topk_idx_TK, r.topk_w_TK.detach()
            f.want_dw = r.topk_w_TK.requires_grad
            f.inputs_ready(i)

        st.tick("forward")
        attention(0)
        # A's dispatch before B's attention is enqueued: the host takes about as long to enqueue an
        # attention as the GPU to run it (exact mode: blocks the host for A's counts)
        f.send(0)
        if handoff is not None and handoff.event is not None:  # the previous block's output half B,
            st.tick("wait B input")  # finished behind its combine while A's attention ran
            handoff.wait()
        attention(1)
        if f.split:  # capacity mode: B's packing right behind B's attention, ahead of A's experts
            f.send(1)
        f.layout(0)  # the host waits for A's rows while B's attention runs
        f.experts(0)
        if not f.split:  # exact mode: B's count read-back would hold the host before A's experts
            f.send(1)  # overlaps A's experts
        f.layout(1)
        f.combine(0)
        f.experts(1)  # overlaps A's combine
        f.combine(1)
        f.shared(0)  # the shared experts of both overlap B's combine
        f.shared(1)
        y = torch.empty_like(x)

        def output(i, o):  # y = h + routed (+ shared) on the current stream -> its non-finite flag
            if sh is not None:
                o = o + f.s_out[i]
            torch.add(pre[i][1].detach(), o.view(-1, S, H), out=y[parts[i]])
            return ~torch.isfinite(o).all()

        nf_o = output(0, f.routed(0))
        if handoff is not None and st.comm is not None:  # B's half behind B's combine on the comm stream
            ev_sh = st.mark(st.compute)  # shared B's output, h_B and A's flag made
            st.hand_to(st.comm, y, pre[1][1], f.s_out[1], nf_o, f.out[1])
            with st.on_comm():
                st.wait(st.comm, ev_sh, f.ev_c[1])  # B's combine: on this stream, or the dispatcher's (evented)
                with st.stage("B output", comm=True):
                    nf_o = nf_o | output(1, f.out[1])
                handoff.event = st.mark(st.comm)  # the next block waits for it
            st.hand_to(st.compute, nf_o)
        else:
            nf_o = nf_o | output(1, f.routed(1))
        st.tick("forward done")
        f.save(ctx)
        ctx.block, ctx.pre = block, pre
        r0, r1 = pre[0][3], pre[1][3]
        aux = torch.stack([r0.aux_loss.detach(), r1.aux_loss.detach()]) if r0.aux_loss is not None else None
        load = r0.load_E + r1.load_E
        nf_a = nf_a[0] | nf_a[1]
        ctx.mark_non_differentiable(load, nf_a, nf_o)
        return y, aux, load, nf_a, nf_o

    @staticmethod
    def _backward(ctx, dy, daux):
        block, pre = ctx.block, ctx.pre
        layer = block.mlp
        saves, mparams = restore(ctx)
        st = _Streams(dy.device, ctx.policy, layer.gemm)
        dy = dy.contiguous()
        B, S, H = dy.shape
        parts = halves(B)
        want_dm = pre[0][2].requires_grad  # the MoE input's gradient feeds the attention graph
        b = _MoEBackward(layer, st, [dy[p].view(-1, H) for p in parts], saves, mparams, want_dx=want_dm)
        grads: dict[int, Tensor] = {}
        dx = torch.empty_like(dy) if ctx.needs_input_grad[0] else None
        params = _attention_params(block)

        def attention(i):  # the attention graph of micro-batch i, once its routed gradients are back
            xi, h, m, r = pre[i]
            dm, dw = b.routed(i)
            if dm is not None and b.has_shared:
                dm = dm + b.sh[i][0]
            roots = [(h, dy[parts[i]]), (m, dm), (r.topk_w_TK, dw)]
            if daux is not None and r.aux_loss is not None:
                roots.append((r.aux_loss, daux[i]))
            roots = [(t, g) for t, g in roots if t.requires_grad and g is not None]
            inputs = [t for t in (xi, *params) if t.requires_grad]
            if not roots or not inputs:
                return
            with st.stage(f"{'AB'[i]} attn bwd"):
                gs = torch.autograd.grad([t for t, _ in roots], inputs, [g for _, g in roots], allow_unused=True)
                for t, g in zip(inputs, gs):
                    if t is xi:
                        dx[parts[i]] = g
                    elif g is not None:  # A's + B's, as the serialized schedule accumulates them
                        grads[id(t)] = g if id(t) not in grads else grads[id(t)] + g

        st.tick("backward")
        b.send(1)  # B's gradient first: A's attention backward is the last stage
        b.send(0)
        b.shared(1)  # the shared experts' backward overlaps both gradient dispatches
        b.shared(0)
        b.experts(1)
        b.combine(1)
        b.experts(0)  # overlaps B's combine
        b.combine(0)
        attention(1)  # overlaps A's combine
        attention(0)
        ctx.pre = None  # the attention graphs are spent
        st.tick("weight grads")
        dw1, dw2, dsw1, dsw2 = b.weight_grads()
        st.tick("backward done")
        grads[id(layer.w1)], grads[id(layer.w2)] = dw1, dw2
        if b.has_shared:
            grads[id(layer.shared.w1)], grads[id(layer.shared.w2)] = dsw1, dsw2
        return dx, None, None, None, None, *(grads.get(id(p)) for p in block.parameters())


def _attention_params(block) -> list:
    """The block's parameters outside the experts: norms, attention, router."""
    experts = {id(p) for p in block.mlp.parameters()} - {id(p) for p in block.mlp.router.parameters()}
    return [p for p in block.parameters() if id(p) not in experts]


def mean_over_halves(aux_2: Tensor | None, B: int) -> Tensor | None:
    """The balance loss of the whole batch (a mean over its B sequences) from those of its two halves."""
    if aux_2 is None:
        return None
    n = [p.stop - p.start for p in halves(B)]
    return (aux_2[0] * n[0] + aux_2[1] * n[1]) / B


def serialized_block(block, x_BSH: Tensor, cos: Tensor, sin: Tensor) -> tuple:
    """The serialized schedule of `OverlappedBlock`, its bit-exact reference: the block
    (moefp8.model.Block) on batch half A, then on B, the MoE layer not overlapped.
    -> (out [B, S, H], aux [2] or None, load_E)."""
    ov, block.mlp.overlap = block.mlp.overlap, None
    try:
        outs = [block(x_BSH[p], cos, sin, []) for p in halves(x_BSH.shape[0])]
    finally:
        block.mlp.overlap = ov
    aux = torch.stack([o[1] for o in outs]) if outs[0][1] is not None else None
    return torch.cat([o[0] for o in outs]), aux, outs[0][2] + outs[1][2]
