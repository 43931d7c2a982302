"""Two micro-batch overlap for the MoE layer (DESIGN.md §4).

The layer's tokens are split in two micro-batches A (first half) and B. Their stages (moefp8.moe:
dispatch, layout, experts, combine; the shared experts of each half) run in an explicit order on
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
device), ordered against the compute stream by events; tensors crossing streams are handed over
with `record_stream`. On the CPU (gloo) there are no streams: the same order runs serially.
Either way the arithmetic is that of running the two micro-batches one after the other
(`serialized`, the reference): outputs and gradients are bit-exact against it. Against the
unsplit layer the weight gradients differ: their col-wise FP8 tiles (128 tokens of one expert)
group other tokens once split, and dW_A + dW_B adds in another fp32 order (measured on 4x H200:
2.4e-3 relative on dW1).

Host syncs: the layout stage reads the per-expert counts on the host (one sync per micro-batch,
on the layout stream: it waits for that micro-batch's dispatch only), and the exact-mode
all_to_all dispatch reads its counts (on the communication stream); the host waits for those
streams while the compute stream keeps working.
"""

from contextlib import nullcontext

import torch
from torch import Tensor

from moefp8.fp8 import Fp8Tensor
from moefp8.kernels.grouped_gemm_ws import reserve_sms
from moefp8.moe import (_RoutedExperts, bwd_combine, bwd_dispatch, bwd_experts, fwd_dispatch, fwd_experts, fwd_layout,
                        restore, save, shared_backward, shared_forward)

_SIDE_STREAMS: dict = {}
# SMs the warp-specialized grouped GEMMs leave free while an overlapped layer runs, for the
# concurrent all-to-alls (their persistent CTAs fill whole SMs; see grouped_gemm_ws.reserve_sms).
# 0: all SMs. tools/bench_overlap.py --gemm-sm-reserve measures other values.
GEMM_SM_RESERVE = 0


def side_stream(device: torch.device, role: str = "comm"):
    """The side stream that `role` ("comm": communication stages, "layout": the layouts) uses on
    `device` (None on CPU)."""
    if device.type != "cuda":
        return None
    key = (device.index if device.index is not None else torch.cuda.current_device(), role)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=key[0])
    return _SIDE_STREAMS[key]


class _Streams:
    """compute (the current stream), comm and layout; on CPU all are None and every call is a no-op."""

    def __init__(self, device: torch.device):
        self.comm = side_stream(device, "comm")
        self.layout = side_stream(device, "layout")
        self.compute = torch.cuda.current_stream(device) if self.comm is not None else None

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
        for ev in events:
            if stream is not None and ev is not None:
                stream.wait_event(ev)

    def hand_to(self, stream, *objs) -> None:
        """Tensors made on one stream and read on `stream`: tell the caching allocator, so their
        memory is not reused before `stream` is done with them."""
        if stream is None:
            return
        for o in objs:
            if isinstance(o, Tensor):
                if o.is_cuda:
                    o.record_stream(stream)
            elif isinstance(o, Fp8Tensor):
                self.hand_to(stream, o.data, o.scale)
            elif isinstance(o, (tuple, list)):
                self.hand_to(stream, *o)


def _halves(T: int) -> list[slice]:
    h = (T + 1) // 2
    return [slice(0, h), slice(h, T)]


