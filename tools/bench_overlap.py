"""Two micro-batch overlap benchmark (issue 7): how much of the MoE layer's communication the
overlapped schedule (moefp8.overlap) hides, on 2-4 GPUs.

    torchrun --standalone --nproc_per_node 4 tools/bench_overlap.py
    torchrun --standalone --nproc_per_node 2 tools/bench_overlap.py --smoke      # CPU, gloo

Two units, fwd + bwd, FP8 recipe, all_to_all dispatch (over NCCL; --transports copy_engine adds
the capacity mode over the copy engines, dispatch/copy_engine.py), same inputs and routes:
  moe         the MoE layer alone (`OverlappedMoE`: the shared experts are all the compute there is
              to hide A's dispatch and B's combine behind);
  block       a transformer block, attention + MoE layer (`OverlappedBlock`: the other micro-batch's
              attention hides them too, docs/design.md §4), micro-batches = the halves of --seqs
              sequences of --tokens / --seqs tokens. This is what a training step runs per layer.
              --blocks N: N such blocks in a row, as the model's loop runs them (`Handoff`: with
              overlap on, a block's B combine runs behind the next block's A attention; the last
              block's is exposed); figures for the stack, per block beside.
Per unit:
  t_off       the unit as users run it without overlap (one micro-batch);
  t_serial    the serialized two micro-batch schedule (A then B on one stream): overlap's reference;
  t_on        the overlapped schedule;
  t_comm      its communication alone: the dispatches and combines of both micro-batches, forward
              and backward, back to back (no compute; each combine's input where the step makes it,
              i.e. in the copy engines' send slot: nothing staged);
  t_compute   the overlapped step with its exchanges replayed from a recording (`Replay`: the
              same rows and routes, no communication);
  exposed     (t_on - t_compute) / t_comm; hidden = 1 - exposed (the JSON also keeps the earlier
              estimate with t_compute = t_serial - t_comm). --rounds N: t_on, t_compute and t_comm
              measured N times, one round after the other (the GPUs' clocks and the ranks' skew drift
              over seconds); then hidden is the median of the N rounds' shares, t_on, t_compute and
              t_comm the medians, and every round is kept in the JSON.
  diagnostic  t_compute_sync: the replay with each exchange's rank synchronization kept (a
              1-element all-reduce in its place): hidden_transfer = 1 - (t_on - t_compute_sync) /
              t_comm separates the transfer time from waiting for slower ranks.
              --timeline: the overlapped step's compute stream stage by stage, per rank, real against
              replayed exchanges (moefp8.overlap.Timeline), and every back-to-back step's time;
              --aligned: t_on and t_compute again with every step started on all ranks together
              (no drift between steps); --clocks: the GPUs' clocks, power and clock reasons while
              t_on and t_compute are timed (nvidia-smi).
Whole step: the small training model (moefp8.model.Transformer) fwd + bwd with overlap off / on.
NCCL CTA limit (ncclConfig max_ctas through ProcessGroupNCCL.Options): t_on with the
communication group capped at --ctas CTAs, and what a running all-to-all costs an FP8 GEMM
(alone vs. concurrent) at each cap. Speed-of-light for the comm: the NCCL all-reduce bus
bandwidth of the same run. One overlapped step of the last unit is traced (torch profiler, Chrome
JSON) beside the results JSON. Timings: median of --iters, max over ranks.
"""

import argparse
import contextlib
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_dispatch import allreduce_busbw, init_torchrun, timed  # noqa: E402

from moefp8.config import ModelConfig, RecipeConfig  # noqa: E402
from moefp8.dispatch import build_dispatcher  # noqa: E402
from moefp8.kernels.grouped_gemm import GemmPolicy  # noqa: E402
from moefp8.kernels.quant import quant_rowwise  # noqa: E402
from moefp8.kernels.rope import rope_tables  # noqa: E402
from moefp8.model import Block, Transformer  # noqa: E402
from moefp8.moe import MoELayer  # noqa: E402
from moefp8.moe_stages import combine_buffer  # noqa: E402
from moefp8.overlap import Handoff, OverlapPolicy, Timeline, halves, serialized, serialized_block  # noqa: E402
from moefp8.recipe import Recipe  # noqa: E402
from moefp8.testing import GpuSampler, print_table, results_path, save_results  # noqa: E402


def comm_group(ctas: int | None):
    """A process group over all ranks; NCCL capped at `ctas` CTAs per collective if given."""
    if ctas is None or dist.get_backend() != "nccl":
        return None
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.min_ctas = 1
    opts.config.max_ctas = ctas
    return dist.new_group(backend="nccl", pg_options=opts)


