"""One MoE layer, forward + backward, FP8 recipe vs BF16 recipe (docs/design.md §2, §6 JSON).

For DeepSeek-V3-like single-GPU shapes (hidden 7168, expert intermediate 2048, top-8, one shared
expert, 8-32 local experts, 4096-16384 tokens): median step time (weights converted every step:
FP8 quantization or BF16 cast, as with one micro-batch per step), useful TFLOP/s (18*H*I per
routed (token, slot) and per shared expert token; the router's matmul too), peak memory, the
bytes autograd saves for backward (parameters excluded), a per-stage breakdown (torch profiler,
the layer's record_function ranges), and the FP8 output's SQNR against the BF16 recipe's.
Speed-of-light beside the figures: dense BF16 and FP8 per-tensor matmul rates measured in the
same run. Where `megablocks` imports (EP=1), its dropless MoE (dMoE: BF16, grouped GEMMs) is timed
too, on moefp8's router and the same weights (moefp8/megablocks_experts.py), with its SQNR
against moefp8's BF16 recipe: the BF16 MoE a user would pick instead.

    python tools/bench_moe.py                 # saves bench/results/moe-<device>.json
    python tools/bench_moe.py --cases 8x4096  # E x T
    torchrun --nproc_per_node 8 tools/bench_moe.py --cases 32x4096   # EP8: 32 experts and 4096 tokens per rank
                                              # (all_to_all dispatch, capacity mode; bench/results/moe-<device>-ep8.json)
"""

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moefp8.megablocks_experts import load as load_megablocks  # noqa: E402
from moefp8.moe import MoELayer  # noqa: E402
from moefp8.recipe import Recipe  # noqa: E402
from moefp8.testing import bench, print_table, results_path, save_results, saved_bytes, sqnr  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dispatch import init_torchrun, timed  # noqa: E402

STAGES = ["router", "megablocks_weights", "megablocks_dmoe", "quant", "dispatch", "permute", "fc1", "swiglu", "fc2",
          "combine", "shared", "bwd_combine", "bwd_permute", "bwd_fc2", "bwd_swiglu", "bwd_fc1", "bwd_unpermute"]


