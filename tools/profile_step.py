"""Where a training step's time goes, FP8 vs BF16 recipe: builds the model of a Hydra config
(random tokens, no data needed; --data: the config's data, real tokens), times whole steps
(train.grad_accum micro-batches forward + backward, gradient reduction, optimizer: the training loop's
order; tokens/s counts every micro-batch) and prints, per
recipe, the kernels that took the most device time per step, grouped by name. On one process: EP=1, `local` dispatch. Under torchrun:
the config's dispatch (its backend and dispatch.ep_size), the data-parallel gradient buckets of
the training loop (moefp8.grad_sync), every rank its own tokens; figures per GPU and for all,
the kernel table from rank 0.

    python tools/profile_step.py experiment=small_gpu
    python tools/profile_step.py experiment=small_gpu model.hidden=2048 model.moe_inter=1024 --top 30
    torchrun --standalone --nproc_per_node 4 tools/profile_step.py experiment=v2_lite_ep4
    python tools/profile_step.py experiment=v2_lite_ep4 dispatch=local dispatch.ep_size=1 model.n_experts=16 \
        dispatch.shared_overlap=false train.cuda_graphs=true train.cuda_graphs_mlp=true   # one EP4 rank's compute, one GPU
    python tools/profile_step.py model=tiny train.device=cpu --steps 2    # CPU smoke run

Every argument that is not an option is a Hydra override for both recipes. The step time is the
median over --steps steps after --warmup (Triton compiles and tunes in the warm-up); the table
comes from a torch.profiler trace of --profile-steps further steps; its kernels are also summed by
kind (GEMMs, all-to-all, all-reduce, attention, FP8 quantization + SwiGLU, permute + combine, ...: the
rows' `by_kind`, and the JSON's `kinds`: every recipe side by side, where a step's milliseconds go). Host-boundness: the host's
enqueue time per step (step() returning, before the sync) and the GPU ops (kernels, copies,
memsets) per step; a step whose host time is near its step time waits for Python, not the GPU.
The ATen-launched kernels (ATen's, cuBLAS, cuDNN, NCCL) are also summed by where they were launched
(`scopes`: the record_function range, the autograd node, the op): what "elementwise + copies" is.
The profiled steps' GPU timeline (`timeline`: span, where any kernel runs, where any kernel other
than communication runs, idle) puts a number on it: idle ms are the GPU waiting for the host.
The GPUs' SM clock, power and clock reasons over the timed steps (`gpu_state`, sampled with
nvidia-smi): a step at the power cap runs its tensor work at a lower clock, which kernel times alone
do not say. Speed-of-light beside it: the model's training FLOPs per token x tokens/s against the device's
dense BF16 / FP8 peak (moefp8.launch.peak_flops). Memory: the CUDA peak of the timed steps
beside moefp8.memory's plan for the config. Writes a JSON (rows per recipe, the top kernels)
with --json. Routing: a fresh router sends nearly every token to the same few experts, random tokens
or real (--data: the config's real batches, the same for both recipes): the residual stream of an
untrained model is dominated by the attention's average over the context, which every token shares
(bench/notes/scale.md, session 43). At EP the rank holding those experts paces the step and may run
out of memory. A trained router is near balance (max/mean 1.2-1.9 after ~500 steps): time that with
`model.force_balanced_routing=true` (random router logits, the same compute; the benches of record).
The last step's expert load, max over mean per layer, is printed and saved beside (`routing`), and its loss
and gradient norm (`loss`, `grad_norm`, `numerics_ok`): a non-finite one is said under its round and the run
exits 1 after writing its JSON (broken math can run faster: a run whose copies were wrong collapsed its routing and
read +6%, bench/notes/scale.md session 63). --host-profile: one more
step under cProfile, the host's time by function and by file, and how much of it the host spent
waiting for the GPU at syncs (`sync_wait_ms`; the rest, `host_busy_ms`, is its own work: a host
that paces the step is busy, not waiting). --vary KEY=V1,V2 --rounds N: an
interleaved sweep (every other round in reverse order), medians and ratios in the JSON's `summary`. dispatch.overlap=auto runs its trial
steps first, as training does (moefp8.overlap_auto), then times the schedule it kept (the JSON's
`overlap_auto`: the choice and both medians): `--vary dispatch.overlap=false,true,auto`.
--soak N (default 1 on a GPU): N runs of the first variant and recipe before any is timed, not
counted: the first run of a process measured ~2% slow in every record of session 55 (3B FP8 307.9-309.8
ms against 301.3-303.9 in the rounds after it, BF16 and the small preset alike), which without a soak
fell on whichever recipe ran first.
"""