class Replay:
    """A dispatcher that records what the real one returns during one step, then replays those
    results without communicating: the same step's compute alone (same rows, same routes, same
    kernels), i.e. t_compute_only of the exposed-communication share. Inputs never change between
    the benchmark's steps, so the recorded results are the ones the real exchange would give.
    sync=True keeps each exchange's synchronization point: a 1-element all-reduce in its place
    (on the stream the exchange would use), so the ranks still wait for each other there but
    move no payload: compute + rank skew, without the transfers."""

    def __init__(self, real, sync: bool = False):
        self.real, self.log, self.i, self.recording, self.sync = real, [], 0, True, sync
        self.tiny = None
        self.num_local_experts, self.communicates = real.num_local_experts, real.communicates
        self.num_experts, self.scale_fmt = real.num_experts, real.scale_fmt

    def _call(self, name, *a, **k):
        if self.recording:
            self.log.append(getattr(self.real, name)(*a, **k))
            return self.log[-1]
        out = self.log[self.i]
        self.i = (self.i + 1) % len(self.log)
        if self.sync:
            if self.tiny is None:
                self.tiny = torch.zeros(1, device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu")
            s = self.real.exchange_stream  # where the real exchange would run
            with torch.cuda.stream(s) if s is not None else contextlib.nullcontext():
                dist.all_reduce(self.tiny, group=self.real.group)
        return out

    def packs_on_caller_stream(self, topk):  # the real one's, so that the schedule splits its stages the same way
        return self.real.packs_on_caller_stream(topk)

    @property
    def exchange_stream(self):
        return self.real.exchange_stream

    @exchange_stream.setter
    def exchange_stream(self, s):
        self.real.exchange_stream = s

    def combine_buffer(self, *a, **k):  # a send slot of the real transport while recording, else none
        return self.real.combine_buffer(*a, **k) if self.recording else None

    def dispatch(self, *a, **k):
        return self._call("dispatch", *a, **k)

    def combine(self, *a, **k):
        return self._call("combine", *a, **k)


@contextlib.contextmanager
def replaying(layer, run, disp, sync: bool = False):
    """Inside, `layer` dispatches through a Replay of `disp` that has recorded one run()."""
    rp = Replay(disp, sync)
    layer.dispatcher = rp
    try:
        run()  # records one step
        rp.recording = False
        yield
    finally:
        layer.dispatcher = disp


def compute_only(layer, run, disp, warmup, iters, dev, sync: bool = False, per_rank: list | None = None,
                 aligned: bool = False) -> float:
    """run() timed with `disp` replaced by its replay (no communication; see Replay for sync)."""
    with replaying(layer, run, disp, sync):
        return timed(run, warmup, iters, dev, per_rank, aligned=aligned)


class MoEUnit:
    """The MoE layer alone; micro-batches = the token halves. policy: the overlap's (step "on")."""
    name = "MoE layer"

    def __init__(self, layer: MoELayer, x, dout, policy: OverlapPolicy):
        self.moe, self.x, self.dout, self.policy = layer, x, dout, policy

    def step(self, how: str):
        """fwd + bwd, how = "off" (one micro-batch), "serial" or "on" (overlapped, with `policy`)."""
        def run():
            self.moe.zero_grad(set_to_none=True)
            xi = self.x.detach().requires_grad_()
            self.moe.overlap = self.policy if how == "on" else None
            out = serialized(self.moe, xi) if how == "serial" else self.moe(xi).out
            out.backward(self.dout)
        return run

    @torch.no_grad()
    def moe_inputs(self):
        """[(the MoE layer's input [T, H], its routes, the micro-batches' token slices)]."""
        return [(self.x, self.moe.router(self.x), halves(self.x.shape[0]))]


class MoELayers:
    """The MoE layers of a stack of blocks as one for `unit_times`: setting an attribute
    (`dispatcher`, `overlap`) sets every layer's; reading one reads the first layer's."""

    def __init__(self, layers):
        self.__dict__["layers"] = list(layers)

    def __getattr__(self, k):
        return getattr(self.layers[0], k)

    def __setattr__(self, k, v):
        for layer in self.layers:
            setattr(layer, k, v)


class BlockUnit:
    """Transformer blocks (attention + MoE layer), one or several in a row as a model runs them
    (moefp8.model.Transformer's loop: with overlap on, each block's output half B is finished
    behind its combine while the next block's A attention runs, `moefp8.overlap.Handoff`; the
    last block's is waited for before the backward); micro-batches = the halves of the batch."""

    def __init__(self, blocks: list[Block], x_BSH, dout_BSH, policy: OverlapPolicy):
        self.blocks, self.moe, self.x, self.dout = blocks, MoELayers(b.mlp for b in blocks), x_BSH, dout_BSH
        self.policy = policy
        self.cos, self.sin = rope_tables(x_BSH.shape[1], blocks[0].attn.head_dim, 10000.0, x_BSH.device)
        n = len(blocks)
        self.name = "transformer block (attention + MoE)" if n == 1 else f"{n} transformer blocks (attention + MoE) in a row"

    def step(self, how: str):
        def run():
            for b in self.blocks:
                b.zero_grad(set_to_none=True)
            xi = self.x.detach().requires_grad_()
            self.moe.overlap = self.policy if how == "on" else None
            out, handoff = xi, Handoff()
            for b in self.blocks:
                out = (serialized_block(b, out, self.cos, self.sin) if how == "serial"
                       else b(out, self.cos, self.sin, [], handoff))[0]
            handoff.wait()
            out.backward(self.dout)
        return run

    @torch.no_grad()
    def moe_inputs(self):
        """[(block i's MoE input [T, H], its routes, the micro-batches' token slices)] for each
        block, each block's input from the previous one (the serialized schedule: it fits the
        micro-batches' dispatchers)."""
        (B, S, H), x, out = self.x.shape, self.x, []
        for b in self.blocks:
            m = b.attend(x, self.cos, self.sin)[2].view(-1, H)
            out.append((m, b.mlp.router(m, S), [slice(p.start * S, p.stop * S) for p in halves(B)]))
            x = serialized_block(b, x, self.cos, self.sin)[0]
        return out


def unit_times(unit, warmup, iters, dev, disp_full, disp_half, clocks: bool = False, aligned: bool = False,
               rounds: int = 1) -> dict:
    """disp_full serves the one-micro-batch unit, disp_half the two-micro-batch schedules (in
    capacity mode their capacities are T and the larger half). clocks: the GPUs' clocks, power and
    clock reasons sampled (nvidia-smi, rank 0 for the node) while t_on and t_compute_on are timed.
    aligned: t_on and t_compute_on again with every step started on all ranks together. rounds:
    t_on, t_compute_on and t_comm measured in that many rounds, one after the other (medians reported)."""
    layer, out = unit.moe, {}
    sampler = GpuSampler if clocks and dist.get_rank() == 0 else contextlib.nullcontext
    layer.dispatcher = disp_full
    out["t_off"] = timed(unit.step("off"), warmup, iters, dev)
    layer.dispatcher = disp_half
    out["t_serial"] = timed(unit.step("serial"), warmup, iters, dev)
    with sampler() as s:
        out["t_on"] = timed(unit.step("on"), warmup, iters, dev)
    out["gpus_on"] = getattr(s, "summary", None)
    # communication alone, with the schedule's routes: both halves, forward and backward
    disp = layer.dispatcher
    parts = []
    with torch.no_grad():
        for x, r, parts_of_x in unit.moe_inputs():  # each MoE layer of the unit
            for p in parts_of_x:
                x8, g8 = quant_rowwise(x[p]), quant_rowwise(unit.dout.view(-1, x.shape[1])[p])
                d = disp.dispatch(x8, r.topk_idx_TK[p], r.topk_w_TK[p])
                z = torch.zeros(d.x.data.shape[0], x.shape[1], dtype=torch.bfloat16, device=x.device)
                dw = torch.zeros(d.topk_w.shape, dtype=torch.float32, device=x.device)
                parts.append((x8, g8, r.topk_idx_TK[p], r.topk_w_TK[p], z, dw))

    def made_in_place(z, h):  # where the step's unpermute writes the combine's input (copy engines: the
        buf = combine_buffer(disp, h, z)  # send slot, so nothing is staged; its contents do not matter here)
        return z if buf is None else buf

    def comm():
        for x8, g8, idx, w, z, dw in parts:
            h = disp.dispatch(x8, idx, w).handle
            disp.combine(made_in_place(z, h), h)
            disp.dispatch(g8, handle=h)
            disp.combine(made_in_place(z, h), h)
            disp.combine(dw, h)

    out["t_comm"] = timed(comm, warmup, iters, dev)
    # the overlapped step's compute alone: its exchanges replayed from a recording
    out["compute_per_rank"] = []
    with sampler() as s:
        out["t_compute_on"] = compute_only(layer, unit.step("on"), disp, warmup, iters, dev,
                                           per_rank=out["compute_per_rank"])
    out["gpus_compute"] = getattr(s, "summary", None)
    out["rounds"] = [(out["t_on"], out["t_compute_on"], out["t_comm"])]
    for _ in range(rounds - 1):  # more rounds: on, compute only and comm alone one after the other
        out["rounds"].append((timed(unit.step("on"), warmup, iters, dev),
                              compute_only(layer, unit.step("on"), disp, warmup, iters, dev),
                              timed(comm, warmup, iters, dev)))
    out["rounds_hidden"] = [1 - (on - comp) / cm for on, comp, cm in out["rounds"]]
    if rounds > 1:
        out["t_on"], out["t_compute_on"], out["t_comm"] = (statistics.median(r[i] for r in out["rounds"])
                                                           for i in range(3))
    out["hidden"] = statistics.median(out["rounds_hidden"])
    out["exposed"] = 1 - out["hidden"]
    if aligned:  # the same two, every step started on all ranks together (no run-ahead, no drift)
        out["t_on_aligned"] = timed(unit.step("on"), warmup, iters, dev, aligned=True)
        out["t_compute_aligned"] = compute_only(layer, unit.step("on"), disp, warmup, iters, dev, aligned=True)
        out["hidden_aligned"] = 1 - (out["t_on_aligned"] - out["t_compute_aligned"]) / out["t_comm"]
    # diagnostic: the same replay keeping each exchange's rank synchronization (no payload): what
    # of t_on - t_compute is transfer time and what is waiting for the slowest rank
    out["t_compute_sync"] = compute_only(layer, unit.step("on"), disp, warmup, iters, dev, sync=True)
    out["hidden_transfer"] = 1 - (out["t_on"] - out["t_compute_sync"]) / out["t_comm"]
    # the earlier estimate, kept for comparison: compute = serialized - comm
    out["hidden_est_serial_minus_comm"] = 1 - (out["t_on"] - (out["t_serial"] - out["t_comm"])) / out["t_comm"]
    return out


def step_timeline(unit, dev, steps: int) -> tuple[list, list]:
    """moefp8.overlap.Timeline marks of the last of `steps` back-to-back overlapped steps of the unit
    (as the timed loop runs them; its overlap policy with a Timeline), from a "step" mark on the
    compute stream to an "end" mark after the last: ([(label, stream, ms after "step", queue ms)],
    [ms of each of the steps]). queue: how long after the host enqueued the mark the GPU reached it
    (the first step starts on an idle GPU, so its first mark is the calibration); near 0, the GPU
    was waiting for the host there."""
    tl = Timeline()
    stream = torch.cuda.current_stream() if dev.type == "cuda" else None
    dist.barrier()
    if stream is not None:
        torch.cuda.synchronize()
    since = 0
    policy = unit.policy
    unit.policy = replace(policy, timeline=tl)
    run = unit.step("on")
    try:
        for _ in range(steps):
            since = len(tl.marks)
            tl.mark("step", "compute", stream)
            run()
        tl.mark("end", "compute", stream)
    finally:
        unit.policy = policy
    marks = tl.times_ms()  # one read of every event
    bounds = [t for lab, _, t, _ in marks if lab in ("step", "end")]
    t0 = marks[since][2]
    return ([(lab, nm, t - t0, t - h) for lab, nm, t, h in marks[since:]],
            [round(b - a, 3) for a, b in zip(bounds, bounds[1:])])


def unit_timelines(unit, disp, dev, steps: int) -> dict:
    """Where the overlapped step's time goes, per rank: its Timeline with the real exchanges ("on")
    and with them replayed ("compute"), gathered from every rank -> {"on": [rank 0's marks, ...],
    "compute": [...], "on_steps_ms": [rank 0's step times, ...], "compute_steps_ms": [...]}."""
    layer, out = unit.moe, {}
    out["on"], out["on_steps_ms"] = step_timeline(unit, dev, steps)
    with replaying(layer, unit.step("on"), disp):
        out["compute"], out["compute_steps_ms"] = step_timeline(unit, dev, steps)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, out)
    return {k: [e[k] for e in every] for k in out}