def matmul_peaks() -> dict:
    """Dense 8192^3 BF16 and FP8 (per-tensor _scaled_mm) TFLOP/s on this device, same run."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    bf16 = 2 * n**3 / bench(lambda: a @ b) / 1e9
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    fp8 = 2 * n**3 / bench(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)) / 1e9
    return {"bf16_dense_tflops": round(bf16, 1), "fp8_dense_tflops": round(fp8, 1)}


def stage_times(step, iters: int = 3) -> dict:
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        if torch.distributed.is_initialized():  # under EP: the profiler's start-up takes each rank a different
            torch.distributed.barrier()  # time (the first one ~1 s), which the first dispatch would absorb
            torch.cuda.synchronize()
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        if ev.key in STAGES:
            t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            out[ev.key] = round(t / iters / 1000, 3)  # ms per step
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--cases", default="8x4096,16x8192,32x16384", help="local experts x tokens (per rank under EP)")
    p.add_argument("--warmup", type=int, default=3, help="EP: fixed warm-up iterations")
    p.add_argument("--iters", type=int, default=10, help="EP: fixed timed iterations (median, max over ranks)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, CPU allowed (tests the EP path on gloo)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        args.hidden, args.inter, args.topk, args.cases, args.warmup, args.iters = 256, 128, 2, "4x64", 1, 2
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        sys.exit("bench_moe needs a CUDA GPU (the CPU path is the reference implementation; --smoke runs tiny shapes)")
    ep = int(os.environ.get("WORLD_SIZE", "1"))
    rank, dev = 0, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if ep > 1:  # expert parallel under torchrun: E local experts per rank, T tokens per rank
        import torch.distributed as dist

        from moefp8.dispatch import build_dispatcher

        rank, ep, dev = init_torchrun()
    H, I, K = args.hidden, args.inter, args.topk
    peaks = matmul_peaks() if cuda else {"bf16_dense_tflops": None, "fp8_dense_tflops": None}
    if rank == 0:
        print(f"speed-of-light on this device: BF16 dense {peaks['bf16_dense_tflops']} TFLOP/s, "
              f"FP8 dense {peaks['fp8_dense_tflops']} TFLOP/s" + (f"; EP{ep}, all_to_all (capacity)" if ep > 1 else ""))
    rows, megablocks = [], load_megablocks() if cuda and ep == 1 else None
    impls = {"fp8": Recipe("fp8"), "bf16": Recipe("bf16")}
    if megablocks is not None:
        impls["megablocks"] = Recipe("bf16", moe_impl="megablocks")
    for case in args.cases.split(","):
        E, T = (int(v) for v in case.split("x"))
        # per rank: its T tokens' routed slots on average (the slots of all ranks spread over the ranks)
        flops = 18 * H * I * T * K + 18 * H * I * T + 6 * H * E * ep * T
        g = torch.Generator(device=dev).manual_seed(rank)
        x = torch.randn(T, H, device=dev, generator=g).bfloat16().requires_grad_()
        dout = torch.randn(T, H, device=dev, generator=g).bfloat16()
        res = {}
        for name, recipe in impls.items():
            torch.manual_seed(0)  # the same weights for every impl; the same router on every rank (its expert slice)
            disp = build_dispatcher("all_to_all", E * ep, None, capacity=T) if ep > 1 else None
            layer = MoELayer(H, I, E * ep, K, n_shared=1, recipe=recipe, dispatcher=disp).to(dev)

            def step():
                layer.cache._store.clear()  # weights change every step: convert them again
                layer.zero_grad(set_to_none=True)
                x.grad = None
                layer(x).out.backward(dout)

            nbytes, out = saved_bytes(lambda: layer(x).out)
            out.backward(dout)
            res[name] = out.detach()
            layer.zero_grad(set_to_none=True)
            peak = None
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            step()
            if cuda:
                torch.cuda.synchronize()
                peak = round((torch.cuda.max_memory_allocated() - base) / 1e9, 2)
            if ep > 1:  # collectives inside: every rank runs the same fixed number of steps
                ms = timed(step, args.warmup, args.iters, dev) * 1e3
            else:
                ms = bench(step, warmup_ms=100, rep_ms=500)
            stages = stage_times(step) if cuda else {}
            rows.append({"case": f"moe fwd+bwd E{E * ep} ({E}/rank) T{T}/rank H{H} I{I} top{K} EP{ep}" if ep > 1
                         else f"moe fwd+bwd E{E} T{T} H{H} I{I} top{K}",
                         "impl": "megablocks dMoE (bf16)" if name == "megablocks" else f"moefp8 {name}",
                         "value": round(flops / ms / 1e9, 1), "unit": "TFLOP/s", "ms": round(ms, 3),
                         "peak_mem_gb": peak, "saved_act_gb": round(nbytes / 1e9, 3), "stages_ms": stages})
            del layer, out
            if cuda:
                torch.cuda.empty_cache()
        case_rows = dict(zip(impls, rows[-len(impls):]))
        bf16_row = case_rows["bf16"]
        for name, r in case_rows.items():
            r.update(baseline="moefp8 bf16 recipe (same run)", baseline_value=bf16_row["value"],
                     ratio=round(bf16_row["ms"] / r["ms"], 3))
            if name != "bf16":
                r["saved_act_vs_bf16"] = round(r["saved_act_gb"] / bf16_row["saved_act_gb"], 3)
                r["sqnr_vs_bf16_db"] = round(sqnr(res[name].float(), res["bf16"].float()), 1)
    if rank == 0:
        path = Path(args.out) if args.out else results_path("moe", ep=ep if ep > 1 else None)
        save_results("bench_moe", rows, {"what": "dense matmul 8192^3 on this device", "value": peaks["fp8_dense_tflops"],
                                         "unit": "TFLOP/s (FP8 per-tensor)", **peaks}, path=path, ranks=ep,
                     megablocks=getattr(megablocks, "__version__", "installed") if megablocks is not None else
                     "not timed (not installed, or EP > 1)")
        for r in rows:
            print(r["case"], r["impl"], "stages (ms):", r.get("stages_ms"))
        print_table(rows, ["case", "impl", "ms", "value", "ratio", "peak_mem_gb", "saved_act_gb", "saved_act_vs_bf16",
                           "sqnr_vs_bf16_db"])
        print(f"speed-of-light: BF16 dense {peaks['bf16_dense_tflops']}, FP8 dense {peaks['fp8_dense_tflops']} TFLOP/s; "
              f"ratio = bf16 time / time. saved {path}")
    if ep > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