import argparse
import contextlib
import cProfile
import gc
import math
import os
import pstats
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moefp8.build import build_model, cuda_graphs, grad_buckets, norm_split, open_data, overlap_auto  # noqa: E402
from moefp8.hydra_config import compose_config  # noqa: E402
from moefp8.model import flops_per_token, param_counts  # noqa: E402
from moefp8.grad_sync import reduced_grad_norm  # noqa: E402
from moefp8.accum import armed, to_grad, zero  # noqa: E402
from moefp8.graphs import keeps_grads, prepare_grads  # noqa: E402
from moefp8.optim import AdamW, clip_scale  # noqa: E402
from moefp8.testing import GpuSampler, save_results  # noqa: E402
from moefp8.launch import peak_flops, resolve_device  # noqa: E402
from moefp8.memory import plan  # noqa: E402
from moefp8.parallel import Parallel  # noqa: E402
from moefp8.router import load_stats  # noqa: E402


def build(cfg, device: torch.device, par: Parallel | None, say=print):
    """The model, its optimizer and (under torchrun) its gradient buckets, as the training loop
    builds them (moefp8.build); one process: EP=1, `local` dispatch. say: what the build tells
    (recipe.gemm=auto's choice)."""
    model = build_model(cfg, par, device, say)
    cuda_graphs(cfg, model, device, say)
    opt = AdamW(model.named_parameters(), cfg.optim)
    return model, opt, grad_buckets(cfg, par, model, opt)


def step_fn(cfg, model, opt, grads, device, par=None, loader=None):
    """One training step as a function: train.grad_accum micro-batches forward and backward, as the
    training loop runs them, then the update. loader: the data's (`--data`: a new batch of real tokens
    every micro-batch, read as the training loop reads them); None: one batch of random tokens, the
    same every micro-batch."""
    t = cfg.train
    gen = torch.Generator(device="cpu").manual_seed(t.seed + (par.rank if par else 0))  # every rank its own tokens
    replicated, sharded = norm_split(par, model, opt)
    ep_group = par.ep_group if par else None
    x = torch.randint(0, cfg.model.vocab_size, (t.micro_batch, t.seq_len + 1), generator=gen).to(device)
    fixed = (x[:, :-1], x[:, 1:])
    n = t.grad_accum
    keep = keeps_grads(model, grads, n)  # graphed blocks on one process: the loop's zeroed .grad first
    main_grads = armed(model)  # the loop's: the experts' sums inside their GEMMs (moefp8.accum)

    def step() -> None:
        model.dispatcher.flush_checks()  # the previous step's deferred input checks (the loop's, after its sync)
        if keep:
            prepare_grads(model)
        zero(main_grads)
        model.row_cap.on = True  # dispatch.rows_factor: the loop's capped layouts (it checks their flags; see below)
        load_LE = None
        for i in range(n):
            if grads is not None:
                grads.arm(last=i == n - 1)
            inp, tgt = fixed if loader is None else (t_.to(device, non_blocking=True) for t_ in loader.next())
            out = model(inp, tgt)
            ((out.out + out.aux_loss) / n).backward()
            load_LE = out.load_LE if load_LE is None else load_LE + out.load_LE
            loss = out.out.detach()
            del out  # (the loop's order: this micro-batch's autograd graph gone before the next forward)
        to_grad(main_grads)
        model.row_cap.on = False
        step.load_LE = load_LE  # (the last step's, summed over ranks: how even the routing was)
        over = model.row_cap.take()  # dispatch.rows_factor: capped layouts that were too small (the loop would redo)
        if over is not None:
            step.overflowed = over if step.overflowed is None else step.overflowed + over
        # the training loop's update: the mean over ranks and the clipping ride on the optimizer's read
        mean = grads.grad_scale if grads is not None else 1.0
        norm = reduced_grad_norm(grads, replicated, sharded, ep_group)
        if grads is not None:
            torch.distributed.all_reduce(load_LE)
        step.last = (loss, norm)  # (read after the timed steps: a speed of broken numerics is none)
        opt.step(cfg.optim.lr, grad_scale=clip_scale(norm, cfg.optim.grad_clip, mean))
        grads.zero_grad() if grads is not None else opt.zero_grad()
        for router, load_E in zip(model.routers(), load_LE):
            router.update_bias(load_E)
    step.overflowed = None
    return step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# What each kernel of the table is, by its name (first match wins): where a step's milliseconds go,
