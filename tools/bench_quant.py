"""Quantization kernels' throughput against the device's copy bandwidth (docs/design.md §6 JSON).

Inputs carry the scale layouts the training step gives each kernel (requant_colwise: column-major
"1x128" scales, as the MoE layer's permute writes them; the others' row-major; permute_requant_colwise:
M / 4 tokens routed top-4 of 32 experts, gathered into EP = 1's static row bound). For each kernel
on DeepSeek-V3 shapes: median time (the best of --repeat medians), GB/s counting the bytes each
kernel must read and write once (data and scales), the device-to-device copy bandwidth measured in
the same run (1 GiB: the speed-of-light for a memory-bound kernel) and their ratio, and the ratio
to a copy of the kernel's own byte count; also the PyTorch reference's
time on the same device, and whether the kernel's output equals the reference bit for bit. The
fused pair swiglu_quant_cache also reports the two single kernels it replaces, timed in the same
run (`unfused_ms`).

    python tools/bench_quant.py                       # default shapes, saves bench/results/quant-<device>.json
    python tools/bench_quant.py --sweep               # also times alternative launch configs first
    python tools/bench_quant.py --shapes 4096x7168 --fmts pow2,fp32

Without a GPU it times the PyTorch reference (the CPU path) on small shapes and writes to outputs/.
"""

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from moefp8.fp8 import Fp8Tensor, col_major  # noqa: E402
from moefp8.kernels import permute as P  # noqa: E402
from moefp8.kernels import quant as Q  # noqa: E402
from moefp8.kernels import swiglu as S  # noqa: E402
from moefp8.testing import bench, copy_bandwidth_gbs, print_table, results_path, save_results  # noqa: E402