def timeline_rows(tls: dict) -> list[dict]:
    """The compute stream's intervals (from each mark to the next, ms) per rank, "on" beside
    "compute", plus per-rank totals of the waits (`wait ...`: the compute stream waiting for an
    exchange), the host gaps (`/...`: it ran dry until the host enqueued the next stage) and the
    rest, and the queue at each stage's start (how long the GPU reached it after the host enqueued
    it; ~0: host-paced there); then every back-to-back step's time and when each exchange ended on
    the comm stream."""
    def intervals(marks):
        c = [(lab, t, q) for lab, nm, t, q in marks if nm == "compute"]
        return [(lab, t1 - t0, q) for (lab, t0, q), (_, t1, _) in zip(c, c[1:])]

    on, comp = [intervals(m) for m in tls["on"]], [intervals(m) for m in tls["compute"]]
    rows = []
    labels = [lab for lab, _, _ in on[0]]
    same = all([lab for lab, _, _ in r] == labels for r in on + comp)
    if same:
        for j, lab in enumerate(labels):
            rows.append({"stage": lab, "on_ms": [round(r[j][1], 3) for r in on],
                         "compute_ms": [round(r[j][1], 3) for r in comp],
                         "on_queue_ms": [round(r[j][2], 3) for r in on],
                         "compute_queue_ms": [round(r[j][2], 3) for r in comp]})

    def kind(lab):
        return "wait" if lab.startswith("wait ") else "host gap" if lab.startswith("/") else "work"

    for k in ("wait", "host gap", "work"):
        rows.append({"stage": f"sum: {k}",
                     "on_ms": [round(sum(d for lab, d, _ in r if kind(lab) == k), 3) for r in on],
                     "compute_ms": [round(sum(d for lab, d, _ in r if kind(lab) == k), 3) for r in comp]})
    rows.append({"stage": "step", "on_ms": [round(sum(d for _, d, _ in r), 3) for r in on],
                 "compute_ms": [round(sum(d for _, d, _ in r), 3) for r in comp]})
    # every back-to-back step's time (the last one is the one broken down above)
    for j in range(len(tls["on_steps_ms"][0])):
        rows.append({"stage": f"step {j + 1} of {len(tls['on_steps_ms'][0])}",
                     "on_ms": [r[j] for r in tls["on_steps_ms"]], "compute_ms": [r[j] for r in tls["compute_steps_ms"]]})
    # the comm stream's marks: when each exchange ended (ms after the step's start)
    comm = [[(lab, t) for lab, nm, t, _ in m if nm == "comm"] for m in tls["on"]]
    if all([lab for lab, _ in r] == [lab for lab, _ in comm[0]] for r in comm):
        for j, (lab, _) in enumerate(comm[0]):
            rows.append({"stage": f"comm: {lab}", "on_at_ms": [round(r[j][1], 3) for r in comm]})
    return rows