# FP8 beside BF16 (the JSON's `by_kind`). Names as torch.profiler reports them on H100/H200: NCCL's,
# DeepEP's, cuBLAS (nvjet, cutlass, xmma), cuDNN's attention, moefp8's Triton kernels, ATen's.
KINDS = (
    ("all-to-all", r"SendRecv|AllToAll|deep_ep|intranode|notify_dispatch|Memcpy PtoP|_pack_capacity"),
    ("all-reduce", r"AllReduce|ReduceScatter|AllGather|Broadcast"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|_mgrouped|_kgrouped|wgmma_gemm|aten::mm|aten::addmm|aten::bmm|_scaled_mm|"
             r"_grouped_mm"),
    ("attention", r"sdpa|flash|fmha|attention|_rope"),
    ("optimizer", r"adamw|adam|multi_tensor"),  # before quant: _adamw_quant_kernel refreshes the FP8 weights
    ("fp8 quant + swiglu", r"quant|swiglu|_transpose_kernel"),
    ("permute + combine", r"permute|_combine|_layout|gather|scatter"),
    ("norm", r"norm|GammaBeta|_rms_"),
    ("loss", r"xent|cross_entropy|log_softmax|nll"),
    ("elementwise + copies", r"elementwise|Memcpy|Memset|CatArray|copy|fill|aten::"),
)


def kernel_kind(name: str) -> str:
    """The KINDS entry a kernel's name falls in, else "other"."""
    return next((kind for kind, pat in KINDS if re.search(pat, name, re.IGNORECASE)), "other")


def by_kind(rows: list[dict]) -> dict[str, float]:
    """ms per step by kind over every kernel row (not only the printed top), largest first."""
    out: dict[str, float] = {}
    for r in rows:
        k = kernel_kind(r["kernel"])
        out[k] = out.get(k, 0.0) + r["ms_per_step"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """The time (in the intervals' unit) covered by at least one of the [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def idle_before(kernels: list[tuple[str, float, float]]) -> dict[str, list[float]]:
    """The GPU's idle gaps (no kernel running), each charged to the kernel that ends it: {name: [us of
    idle, gaps]}. The kernel after a gap is the one the GPU waited for the host to launch."""
    out: dict[str, list[float]] = {}
    reach = None
    for name, a, b in sorted(kernels, key=lambda k: k[1]):
        if reach is not None and a > reach:
            acc = out.setdefault(name, [0.0, 0])
            acc[0] += a - reach
            acc[1] += 1
        reach = b if reach is None else max(reach, b)
    return out


def timeline(kernels: list[tuple[str, float, float]], steps: int, top: int = 10) -> dict | None:
    """The profiled steps' GPU timeline from its kernels (name, start us, end us), per step in ms:
    `span_ms` from the first kernel's start to the last one's end, `busy_ms` where any kernel runs,
    `compute_busy_ms` where any kernel other than communication runs (NCCL, DeepEP: their kernels
    also count while they wait for peers), `idle_ms` = span - busy: the GPU waiting for the host
    (launches, syncs); `idle_before`: the `top` kernels the GPU waited longest for (idle ms per step
    before them, gaps per step). None without kernels (CPU)."""
    if not kernels:
        return None
    span = max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)
    gaps = idle_before(kernels)
    idle = sum(us for us, _ in gaps.values())
    compute = busy_ms([(s, e) for n, s, e in kernels if kernel_kind(n) not in ("all-to-all", "all-reduce")])
    per = 1e3 * steps
    waits = sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top]
    return {"span_ms": span / per, "busy_ms": (span - idle) / per, "compute_busy_ms": compute / per,
            "idle_ms": idle / per,
            "idle_before": [{"kernel": n[:160], "idle_ms": us / per, "gaps_per_step": g / steps} for n, (us, g) in waits]}


AUTOGRAD_NODE = "autograd::engine::evaluate_function: "


def scope_of(e) -> tuple[str, str, str]:
    """Where the ATen op `e` (a profiler event holding kernels) ran: (its innermost record_function
    range, e.g. "bwd_fc1", or "-"; the autograd node it ran for, e.g. "MulBackward0", or "forward";
    the op, the outermost ATen call around it first: "aten::contiguous > aten::copy_")."""
    ops, ann, node, p = [e.name], None, None, e.cpu_parent
    while p is not None and node is None:  # up to the autograd node (the backward's ops) or the root
        if p.name.startswith(AUTOGRAD_NODE):
            node = p.name[len(AUTOGRAD_NODE):]
        elif "::" not in p.name:  # a record_function range (ATen ops and autograd nodes are "x::y")
            ann = ann or p.name
        elif p.name.startswith("aten::") and ann is None:
            ops.insert(0, p.name)
        p = p.cpu_parent
    return ann or "-", node or "forward", " > ".join(dict.fromkeys([ops[0], ops[-1]]))


def by_scope(events, steps: int, top: int) -> list[dict]:
    """The GPU time of ATen-launched kernels (ATen's own, cuBLAS, cuDNN, c10d's NCCL) by where they
    were launched (`scope_of`) and kind: what the "elementwise + copies" of the kinds table are.
    Triton kernels launched from Python have no ATen op: they are not here (the kernel table has
    them by name). ms and calls per step, largest first."""
    acc: dict[tuple, list[float]] = {}
    for e in events:
        for k in getattr(e, "kernels", None) or ():
            a = acc.setdefault((*scope_of(e), kernel_kind(k.name)), [0.0, 0])
            a[0] += k.duration
            a[1] += 1
    rows = [{"scope": s, "autograd": n, "op": o, "kind": kind, "ms_per_step": us / 1e3 / steps,
             "calls_per_step": c / steps} for (s, n, o, kind), (us, c) in acc.items()]
    return sorted(rows, key=lambda r: -r["ms_per_step"])[:top]


SYNCS = re.compile(r"(?:method '|built-in method (?:torch\._C\.)?)(tolist|item|cpu|_cuda_synchronize|synchronize|"
                   r"_local_scalar_dense)\b")  # cProfile's names of C functions


def host_profile(step, device: torch.device, top: int) -> dict:
    """One step under cProfile: where the host's time goes, by function (self time) and by source
    file; the step's host time under the profiler beside (cProfile slows Python, not the GPU). On
    Python >= 3.12 cProfile sees every thread (sys.monitoring), the autograd engine's backward thread
    on CUDA included; on older Pythons only the caller's."""
    sync(device)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    step()
    prof.disable()
    host = time.perf_counter() - t0
    sync(device)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (prim calls, calls, self s, cumulative s, callers)
    by_file: dict[str, float] = {}
    for (file, _, name), (_, _, tt, _, _) in stats.items():
        key = name if file == "~" else "/".join(Path(file).parts[-2:])  # "~": builtins and C functions
        by_file[key] = by_file.get(key, 0.0) + tt
    fns = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    # the host's waits for the GPU: the self time of the calls that block on it (the MoE layers' count
    # read-backs, `.item()`, synchronizations); the rest of the step's host time is the host's own work
    wait = sum(tt for (file, _, name), (_, _, tt, _, _) in stats.items() if file == "~" and SYNCS.search(name))
    return {"host_ms": host * 1e3, "sync_wait_ms": wait * 1e3, "host_busy_ms": (host - wait) * 1e3,
            "functions": [{"function": f"{'/'.join(Path(f).parts[-2:])}:{line} {name}", "self_ms": tt * 1e3,
                           "cum_ms": ct * 1e3, "calls": nc} for (f, line, name), (_, nc, tt, ct, _) in fns],
            "files": [{"file": k, "self_ms": v * 1e3} for k, v in sorted(by_file.items(), key=lambda kv: -kv[1])[:top]]}