SWEEP = {
    "rowwise": [dict(BLOCK_M=m, num_warps=w) for m, w in itertools.product((8, 16, 32, 64), (2, 4, 8))],
    "colwise": [dict(BLOCK_K=k, num_warps=w) for k, w in itertools.product((32, 64, 128, 256), (2, 4, 8))],
    "weight": [dict(num_warps=w) for w in (4, 8, 16)],
    "requant_colwise": [dict(BLOCK_K=k, num_warps=4, GROUP_K=8, STAGES=s, PROGS_PER_SM=p, **r)
                        for k, s, p, r in itertools.product((64, 128), (3, 4, 5), (2, 3), ({}, {"maxnreg": 168}))],
    "permute_requant_colwise": [dict(BLOCK_K=k, num_warps=4, GROUP_K=g, STAGES=st, PROGS_PER_SM=p, **r)
                                for k, g, st, p, r in itertools.product((64, 128), (4, 8), (3, 4, 6), (2, 3, 4),
                                                                        ({}, {"maxnreg": 168}))],
    "swiglu_quant": [dict(BLOCK_M=m, num_warps=w) for m, w in itertools.product((8, 16, 32, 64), (2, 4, 8))],
    # strips kernel: (128 / BLOCK_K) * num_warps threads along the rows, at most 32
    "dequant_swiglu_quant_colwise": [dict(BLOCK_K=k, num_warps=w, GROUP_K=g)
                                     for k, w, g in itertools.product((16, 32, 64), (2, 4, 8), (4, 8, 16))
                                     if 128 // k * w <= 32],
    "swiglu_backward_quant": [dict(BLOCK_M=m, num_warps=w) for m, w in itertools.product((8, 16, 32), (2, 4, 8))],
}
LAUNCH_KEY = {"swiglu_quant_cache": "swiglu_quant"}  # kernels sharing another's launch config


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def fp8_bytes(q) -> int:
    return nbytes(q.data, q.scale)


def cases(M: int, K: int, w_shape: tuple, dev: str):
    """name -> (input, triton fn(input, fmt="pow2", launch=None), reference fn(input, fmt), bytes read +
    written); launch: the kernel's launch config for the call (None: Q.LAUNCH's)."""
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    x8 = Q.quant_rowwise_ref(x)
    # the col-wise kernels' input as the MoE backward gives it, with column-major scales:
    # requant_colwise's from permute_fp8(..., colmajor_scale=True), the SwiGLU backward's (h8)
    # from swiglu_quant_cache(..., colmajor_scale=True)
    x8c = Fp8Tensor(x8.data, col_major(x8.scale), "1x128")
    w = torch.randn(*w_shape, device=dev, dtype=torch.float32) * 0.02  # fp32 master weights
    out_row = M * K + M * (K // 128) * 4
    out_col = K * M + K * -(-M // 128) * 4
    half_row = out_row // 2  # a = swiglu(h) has half of h's columns
    half_col = (K // 2) * M + (K // 2) * -(-M // 128) * 4
    da = torch.randn(M, K // 2, device=dev, dtype=torch.bfloat16)
    x8t = Q.quant_rowwise_ref(torch.randn(max(M // 4, 1), K, device=dev, dtype=torch.bfloat16))
    topk = torch.rand(x8t.data.shape[0], 32, device=dev).topk(4, dim=1).indices
    layout = P.build_layout(topk, 32, bound=True)
    return {
        "rowwise": (x, Q.quant_rowwise, Q.quant_rowwise_ref, nbytes(x) + out_row),
        "colwise": (x, Q.quant_colwise, Q.quant_colwise_ref, nbytes(x) + out_col),
        "weight": (w, Q.quant_weight, Q.quant_weight_ref, nbytes(w) + w.numel() + w.numel() // 128**2 * 4),
        "requant_colwise": (x8c, Q.requant_colwise, Q.requant_colwise_ref, fp8_bytes(x8) + out_col),
        "swiglu_quant": (x, Q.swiglu_quant, Q.swiglu_quant_ref, nbytes(x) + half_row),
        "dequant_swiglu_quant_colwise": (x8c, Q.dequant_swiglu_quant_colwise, Q.dequant_swiglu_quant_colwise_ref,
                                         fp8_bytes(x8) + half_col),
        "rowwise_colwise": (x, lambda x, f="pow2", launch=None: Q.quant_rowwise_colwise(x, f),  # its two kernels'
                            Q.quant_rowwise_colwise_ref, nbytes(x) + out_row + out_col),             # configs
        "swiglu_quant_cache": (x, lambda h, f="pow2", launch=None: Q.swiglu_quant_cache(h, f, colmajor_scale=True,
                                                                                         launch=launch),
                               lambda h, f="pow2": Q.swiglu_quant_cache(h, f, "ref", colmajor_scale=True),
                               nbytes(x) + out_row + half_row),
        # the fc1 wgrad's x: M rows gathered from M / 4 tokens' top-4 of 32 experts (EP = 1's static row bound)
        "permute_requant_colwise": ((x8t, layout), lambda i, f="pow2", launch=None: P.permute_requant_colwise(
            *i, f, launch=launch), lambda i, f="pow2": P.permute_requant_colwise_ref(*i, f),
            topk.numel() * (K + K // 128 * 4) + layout.M * K + K * -(-layout.M // 128) * 4),  # rows read, written
        "swiglu_backward_quant": ((x8c, da), lambda i, f="pow2", launch=None: S.swiglu_backward_quant(*i, f,
                                                                                                     launch=launch),
                                  lambda i, f="pow2": S.swiglu_backward_quant(*i, f, "ref"),
                                  fp8_bytes(x8) + nbytes(da) + out_row + out_col),
    }


# what a fused pair replaces: the single kernels, run back to back (L: the launch configs in use)
UNFUSED = {
    "swiglu_quant_cache": lambda h, f, L: (Q.quant_rowwise(h, f, launch=L["rowwise"]),
                                           Q.swiglu_quant(h, f, colmajor_scale=True, launch=L["swiglu_quant"])),
}


def same(a, b) -> bool:
    if not isinstance(a, Fp8Tensor):  # a fused pair's outputs
        return all(same(u, v) for u, v in zip(a, b))
    return torch.equal(a.scale, b.scale) and torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))


def main() -> None:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="16384x7168,16384x4096" if gpu else "1024x1024",
                   help="activation shapes MxK (for swiglu kernels K is h's 2I)")
    p.add_argument("--weight-shapes", default="8x4096x7168,8x7168x2048" if gpu else "2x512x512",
                   help="expert weight stacks ExNxK (fp32), paired with --shapes in order")
    p.add_argument("--fmts", default="pow2", help="scale formats to run: pow2,fp32")
    p.add_argument("--sweep", action="store_true", help="time alternative launch configs, keep the fastest")
    p.add_argument("--only", default=None, help="comma-separated kernels to run (default: all)")
    p.add_argument("--repeat", type=int, default=3 if gpu else 1,
                   help="medians taken per kernel; the best is reported, all are saved (ms_runs): a reading can "
                        "land in one of the device's slow stretches (bench/notes/quant.md, session 13)")
    p.add_argument("--out", default=None, help="results JSON (default bench/results/quant-<device>.json)")
    args = p.parse_args()
    dev = "cuda" if gpu else "cpu"
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    w_shapes = [tuple(int(v) for v in s.split("x")) for s in args.weight_shapes.split(",")]
    fmts = args.fmts.split(",")
    only = set(args.only.split(",")) if args.only else None
    repeat = max(args.repeat, 1)

    copy_gbs = copy_bandwidth_gbs(1 << 30 if gpu else 1 << 26, repeat=repeat)
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s (bytes read + written)")

    launch = dict(Q.LAUNCH)  # the configs timed below: the library's, or with --sweep the fastest found
    sweep_log = []
    if args.sweep and gpu:
        for name, configs in SWEEP.items():
            if only and name not in only:
                continue
            best = None
            for cfg in configs:
                total_ms = 0.0
                for (M, K), ws in zip(shapes, w_shapes):
                    inp, fn, _, _ = cases(M, K, ws, dev)[name]
                    total_ms += bench(lambda: fn(inp, launch=cfg))
                sweep_log.append({"kernel": name, "config": cfg, "ms_all_shapes": total_ms})
                if best is None or total_ms < best[0]:
                    best = (total_ms, cfg)
            launch[name] = best[1]
            print(f"sweep {name}: best {best[1]} ({best[0]:.3f} ms over all shapes)")
            torch.cuda.empty_cache()

    rows = []
    for fmt in fmts:
        for (M, K), ws in zip(shapes, w_shapes):
            for name, (inp, fn, ref, nb) in cases(M, K, ws, dev).items():
                if only and name not in only:
                    continue
                cfg = launch.get(LAUNCH_KEY.get(name, name))
                runs = [bench(lambda: fn(inp, fmt, launch=cfg)) for _ in range(repeat)]
                ms = min(runs)
                ref_ms = bench(lambda: ref(inp, fmt))
                gbs = nb / ms / 1e6
                # a copy moving the same bytes (nb / 2 read + nb / 2 written): the speed of light at this size,
                # where launch and tail cost more per byte than in the 1 GiB copy of the headline ratio
                copy_same = copy_bandwidth_gbs(nb // 2, repeat=repeat)
                shape = "x".join(map(str, ws)) if name == "weight" else f"{M}x{K}"
                rows.append({
                    "case": f"{name} {shape} {fmt}", "impl": "moefp8 triton" if gpu else "moefp8 reference (cpu)",
                    "value": round(gbs, 1), "unit": "GB/s", "ms": round(ms, 4),
                    "baseline": "device copy (same run)", "baseline_value": round(copy_gbs, 1),
                    "ratio": float(f"{gbs / copy_gbs:.3g}"), "ms_runs": [round(t, 4) for t in runs],
                    "copy_same_bytes_gbs": round(copy_same, 1), "ratio_vs_same_bytes_copy": float(f"{gbs / copy_same:.3g}"),
                    "ref_ms": round(ref_ms, 4), "speedup_vs_ref": round(ref_ms / ms, 2),
                    "bit_exact_vs_ref": same(fn(inp, fmt, launch=cfg), ref(inp, fmt)),
                    "config": dict(cfg or {}),
                })
                if name in UNFUSED:
                    rows[-1]["unfused_ms"] = round(bench(lambda: UNFUSED[name](inp, fmt, launch)), 4)
                torch.cuda.empty_cache() if gpu else None
    path = Path(args.out) if args.out else results_path("quant")
    save_results("bench_quant", rows, {"what": "device-to-device copy (read + write)", "value": round(copy_gbs, 1),
                                       "unit": "GB/s"}, path=path, launch=launch, sweep=sweep_log)
    print_table(rows, ["case", "ms", "value", "ratio", "ratio_vs_same_bytes_copy", "unfused_ms", "ref_ms",
                       "speedup_vs_ref", "bit_exact_vs_ref"])
    print(f"speed-of-light: copy {copy_gbs:.0f} GB/s; ratio = kernel GB/s / copy GB/s (ratio_vs_same_bytes_copy: "
          f"against a copy of the kernel's own byte count); best of {repeat} medians. saved {path}")


if __name__ == "__main__":
    main()