def gemm_under_comm(exchange, dev, warmup, iters) -> tuple[float, float]:
    """(FP8 GEMM alone, the same GEMM while `exchange(send) -> recv` (an all-to-all of uint8 [N, C])
    runs on another stream) in seconds."""
    from moefp8.kernels.gemm import fp8_gemm
    from moefp8.kernels.quant import quant_weight

    a = quant_rowwise(torch.randn(8192, 7168, device=dev).bfloat16())
    b = quant_weight(torch.randn(4096, 7168, device=dev))
    buf = torch.empty(dist.get_world_size(), 16 << 20, dtype=torch.uint8, device=dev).view(-1, 4096)
    side = torch.cuda.Stream()
    alone = timed(lambda: fp8_gemm(a, b), warmup, iters, dev)

    def both():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            exchange(buf)
        for _ in range(4):
            fp8_gemm(a, b)
        torch.cuda.current_stream().wait_stream(side)

    # a GEMM's share of `both`: 4 GEMMs, measured as a whole and divided
    return alone, timed(both, warmup, iters, dev) / 4


def whole_step(cfg: ModelConfig, disp, tokens: int, seq: int, warmup, iters, dev, policy: OverlapPolicy,
               gemm: GemmPolicy) -> dict:
    out = {}
    model = Transformer(cfg, Recipe(), disp, ep_rank=dist.get_rank(), gemm=gemm).to(dev)
    idx = torch.randint(0, 256, (tokens // seq, seq), device=dev)
    for ov in (False, True):
        for m in model.modules():
            if isinstance(m, MoELayer):
                m.overlap = policy if ov else None

        def run():
            model.zero_grad(set_to_none=True)
            model(idx, idx).out.backward()

        out["on" if ov else "off"] = timed(run, warmup, iters, dev)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=64, help="total; rounded down to a multiple of the rank count")
    p.add_argument("--ctas", default="16,8", help="NCCL max_ctas caps to measure (comma list; NCCL only)")
    p.add_argument("--modes", default="exact,capacity", help="all_to_all dispatch modes to measure (comma list)")
    p.add_argument("--transports", default="collective",
                   help="all_to_all transports (comma list): collective (NCCL), copy_engine (capacity mode only)")
    p.add_argument("--slots", default="4",
                   help="copy engines: send slots in the transport's ring (comma list; dispatch.slots)")
    p.add_argument("--units", default="moe,block",
                   help="what to time (comma list): moe (the MoE layer alone), block (attention + MoE layer)")
    p.add_argument("--blocks", default="1",
                   help="block: blocks in a row per step (comma list; each one unit, per-block figures beside): "
                        "with overlap, one block's B combine runs behind the next one's A attention")
    p.add_argument("--seqs", type=int, default=2,
                   help="block: sequences per rank (the micro-batches are their halves; --tokens / --seqs each)")
    p.add_argument("--rounds", type=int, default=1,
                   help="t_on, t_compute and t_comm measured in this many rounds; hidden = the median round's share")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--gemm", choices=("auto", "triton"), default="auto",
                   help="grouped GEMMs: auto (the per-expert cuBLAS loop where it pays, moefp8.kernels."
                        "grouped_gemm.GemmPolicy.loop_min_macs) or triton (the single-launch kernels everywhere: "
                        "fewer launches)")
    p.add_argument("--trace-all-ranks", action="store_true", help="every rank writes its trace (default: rank 0)")
    p.add_argument("--bind-cpus", action="store_true",
                   help="pin each rank to CPUs near its GPU (moefp8.affinity; torchrun pins nothing)")
    p.add_argument("--gemm-sm-reserve", type=int, default=0,
                   help="SMs the warp-specialized grouped GEMMs leave free in the overlapped schedule")
    p.add_argument("--side-priorities", default="-1",
                   help="CUDA priorities of the overlap's side streams to measure (comma list; moefp8.overlap."
                        "OverlapPolicy.side_stream_priority; lower is higher, 0 the default)")
    p.add_argument("--trace-steps", type=int, default=1,
                   help="overlapped steps in the trace, back to back (after a barrier): >1 shows the steady state")
    p.add_argument("--timeline", type=int, default=0, metavar="STEPS",
                   help="per unit, the overlapped step's stage timeline (moefp8.overlap.Timeline) on every rank, "
                        "real vs replayed exchanges: the last of STEPS back-to-back steps (0: off)")
    p.add_argument("--clocks", action="store_true",
                   help="sample the GPUs' clocks, power and clock reasons (nvidia-smi) while t_on and t_compute are timed")
    p.add_argument("--aligned", action="store_true",
                   help="also time t_on and t_compute with every step started on all ranks together (a barrier "
                        "before each): separates rank drift between back-to-back steps from the step itself")
    p.add_argument("--no-whole-step", action="store_true", help="skip the whole-model step")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU/gloo smoke test)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    gemm = GemmPolicy(loop_min_macs=float("inf")) if a.gemm == "triton" else GemmPolicy()
    if a.smoke:
        a.tokens, a.hidden, a.inter, a.topk, a.experts, a.warmup, a.iters = 64, 256, 128, 2, 8, 1, 2
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds}: must be >= 1")
    if a.seqs < 2 or a.tokens % a.seqs:
        p.error(f"--seqs {a.seqs}: needs at least 2 sequences (one per micro-batch) that divide --tokens {a.tokens}")
    if a.hidden % 128:
        p.error(f"--hidden {a.hidden}: not a multiple of 128 (the FP8 tiles; the block's heads are 128 wide)")

    rank, n, dev = init_torchrun(a.bind_cpus)
    cuda = dev.type == "cuda"
    E = (a.experts // n) * n
    torch.manual_seed(0)  # the same router and weights on every rank (each keeps its expert slice)
    g = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn(a.tokens, a.hidden, device=dev, generator=g).bfloat16()
    dout = torch.randn(a.tokens, a.hidden, device=dev, generator=g).bfloat16()
    busbw, _ = allreduce_busbw((1 if a.smoke else 256) << 20, a.warmup, a.iters, dev)
    shape = f"T{a.tokens} H{a.hidden} I{a.inter} top{a.topk}/E{E} EP{n}"
    peak = {"what": f"{dist.get_backend()} all-reduce bus bandwidth, 256 MB, {n} ranks", "value": round(busbw, 1),
            "unit": "GB/s"}
    rows, timelines = [], []

    def add(case, impl, t, **kw):
        rows.append({"case": case, "impl": impl, "value": round(t * 1e3, 3), "unit": "ms", **kw})

    caps = [None] + ([int(c) for c in a.ctas.split(",") if c] if cuda else [])
    modes = [m for m in a.modes.split(",") if m]
    n_blocks = [int(v) for v in a.blocks.split(",") if v]
    if not n_blocks or min(n_blocks) < 1:
        p.error(f"--blocks {a.blocks}: block counts must be >= 1")
    kinds = [u for u in a.units.split(",") if u]
    units = [(k, nb) for k in kinds for nb in (n_blocks if k == "block" else [1])]  # (kind, blocks in a row)
    S = a.tokens // a.seqs

    def overlap_policy(prio: int) -> OverlapPolicy:
        return OverlapPolicy(gemm_sm_reserve=a.gemm_sm_reserve, side_stream_priority=prio)

    def make_unit(unit, disp, policy: OverlapPolicy, overlap=False):
        kind, nb = unit
        on = policy if overlap else None
        if kind == "moe":
            return MoEUnit(MoELayer(a.hidden, a.inter, E, a.topk, n_shared=1, dispatcher=disp, overlap=on,
                                    gemm=gemm).to(dev), x, dout, policy)
        cfg = ModelConfig(name="bench", hidden=a.hidden, n_layers=nb, n_dense_layers=0,
                          n_heads=a.hidden // 128, head_dim=128, moe_inter=a.inter, n_experts=E, topk=a.topk, n_shared=1)
        recipe = Recipe.from_config(RecipeConfig())  # the training default: FP8, wo in BF16
        blocks = [Block(cfg, i, recipe, disp, overlap=on, gemm=gemm).to(dev) for i in range(nb)]
        return BlockUnit(blocks, x.view(a.seqs, S, a.hidden), dout.view(a.seqs, S, a.hidden), policy)

    def half_capacity(unit):  # the larger micro-batch's tokens
        return (a.tokens + 1) // 2 if unit[0] == "moe" else -(-a.seqs // 2) * S

    transports = [t for t in a.transports.split(",") if t]
    if "copy_engine" in transports and not cuda:
        p.error("--transports copy_engine: needs GPUs")
    prios = [int(v) for v in a.side_priorities.split(",") if v]
    slots = [int(v) for v in a.slots.split(",") if v]
    runs = [(c, m, t, u, pr, sl) for c in caps for m in modes for t in transports for u in units for pr in prios
            for sl in slots  # copy engines: capacity blocks, no NCCL; slots: copy engines only
            if (t == "collective" and sl == slots[0]) or (t == "copy_engine" and m == "capacity" and c is None)]
    for cap, mode, transport, (kind, nb), prio, sl in runs:
        group = comm_group(cap)
        full, half = (build_dispatcher("all_to_all", E, group, capacity=c, mode=mode, transport=transport, slots=sl)
                      for c in (a.tokens, half_capacity((kind, nb))))
        unit = make_unit((kind, nb), full, overlap_policy(prio))
        r = unit_times(unit, a.warmup, a.iters, dev, full, half, clocks=a.clocks, aligned=a.aligned, rounds=a.rounds)
        tag = (f", all_to_all {mode}" + ("" if cap is None else f", NCCL max_ctas {cap}")
               + ((", copy engines" + (f" ({sl} slots)" if len(slots) > 1 else "")) if transport == "copy_engine"
                  else "")
               + (f", side streams at priority {prio}" if len(prios) > 1 else "")
               + (", Triton grouped GEMMs" if a.gemm == "triton" else "")
               + (f", GEMMs leave {a.gemm_sm_reserve} SMs" if a.gemm_sm_reserve else ""))
        what = shape + (f" ({a.seqs} sequences of {S}, {a.hidden // 128} heads)" if kind != "moe" else "")
        case = f"{unit.name} fwd+bwd {what}{tag}"
        uk = {"unit_kind": kind, **({"blocks": nb} if kind != "moe" else {})}  # per-block figures: the stack's / nb
        add(case, "overlap off (one micro-batch)", r["t_off"], baseline="serialized 2 micro-batches",
            baseline_value=round(r["t_serial"] * 1e3, 3), ratio=round(r["t_serial"] / r["t_off"], 3), **uk)
        add(case, "overlap on", r["t_on"], baseline="overlap off", baseline_value=round(r["t_off"] * 1e3, 3),
            ratio=round(r["t_off"] / r["t_on"], 3), speedup_vs_serialized=round(r["t_serial"] / r["t_on"], 3),
            per_block_on_off_serial_ms=[round(r[k] * 1e3 / nb, 3) for k in ("t_on", "t_off", "t_serial")],
            t_comm_ms=round(r["t_comm"] * 1e3, 3), t_compute_only_ms=round(r["t_compute_on"] * 1e3, 3),
            exposed_comm_share=round(r["exposed"], 3), hidden_comm_share=round(r["hidden"], 3),
            hidden_share_est_serial_minus_comm=round(r["hidden_est_serial_minus_comm"], 3),
            t_compute_sync_ms=round(r["t_compute_sync"] * 1e3, 3),
            hidden_transfer_share_diagnostic=round(r["hidden_transfer"], 3), **uk,
            **({"rounds_on_compute_comm_ms": [[round(v * 1e3, 3) for v in rd] for rd in r["rounds"]],
                "rounds_hidden_comm_share": [round(h, 3) for h in r["rounds_hidden"]]} if a.rounds > 1 else {}),
            **({"gpus_on": r["gpus_on"], "gpus_compute_only": r["gpus_compute"]} if a.clocks else {}),
            **({"t_on_aligned_ms": round(r["t_on_aligned"] * 1e3, 3),
                "t_compute_only_aligned_ms": round(r["t_compute_aligned"] * 1e3, 3),
                "hidden_comm_share_aligned": round(r["hidden_aligned"], 3)} if a.aligned else {}))
        add(case, "overlap on, compute only (exchanges replayed)", r["t_compute_on"],
            per_rank_ms=[round(v * 1e3, 3) for v in r["compute_per_rank"]], **uk)
        add(case, "overlap on, compute only + the exchanges' rank synchronization (diagnostic)", r["t_compute_sync"],
            **uk)
        add(case, "communication alone", r["t_comm"], **uk)
        if rank == 0 and a.rounds > 1:
            print(f"{case}: hidden share per round {' '.join(f'{h:.3f}' for h in r['rounds_hidden'])}, median "
                  f"{r['hidden']:.3f}")
        if rank == 0 and a.aligned:
            print(f"{case}: every step started together: on {r['t_on_aligned'] * 1e3:.2f} ms, compute only "
                  f"{r['t_compute_aligned'] * 1e3:.2f} ms, hidden {r['hidden_aligned']:.3f}")
        for what, g in (("on", r["gpus_on"]), ("compute only", r["gpus_compute"])) if rank == 0 and a.clocks else ():
            for gpu, v in (g or {}).items():
                print(f"  {what}: GPU {gpu} SM {v['sm_mhz_median']:.0f} MHz (min {v['sm_mhz_min']:.0f}), memory "
                      f"{v['mem_mhz_median']:.0f} MHz, {v['power_w_median']:.0f} W (max {v['power_w_max']:.0f}), "
                      f"{v['temp_c_max']:.0f} C, {', '.join(v['clock_reasons']) or 'no clock reason'}")
        if a.timeline:
            tl_rows = timeline_rows(unit_timelines(unit, half, dev, a.timeline))
            timelines.append({"case": case, "stages": tl_rows})
            if rank == 0:
                print(f"timeline of the overlapped step (compute stream, ms per rank), {case}:")
                print_table([{"stage": t["stage"],
                              "on": " ".join(f"{v:.2f}" for v in t.get("on_ms", t.get("on_at_ms"))),
                              "compute only": " ".join(f"{v:.2f}" for v in t.get("compute_ms", [])),
                              "queue at start, on": " ".join(f"{v:.2f}" for v in t.get("on_queue_ms", []))}
                             for t in tl_rows], ["stage", "on", "compute only", "queue at start, on"])
        if cuda and mode == [r[1] for r in runs if (r[0], r[2]) == (cap, transport)][0] and (kind, nb) == units[0] \
                and prio == prios[0]:
            if transport == "copy_engine":
                exchange, how = half._copy_engine(), ", copy engines"
            else:
                def exchange(buf, group=group):
                    recv = torch.empty_like(buf)
                    dist.all_to_all_single(recv, buf, group=group)
                how = f", NCCL max_ctas {cap}" if cap else ", NCCL default CTAs"
            alone, under = gemm_under_comm(exchange, dev, a.warmup, a.iters)
            add("FP8 GEMM 8192x4096x7168 during all-to-all" + how, "gemm under comm",
                under, baseline="gemm alone", baseline_value=round(alone * 1e3, 3), ratio=round(alone / under, 3))
        del unit
    if not a.smoke and not a.no_whole_step:
        cfg = ModelConfig(name="small", hidden=1024, n_layers=8, n_dense_layers=1, n_heads=8, head_dim=128,
                          dense_inter=2816, moe_inter=512, n_experts=(32 // n) * n, topk=4, n_shared=1, n_groups=4,
                          topk_groups=2)
        s = whole_step(cfg, build_dispatcher("all_to_all", cfg.n_experts, None), 16384, 1024, a.warmup, a.iters, dev,
                       overlap_policy(runs[-1][4]), gemm)
        case = f"whole step, model small (8 layers, E{cfg.n_experts} top4), 16384 tokens/rank, EP{n}"
        add(case, "overlap on", s["on"], baseline="overlap off", baseline_value=round(s["off"] * 1e3, 3),
            ratio=round(s["off"] / s["on"], 3))

    # overlapped steps (--trace-steps) of the last unit traced (every rank runs it: collectives); rank 0 keeps the trace
    from torch.profiler import ProfilerActivity, profile

    _, mode, transport, last, prio, sl = runs[-1]
    unit = make_unit(last, build_dispatcher("all_to_all", E, None, capacity=half_capacity(last), mode=mode,
                                            transport=transport, slots=sl), overlap_policy(prio), overlap=True)
    for _ in range(2):  # the second one is kept: warm caches, no autotuning inside
        dist.barrier()  # every rank starts the traced step together (the profiler's start-up differs per rank)
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            for _ in range(a.trace_steps):  # back to back, as the timed loop runs them
                unit.step("on")()
            if cuda:
                torch.cuda.synchronize()
    out_path = Path(a.out) if a.out else results_path("overlap", ep=n)
    trace = out_path.with_suffix(".trace.json.gz")  # torch writes it gzipped (Perfetto and chrome://tracing read it)
    if rank == 0 or a.trace_all_ranks:
        mine = trace if rank == 0 else out_path.with_suffix(f".trace.rank{rank}.json.gz")
        mine.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(mine))
    if rank == 0:
        print(f"EP={n} on {dev.type}; {peak['what']}: {busbw:.1f} GB/s")
        print_table(rows, ["case", "impl", "value", "unit", "baseline_value", "ratio", "hidden_comm_share"])
        path = save_results("bench_overlap", rows, peak, path=out_path, ranks=n, tokens_per_rank=a.tokens,
                            hidden=a.hidden, inter=a.inter, topk=a.topk, experts=E, grouped_gemm=a.gemm,
                            bind_cpus=a.bind_cpus, units=kinds, blocks=n_blocks,
                            seqs=a.seqs, transports=transports,
                            side_stream_priorities=prios, copy_engine_slots=slots,
                            trace=trace.name, **({"timelines": timelines} if timelines else {}))
        print(f"wrote {path} and {trace}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