class OverlappedMoE(torch.autograd.Function):
    """Routed experts of two micro-batches + the shared experts, overlapped.
    -> routed(x) + shared(x) (shared omitted when the layer has none)."""

    @staticmethod
    def forward(ctx, x_TH, topk_w_TK, w1, w2, sw1, sw2, topk_idx_TK, layer):
        with reserve_sms(GEMM_SM_RESERVE):
            return OverlappedMoE._forward(ctx, x_TH, topk_w_TK, w1, w2, sw1, sw2, topk_idx_TK, layer)

    @staticmethod
    def backward(ctx, dout):
        with reserve_sms(GEMM_SM_RESERVE):
            return OverlappedMoE._backward(ctx, dout)

    @staticmethod
    def _forward(ctx, x_TH, topk_w_TK, w1, w2, sw1, sw2, topk_idx_TK, layer):
        st = _Streams(x_TH.device)
        shared = layer.shared
        want_dw = ctx.needs_input_grad[1]
        parts = _halves(x_TH.shape[0])
        ev_in = st.mark(st.compute)
        d, L, z, saves, out, s_out, s_saved = ([None] * 2 for _ in range(7))
        ev_s, ev_d, ev_z, ev_c = [None] * 2, [None] * 2, [None] * 2, [None] * 2

        def send(i):  # no host sync in capacity mode; exact mode reads its counts
            with st.on_comm():
                st.wait(st.comm, ev_in)
                p = parts[i]
                d[i] = fwd_dispatch(layer, x_TH[p], topk_idx_TK[p], topk_w_TK[p])
                ev_s[i] = st.mark(st.comm)
            st.hand_to(st.layout, d[i].topk_idx)

        def layout(i):  # the host waits for this micro-batch's rows (the layout stream only)
            with st.on(st.layout):
                st.wait(st.layout, ev_s[i])
                L[i] = fwd_layout(layer, d[i])
                ev_d[i] = st.mark(st.layout)
            st.hand_to(st.compute, d[i].x, d[i].topk_idx, d[i].topk_w, L[i].row_TK, L[i].src_M, L[i].offsets)

        def experts(i):
            st.wait(st.compute, ev_d[i])  # implies ev_s[i]: the layout stream waited for the dispatch first
            z[i], saves[i] = fwd_experts(layer, d[i], L[i], w1, w2, want_dw)
            ev_z[i] = st.mark(st.compute)
            st.hand_to(st.comm, z[i])

        def combine(i):
            with st.on_comm():
                st.wait(st.comm, ev_z[i])
                out[i] = layer.dispatcher.combine(z[i], d[i].handle)
                ev_c[i] = st.mark(st.comm)
            st.hand_to(st.compute, out[i])

        def shared_part(i):  # no communication: fills the compute stream while the comm stream works
            if shared is not None:
                s_out[i], s_saved[i] = shared_forward(shared, x_TH[parts[i]], sw1, sw2)

        # Host-paced: enqueue both dispatches before the first block (a layout's count read-back),
        # and each expert stage before the communication that waits for it.
        send(0)
        shared_part(0)  # overlaps A's dispatch
        send(1)  # right behind A's on the comm stream: overlaps A's experts
        layout(0)
        experts(0)
        layout(1)  # the host waits for B's rows while A's experts run
        combine(0)
        experts(1)  # overlaps A's combine
        combine(1)
        shared_part(1)  # overlaps B's combine
        st.wait(st.compute, *ev_c)
        y = torch.cat(out)
        if shared is not None:
            y = y + torch.cat(s_out)
        save(ctx, saves, w1, w2, *((sw1, sw2, *s_saved[0], *s_saved[1]) if shared is not None else ()))
        ctx.layer, ctx.has_shared = layer, shared is not None
        return y

    @staticmethod
    def _backward(ctx, dout):
        layer = ctx.layer
        saves, params = restore(ctx)
        w1, w2 = params[:2]
        st = _Streams(dout.device)
        dout = dout.contiguous()
        parts = _halves(dout.shape[0])
        want_dx = ctx.needs_input_grad[0]
        ev_in = st.mark(st.compute)
        dz, ev_dz, res, ev_res, comb, ev_comb, sh = ([None] * 2 for _ in range(7))

        def send(i):
            with st.on_comm():
                st.wait(st.comm, ev_in)
                dz[i] = bwd_dispatch(layer, dout[parts[i]], saves[i])
                ev_dz[i] = st.mark(st.comm)
            st.hand_to(st.compute, dz[i])

        def experts(i):
            st.wait(st.compute, ev_dz[i])
            res[i] = bwd_experts(layer, dz[i], dout[parts[i]], saves[i], w1, w2, want_dx)
            ev_res[i] = st.mark(st.compute)
            st.hand_to(st.comm, res[i][:2])

        def combine(i):
            with st.on_comm():
                st.wait(st.comm, ev_res[i])
                comb[i] = bwd_combine(layer, res[i][0], res[i][1], saves[i], dout.dtype)
                ev_comb[i] = st.mark(st.comm)
            st.hand_to(st.compute, comb[i])

        def shared_part(i):
            if ctx.has_shared:
                sh[i] = shared_backward(layer.shared, dout[parts[i]], params[4 + 4 * i:8 + 4 * i], params[2], params[3],
                                        want_dx)

        send(0)
        shared_part(0)  # overlaps A's gradient dispatch
        send(1)
        experts(0)  # overlaps B's
        combine(0)
        experts(1)  # overlaps A's combine
        combine(1)
        shared_part(1)  # overlaps B's combine
        st.wait(st.compute, *ev_comb)
        dx = torch.cat([c[0] for c in comb]) if want_dx else None
        if dx is not None and ctx.has_shared:
            dx = dx + torch.cat([h[0] for h in sh])
        dw = torch.cat([c[1] for c in comb]) if comb[0][1] is not None else None
        dw1 = (res[0][2] + res[1][2]).to(w1.dtype)
        dw2 = (res[0][3] + res[1][3]).to(w2.dtype)
        dsw1 = dsw2 = None
        if ctx.has_shared:
            dsw1 = (sh[0][1] + sh[1][1]).to(params[2].dtype)
            dsw2 = (sh[0][2] + sh[1][2]).to(params[3].dtype)
        return dx, dw, dw1, dw2, dsw1, dsw2, None, None


def serialized(layer, x_TH: Tensor) -> Tensor:
    """The serialized schedule, the reference `OverlappedMoE` must equal bit for bit: micro-batch
    A then B through the plain routed path on one stream, then the shared experts of A and B.
    layer: a moefp8.moe.MoELayer; x [T, H] -> routed + shared [T, H]."""
    r = layer.router(x_TH)
    parts = _halves(x_TH.shape[0])
    out = torch.cat([_RoutedExperts.apply(x_TH[p], r.topk_w_TK[p], layer.w1, layer.w2, r.topk_idx_TK[p], layer)
                     for p in parts])
    return out + torch.cat([layer.shared(x_TH[p]) for p in parts]) if layer.shared is not None else out