def site(frames: list[dict]) -> str:
    """The innermost frame of moefp8 (its kernels, dispatch, tools) in an allocation's stack."""
    for f in frames:  # innermost first
        fn = f["filename"]
        if any(k in fn for k in ("/moefp8/", "/kernels/", "/dispatch/", "/tools/")):
            return f"{'/'.join(Path(fn).parts[-2:])}:{f['line']} {f['name']}"
    return "(outside moefp8)"


def live_at_peak(trace: list[dict]) -> tuple[int, dict[str, list[int]]]:
    """Replays an allocator trace (torch.cuda.memory._snapshot()["device_traces"][i]): -> (the peak
    of the bytes it allocated and had not freed, {site: [bytes, blocks] live at that peak})."""
    live, cur, peak, at_peak = {}, 0, 0, {}
    for ev in trace:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])["size"]
    by_site: dict[str, list[int]] = {}
    for ev in at_peak.values():
        e = by_site.setdefault(site(ev.get("frames", [])), [0, 0])
        e[0] += ev["size"]
        e[1] += 1
    return peak, by_site


def memory_profile(step, device: torch.device, top: int) -> dict:
    """One more step under the CUDA caching allocator's history (torch.cuda.memory): its peak of
    allocated bytes, what was allocated before it (weights, optimizer state, persistent buffers),
    and the blocks live at the peak that the step allocated, summed by the line of moefp8 (its
    kernels, dispatch, tools) that allocated them."""
    sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    step()
    sync(device)
    snap = torch.cuda.memory._snapshot(device)
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, by_site = live_at_peak(snap["device_traces"][device.index or 0])
    rows = sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]
    return {"before_step_gib": base / 2**30, "step_peak_gib": (base + peak) / 2**30,
            "step_live_at_peak_gib": peak / 2**30,
            "sites": [{"site": k, "gib": b / 2**30, "blocks": n} for k, (b, n) in rows]}


def measure(overrides: list[str], recipe: str, args, par_box: list, profile_steps: int) -> dict:
    cfg = compose_config([*overrides, f"recipe={recipe}"])
    device = resolve_device(cfg.train.device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if world > 1 and not par_box:  # one process group for both recipes (the dispatch config is theirs alike)
        par_box.append(Parallel(cfg, device))
    par = par_box[0] if par_box else None
    torch.manual_seed(cfg.train.seed)
    say = print if par is None or par.rank == 0 else lambda s: None  # rank 0 tells what the build decided
    model, opt, grads = build(cfg, device, par, say)
    loader = open_data(cfg, par or Parallel(cfg, device), say) if args.data else None
    step = step_fn(cfg, model, opt, grads, device, par, loader)
    auto = overlap_auto(cfg, par, model, say)
    while auto is not None and auto.choice is None:  # dispatch.overlap=auto: its trial steps, as in training
        t0 = time.perf_counter()
        auto.begin_step()
        step()
        sync(device)
        auto.end_step(time.perf_counter() - t0)
    for _ in range(args.warmup):
        step()
    sync(device)
    warm_over, step.overflowed = step.overflowed, None  # dispatch.rows_factor: the timed steps' own count below
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, host = [], []
    # the GPUs' clocks, power and clock reasons over the timed steps (rank 0 samples its node's GPUs): a recipe that runs at
    # the power cap runs its tensor work at a lower SM clock, which the kernels' times alone do not say
    # (where nvidia-smi is missing, e.g. on CPU, the sampler reads nothing: {})
    sampler = GpuSampler() if par is None or par.rank == 0 else contextlib.nullcontext()
    with sampler:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            host.append(time.perf_counter() - t0)  # the host's enqueue time (it blocks only at syncs inside the step)
            sync(device)
            times.append(time.perf_counter() - t0)
    gpu_state = getattr(sampler, "summary", {})
    loss, grad_norm = (float(torch.as_tensor(v)) for v in step.last)  # the last timed step's
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    peak_mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    loads = [load_stats(load_E) for load_E in step.load_LE.cpu()]  # random tokens route unevenly: shown beside
    balance = {"load_max_over_mean": statistics.mean(r["load_max_over_mean"] for r in loads) if loads else 0.0,
               "experts_empty": sum(r["experts_empty"] for r in loads),
               # dispatch.rows_factor: this rank's capped layouts that overflowed in the timed steps (the loop runs
               # such steps again), and in the warm-up (and dispatch.overlap=auto's trials: a fresh router's skew)
               "rows_overflowed": int(step.overflowed) if step.overflowed is not None else None,
               "rows_overflowed_warmup": int(warm_over) if warm_over is not None else None}
    host_top = host_profile(step, device, args.top) if args.host_profile else None
    memory = memory_profile(step, device, args.top) if args.memory and device.type == "cuda" else None
    dev = "cuda" if device.type == "cuda" else "cpu"
    rows, launches, events, gpu_timeline, scopes = [], 0, [], None, []
    if profile_steps:
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(profile_steps):
                step()
            sync(device)
        events = prof.key_averages()
        try:  # the profiler's events API differs between torch versions: without it, neither table (said)
            evs = prof.events()
            gpu = [(e.name, e.time_range.start, e.time_range.end) for e in evs
                   if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
            scopes = by_scope(evs, profile_steps, args.top) if dev == "cuda" else []
        except AttributeError as err:
            print(f"profile_step: no GPU timeline or kernels by scope: this torch's profiler events lack {err}")
            gpu = []
        gpu_timeline = timeline(gpu, profile_steps, args.top)
    for e in events:
        on_gpu = e.device_type == torch.autograd.DeviceType.CUDA
        annotation = getattr(e, "is_user_annotation", False)  # record_function ranges (on the GPU too): not kernels
        if dev == "cuda" and on_gpu and not annotation:
            launches += e.count
        us = getattr(e, f"self_{dev}_time_total", 0) or (e.self_device_time_total if dev == "cuda" else 0)
        if us > 0 and not annotation and (dev == "cpu" or on_gpu):
            rows.append({"kernel": e.key[:160], "ms_per_step": us / 1e3 / profile_steps,
                         "calls_per_step": e.count / profile_steps})
    rows.sort(key=lambda r: -r["ms_per_step"])
    step_s = statistics.median(times)
    if par is not None:  # the slowest rank's median sets the pace
        t_ = torch.tensor([step_s], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t_, op=torch.distributed.ReduceOp.MAX)
        step_s = t_.item()
    tokens = cfg.train.micro_batch * cfg.train.seq_len * cfg.train.grad_accum  # per GPU and step
    peak = peak_flops(cfg, device)
    tflops = flops_per_token(cfg.model, cfg.train.seq_len) * tokens / step_s / 1e12  # per GPU
    if grads is not None:
        grads.remove()  # its hooks hold it, and it the parameters: a cycle
    gemm_lib = model.gemm.mgrouped_lib  # recipe.gemm=auto: the library it chose
    auto_row = None if auto is None else {"choice": auto.choice,
                                          "median_ms": {k: v * 1e3 for k, v in auto.medians.items()}}
    del model, opt, grads, step, auto
    gc.collect()  # the next recipe's measure must not find this one's model still allocated
    if device.type == "cuda":
        torch.cuda.empty_cache()
    pl = plan(cfg, world)
    return {"recipe": recipe, "step_ms": step_s * 1e3, "host_ms": statistics.median(host) * 1e3,
            "gpu_ops_per_step": launches / profile_steps if profile_steps else None, "tokens_per_s": tokens / step_s, "tflops": tflops,
            "world": world, "ep_size": cfg.dispatch.ep_size if world > 1 else 1,
            "tokens_per_s_all": tokens * world / step_s,
            "peak_tflops": peak / 1e12 if peak else None, "kernels_ms_per_step": sum(r["ms_per_step"] for r in rows),
            "peak_mem_gib": peak_mem / 2**30 if peak_mem is not None else None, "plan_gib": pl["total"] / 2**30,
            "plan": {k: v / 2**30 for k, v in pl.items()},
            "loss": loss, "grad_norm": grad_norm, "numerics_ok": math.isfinite(loss) and math.isfinite(grad_norm),
            "gemm_lib": gemm_lib, "overlap_auto": auto_row, "gpu_state": gpu_state, "tokens": "data" if args.data else "random", "routing": balance, "by_kind": by_kind(rows), "timeline": gpu_timeline, "scopes": scopes, "top": rows[:args.top], "host_top": host_top, "memory": memory, "device": str(device), "params": param_counts(cfg.model)}


def report(r: dict) -> None:
    sol = f" of {r['peak_tflops']:.0f} peak ({r['tflops'] / r['peak_tflops']:.1%})" if r["peak_tflops"] else ""
    mem = f"; memory peak {r['peak_mem_gib']:.1f} GiB (plan {r['plan_gib']:.1f})" if r["peak_mem_gib"] else ""
    every = f" per GPU, {r['tokens_per_s_all']:,.0f} on {r['world']} (EP {r['ep_size']})" if r["world"] > 1 else ""
    ops = f", {r['gpu_ops_per_step']:.0f} GPU ops/step" if r["gpu_ops_per_step"] else ""
    print(f"\n{r['recipe']}{r['variant'] and ' ' + r['variant']}, round {r['round']}: step {r['step_ms']:.1f} ms, "
          f"{r['tokens_per_s']:,.0f} tokens/s{every}, {r['tflops']:.1f} TFLOP/s{sol}; kernels "
          f"{r['kernels_ms_per_step']:.1f} ms/step, host enqueue {r['host_ms']:.1f} ms/step{ops}{mem}; routing: "
          f"max/mean expert load {r['routing']['load_max_over_mean']:.2f} (layer mean), "
          f"{r['routing']['experts_empty']} empty experts"
          + (f"; {r['routing']['rows_overflowed']} capped layouts overflowed (dispatch.rows_factor: the training loop "
             f"would have run those steps again)" if r['routing'].get('rows_overflowed') else "")
          + (f"; {r['routing']['rows_overflowed_warmup']} in the warm-up" if r['routing'].get('rows_overflowed_warmup')
             else ""))
    print(f"  last timed step: loss {r['loss']:.4f}, grad norm {r['grad_norm']:.4g}")
    for gpu, g in (r.get("gpu_state") or {}).items():
        print(f"  GPU {gpu} over the timed steps: SM clock {g['sm_mhz_median']:.0f} MHz median (min {g['sm_mhz_min']:.0f}), "
              f"power {g['power_w_median']:.0f} W median (max {g['power_w_max']:.0f}), {g['temp_c_max']:.0f} C max, "
              f"clock reasons: {', '.join(g['clock_reasons']) or 'none'} ({g['samples']} samples)")
    if not r["numerics_ok"]:
        print("  NUMERICS BROKEN: a non-finite loss or gradient norm; this step's speed is not a measurement "
              "(broken math can run faster: collapsed routing, skipped work)")
    if r.get("timeline"):
        t = r["timeline"]
        print(f"  GPU timeline, ms/step: span {t['span_ms']:.1f}, a kernel running {t['busy_ms']:.1f}, a kernel other "
              f"than communication {t['compute_busy_ms']:.1f}, idle (waiting for the host) {t['idle_ms']:.1f}; "
              "idle before: " + ", ".join(f"{w['kernel'][:48]} {w['idle_ms']:.2f} ms ({w['gaps_per_step']:.0f})"
                                          for w in t["idle_before"][:8]))
    if r.get("by_kind"):
        print("  by kind, ms/step: " + ", ".join(f"{k} {v:.1f}" for k, v in r["by_kind"].items()))
    if r.get("scopes"):
        print(f"  ATen-launched kernels by where they ran:\n  {'ms/step':>8} {'calls':>6}  {'kind':<21} "
              "record_function | autograd node | op")
        for k in r["scopes"]:
            print(f"  {k['ms_per_step']:8.3f} {k['calls_per_step']:6.0f}  {k['kind']:<21} {k['scope']} | "
                  f"{k['autograd']} | {k['op']}")
    if r["top"]:
        print(f"  {'ms/step':>8} {'calls':>6}  kernel")
    for k in r["top"]:
        print(f"  {k['ms_per_step']:8.3f} {k['calls_per_step']:6.0f}  {k['kernel']}")
    if r["host_top"]:
        h = r["host_top"]
        print(f"  host, one step under cProfile: {h['host_ms']:.1f} ms, of which waiting for the GPU at syncs "
              f"{h['sync_wait_ms']:.1f} ms (busy {h['host_busy_ms']:.1f}); by file (self ms): "
              + ", ".join(f"{f['file']} {f['self_ms']:.1f}" for f in h["files"][:12]))
        print(f"  {'self ms':>8} {'cum ms':>8} {'calls':>6}  function")
        for f in h["functions"]:
            print(f"  {f['self_ms']:8.2f} {f['cum_ms']:8.2f} {f['calls']:6d}  {f['function']}")
    if r.get("memory"):
        m = r["memory"]
        print(f"  memory, one step: before it {m['before_step_gib']:.1f} GiB, peak {m['step_peak_gib']:.1f} GiB "
              f"({m['step_live_at_peak_gib']:.1f} GiB allocated by the step and live there), by site:")
        for e in m["sites"]:
            print(f"  {e['gib']:8.2f} GiB {e['blocks']:6d} blocks  {e['site']}")


def summarize(res: list[dict]) -> list[dict]:
    """Per (recipe, variant): the median over rounds; the ratios FP8/BF16 per variant and each
    variant over the first per recipe; where the GPUs were sampled, the median over rounds of the
    rows' SM clock and power (each row's mean over its GPUs): a variant that runs cooler reads faster."""
    keys = list(dict.fromkeys((r["recipe"], r["variant"]) for r in res))
    med = {k: statistics.median(r["tokens_per_s"] for r in res if (r["recipe"], r["variant"]) == k) for k in keys}
    out = []
    for (recipe, variant), tps in med.items():
        row = {"recipe": recipe, "variant": variant, "rounds": sum((r["recipe"], r["variant"]) == (recipe, variant)
                                                                    for r in res), "median_tokens_per_s": tps}
        gpus = [list(r["gpu_state"].values()) for r in res
                if (r["recipe"], r["variant"]) == (recipe, variant) and r.get("gpu_state")]
        if gpus:
            row["sm_mhz"] = statistics.median(statistics.mean(g["sm_mhz_median"] for g in gs) for gs in gpus)
            row["power_w"] = statistics.median(statistics.mean(g["power_w_median"] for g in gs) for gs in gpus)
        if recipe != "bf16" and ("bf16", variant) in med:
            row["over_bf16"] = tps / med[("bf16", variant)]
        first = next(v for r_, v in keys if r_ == recipe)
        if variant != first:
            row[f"over_{first}"] = tps / med[(recipe, first)]
        out.append(row)
    return out


def kinds_side_by_side(res: list[dict]) -> list[dict]:
    """Per variant, from its profiled (first-round) rows: each kind's ms per step for every recipe,
    the GPU timeline's busy and idle ms where the profile had kernels (`timeline`), and the step time
    beside (a kernel on a side stream overlaps others: the kinds may sum past it)."""
    out = []
    for variant in dict.fromkeys(r["variant"] for r in res):
        rows = {r["recipe"]: r for r in res if r["variant"] == variant and r["round"] == 0 and r.get("by_kind")}
        if not rows:
            continue
        kinds = list(dict.fromkeys(k for r in rows.values() for k in r["by_kind"]))
        lines = {"GPU busy (any kernel)": "busy_ms", "GPU idle (waits for host)": "idle_ms"}
        timed = all(r.get("timeline") for r in rows.values())
        for k in [*kinds, "all kernels", *(lines if timed else ()), "step"]:
            row = {"variant": variant, "kind": k}
            for recipe, r in rows.items():
                row[recipe] = (r["by_kind"].get(k, 0.0) if k in kinds else
                               r["kernels_ms_per_step"] if k == "all kernels" else
                               r["timeline"][lines[k]] if k in lines else r["step_ms"])
            out.append(row)
    return out


def print_kinds(table: list[dict]) -> None:
    if not table:
        return
    recipes = [k for k in table[0] if k not in ("variant", "kind")]
    delta = recipes[:2] == ["bf16", "fp8"]
    for variant in dict.fromkeys(r["variant"] for r in table):
        print(f"\nwhere a step's ms go{variant and ' (' + variant + ')'}: " + " / ".join(recipes)
              + (" (bf16 - fp8)" if delta else ""))
        for r in (r for r in table if r["variant"] == variant):
            cells = " / ".join(f"{r[x]:7.1f}" for x in recipes)
            print(f"  {r['kind']:<26} {cells}" + (f"  ({r['bf16'] - r['fp8']:+7.1f})" if delta else ""))


def save(path: str, res: list[dict], overrides: list[str], complete: bool) -> None:
    save_results("profile_step", res, {r["recipe"]: r["peak_tflops"] for r in res}, path=Path(path),
                 overrides=overrides, summary=summarize(res), kinds=kinds_side_by_side(res), complete=complete)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default="bf16,fp8")
    p.add_argument("--vary", default="", help="KEY=V1,V2,...: one override more per variant, e.g. "
                   "dispatch.overlap=false,true (every recipe, every round; ratios to the first)")
    p.add_argument("--rounds", type=int, default=1, help="repeat the (variant, recipe) sweep, interleaved; "
                   "the kernel table comes from the first round")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--soak", type=int, default=None, help="runs of the first variant and recipe before the "
                   "timed ones, not counted (default: 1 on a GPU, 0 on CPU)")
    p.add_argument("--host-profile", action="store_true", help="one more step under cProfile: the host's "
                   "time by Python function and by source file (the host_top table)")
    p.add_argument("--memory", action="store_true", help="one more step under the CUDA allocator's history: "
                   "what is live at its peak, by the moefp8 line that allocated it")
    p.add_argument("--data", action="store_true", help="real tokens: a new batch every step from the config's "
                   "data (data.path, prepared first where it has no index), as training reads it; both recipes "
                   "read the same batches. Default: one batch of random tokens, the same every step")
    p.add_argument("--json", help="write the rows here")
    args, overrides = p.parse_known_args()
    variants = [""]
    if args.vary:
        key, _, values = args.vary.partition("=")
        if not key or not values:
            raise SystemExit(f"profile_step: --vary {args.vary!r}: write KEY=V1,V2 (e.g. dispatch.overlap=false,true)")
        variants = [f"{key}={v}" for v in values.split(",")]
    par_box, res = [], []
    soak = args.soak if args.soak is not None else int(torch.cuda.is_available())
    for _ in range(soak):  # the process's first run reads slow (see above): one not counted
        measure([*overrides, *filter(None, [variants[0]])], args.recipes.split(",")[0], args, par_box, 0)
    for round_ in range(args.rounds):
        for variant in variants[:: 1 if round_ % 2 == 0 else -1]:  # every other round reversed: no variant always last
            for recipe in args.recipes.split(","):
                r = measure([*overrides, *filter(None, [variant])], recipe, args, par_box,
                            args.profile_steps if round_ == 0 else 0)
                res.append({**r, "variant": variant, "round": round_})
                if args.json and not (par_box and par_box[0].rank):  # what is measured so far, complete: false
                    save(args.json, res, overrides, complete=False)
    if par_box and par_box[0].rank != 0:
        torch.distributed.destroy_process_group()
        return
    n = res[0]["params"]
    print(f"overrides: {' '.join(overrides) or '(none)'}; {n['total'] / 1e6:.1f}M parameters, "
          f"{n['active'] / 1e6:.1f}M active")
    for r in res:
        report(r)
    print_kinds(kinds_side_by_side(res))
    print()
    for row in summarize(res):
        ratios = ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k.startswith("over_"))
        gpu = f"; SM {row['sm_mhz']:.0f} MHz, {row['power_w']:.0f} W" if "sm_mhz" in row else ""
        print(f"{row['recipe']}{row['variant'] and ' ' + row['variant']}: {row['median_tokens_per_s']:,.0f} tokens/s "
              f"per GPU (median of {row['rounds']}){ratios and '; ' + ratios}{gpu}")
    if args.json:
        save(args.json, res, overrides, complete=True)
    if par_box:
        torch.distributed.destroy_process_group()
    broken = [f"{r['recipe']}{r['variant'] and ' ' + r['variant']} round {r['round']}" for r in res
              if not r["numerics_ok"]]
    if broken:
        raise SystemExit(f"profile_step: non-finite loss or gradient norm in {', '.join(broken)}: those timings "
                         "measure broken numerics, not the step (fix the code; nothing to compare)")


if __name__ == "__main__":
    main()
