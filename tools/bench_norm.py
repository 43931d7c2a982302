"""RMSNorm and the residual add before it, forward + backward, against torch in the same run.

For each [T, H] (the model's rows: micro-batch x sequence, hidden), three ways to compute
`h = x + a; y = rms_norm(h) * w` and its gradients (dx = da, dw) given dh and dy:

    torch          the model's unfused code: a BF16 add, `F.rms_norm`, autograd's add of h's gradients
    torch.compile  the same function compiled (Inductor fuses it; GPU only)
    moefp8         kernels/norm.py's `add_rms_norm` (model.fused_norm=true), one pass each way

and the norm alone (`rms_norm`, the attention's and the final norm) by torch and by moefp8. Each
row: median ms of forward + backward, GB/s over the bytes it must move once (add + norm: read x, a,
write h, y; read h, dh, dy, write dx; the norm: read x, write y; read x, dy, write dx), the
device's copy bandwidth measured in the same run (the speed of light), their ratio, the time
against torch's, and the largest error of y and dx against torch's relative to the tensor's largest
value. These are eager calls, so each time includes the host's launches where they outlast the
kernels: at 32768 x 2048 moefp8's add + norm read 0.618 ms through autograd while its two kernels,
called directly, take 0.299 (the "(swept)" row; one H200, session 55), and the training step, which
replays them in CUDA graphs, sees the latter. --graphs times each variant as a CUDA graph's replay
instead (fresh leaves made and first used on the capture's stream: a first try with the default
stream's leaves invalidated the capture through their AccumulateGrad nodes). Replayed so at 32768 x 2048
(one H200, session 56): moefp8 add + norm 0.296 ms, torch's 0.505, torch.compile's 0.300.

With --sweep it first times the kernels' launch configs (`SWEEP`, forward and backward apart, the
add + norm pair) and adds a row "moefp8 add+norm (swept)" of the fastest pair, for
`kernels/norm.py`'s `launch_for` to adopt.

    python tools/bench_norm.py                          # GPU: 32768x2048 (the 3B preset's step rows) and 16384x7168
    python tools/bench_norm.py --shapes 4096x2048 --out /tmp/norm.json
    python tools/bench_norm.py --sweep

Without a GPU it times the CPU path (the reference) on a small shape and writes to outputs/.
"""

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from moefp8.kernels import norm as N  # noqa: E402
from moefp8.testing import bench, copy_bandwidth_gbs, print_table, results_path, save_results  # noqa: E402

EPS = 1e-6
SWEEP = {"fwd": [dict(BLOCK_T=t, num_warps=w) for t, w in itertools.product((1, 2, 4), (4, 8))],
         "bwd": [dict(BLOCK_T=t, num_warps=w, PROGS_PER_SM=p) for t, w, p in itertools.product((1, 2), (4, 8), (4, 8, 16))]
         + [dict(SPLIT=True, BLOCK_T=t, num_warps=w, DW_BLOCK_R=r, DW_BLOCK_C=c, DW_ROWS=n, DW_WARPS=4)  # two kernels
            for t, w, r, c, n in itertools.product((1, 2), (4, 8), (16, 32), (128,), (256, 1024))]}


def torch_add_norm(x, a, w):
    h = x + a
    return h, F.rms_norm(h, (h.shape[-1],), w.to(h.dtype), EPS)


def torch_norm(x, w):
    return F.rms_norm(x, (x.shape[-1],), w.to(x.dtype), EPS)


def variants(gpu: bool) -> dict:
    """name -> (kind "add_norm" | "norm", fn)."""
    v = {"torch add+norm": ("add_norm", torch_add_norm),
         "moefp8 add+norm": ("add_norm", lambda x, a, w: N.add_rms_norm(x, a, w, EPS)),
         "torch norm": ("norm", torch_norm),
         "moefp8 norm": ("norm", lambda x, w: N.rms_norm(x, w, EPS))}
    if gpu:
        v["torch.compile add+norm"] = ("add_norm", torch.compile(torch_add_norm, dynamic=False))
        v["torch.compile norm"] = ("norm", torch.compile(torch_norm, dynamic=False))
    return v


def step(kind, fn, x, a, w, dh, dy):
    """Forward + backward: -> (y, dx, dw) (autograd.grad: no accumulation into .grad)."""
    if kind == "add_norm":
        h, y = fn(x, a, w)
        dx, _, dw = torch.autograd.grad([h, y], [x, a, w], [dh, dy])
    else:
        y = fn(x, w)
        dx, dw = torch.autograd.grad([y], [x, w], [dy])
    return y, dx, dw


def sweep(x, a, w, dh, dy) -> tuple[dict, dict, list]:
    """The fastest forward and backward launch configs of the add + norm pair at these rows, and every timing."""
    h, _, r = N.rms_norm_fwd(x, w, EPS, a)
    log, best = [], {}
    for part, configs in SWEEP.items():
        for cfg in configs:
            fn = (lambda: N.rms_norm_fwd(x, w, EPS, a, launch=cfg)) if part == "fwd" else \
                (lambda: N.rms_norm_bwd(h, dy, w, r, dh, launch=cfg))
            try:
                ms = bench(fn)
            except Exception as e:  # (a config past the registers or shared memory)
                log.append({"part": part, "config": cfg, "error": f"{type(e).__name__}"})
                continue
            log.append({"part": part, "config": cfg, "ms": round(ms, 4)})
            if part not in best or ms < best[part][0]:
                best[part] = (ms, cfg)
    return best["fwd"][1], best["bwd"][1], log


def graphed_step(kind, fn, x, a, w, dh, dy):
    """`step` captured in a CUDA graph -> its replay. The leaves are copies made and first used on the
    capture's stream (their AccumulateGrad nodes then live there, not on the default stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        xs, as_, ws = (t.detach().clone().requires_grad_() for t in (x, a, w))
        for _ in range(3):
            step(kind, fn, xs, as_, ws, dh, dy)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        step(kind, fn, xs, as_, ws, dh, dy)
    torch.cuda.current_stream().wait_stream(side)
    return g.replay


def max_rel(u, v) -> float:
    u, v = u.detach().float(), v.detach().float()
    return float((u - v).abs().max() / (v.abs().max() + 1e-30))


def main() -> None:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="32768x2048,16384x7168" if gpu else "512x256", help="row shapes TxH")
    p.add_argument("--repeat", type=int, default=3 if gpu else 1, help="medians per variant; the best is reported")
    p.add_argument("--out", default=None, help="results JSON (default bench/results/norm-<device>.json)")
    p.add_argument("--sweep", action="store_true", help="time the kernels' launch configs first (GPU)")
    p.add_argument("--graphs", action="store_true", help="time each variant as a CUDA graph's replay (GPU)")
    args = p.parse_args()
    dev = "cuda" if gpu else "cpu"
    copy_gbs = copy_bandwidth_gbs(1 << 30 if gpu else 1 << 26, repeat=args.repeat)
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s (bytes read + written)")
    rows, sweeps = [], []
    for T, H in (tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")):
        g = torch.Generator(device=dev).manual_seed(T + H)
        x, a, dh, dy = (torch.randn(T, H, device=dev, generator=g).bfloat16().requires_grad_(i < 2) for i in range(4))
        w = (1 + 0.1 * torch.randn(H, device=dev, generator=g)).requires_grad_()
        want = {}
        for name, (kind, fn) in variants(gpu).items():
            try:
                out = step(kind, fn, x, a, w, dh, dy)
                run = graphed_step(kind, fn, x, a, w, dh, dy) if args.graphs and gpu else \
                    (lambda: step(kind, fn, x, a, w, dh, dy))
                ms = min(bench(run) for _ in range(max(args.repeat, 1)))
            except Exception as e:  # torch.compile where Inductor cannot build: the row says why
                rows.append({"case": f"{name} {T}x{H}", "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            want.setdefault(kind, out)
            nb = (8 if kind == "add_norm" else 5) * T * H * 2
            gbs = nb / ms / 1e6
            base = next((r for r in rows if r.get("kind") == kind and r.get("shape") == f"{T}x{H}"), None)
            rows.append({"case": f"{name} {T}x{H}", "kind": kind, "shape": f"{T}x{H}", "ms": round(ms, 4),
                         "value": round(gbs, 1), "unit": "GB/s", "baseline": "device copy (same run)",
                         "baseline_value": round(copy_gbs, 1), "ratio": float(f"{gbs / copy_gbs:.3g}"),
                         "sol_ms": round(nb / copy_gbs / 1e6, 4),
                         "vs_torch": round(base["ms"] / ms, 3) if base else 1.0,
                         "y_err": max_rel(out[0], want[kind][0]), "dx_err": max_rel(out[1], want[kind][1]),
                         "dw_err": max_rel(out[2], want[kind][2])})
        if args.sweep and gpu:
            with torch.no_grad():
                fwd, bwd, log = sweep(x.detach(), a.detach(), w.detach(), dh, dy)
            sweeps.append({"shape": f"{T}x{H}", "fwd": fwd, "bwd": bwd, "default": N.launch_for(H), "log": log})
            h, _, r = N.rms_norm_fwd(x.detach(), w.detach(), EPS, a.detach(), launch=fwd)
            ms = min(bench(lambda: (N.rms_norm_fwd(x.detach(), w.detach(), EPS, a.detach(), launch=fwd),
                                    N.rms_norm_bwd(h, dy, w.detach(), r, dh, launch=bwd)))
                     for _ in range(max(args.repeat, 1)))
            nb = 8 * T * H * 2
            base = next(r for r in rows if r.get("case") == f"torch add+norm {T}x{H}")
            rows.append({"case": f"moefp8 add+norm (swept) {T}x{H}", "kind": "add_norm", "shape": f"{T}x{H}",
                         "ms": round(ms, 4), "value": round(nb / ms / 1e6, 1), "unit": "GB/s",
                         "baseline": "device copy (same run)", "baseline_value": round(copy_gbs, 1),
                         "ratio": float(f"{nb / ms / 1e6 / copy_gbs:.3g}"), "sol_ms": round(nb / copy_gbs / 1e6, 4),
                         "vs_torch": round(base["ms"] / ms, 3), "config": {"fwd": fwd, "bwd": bwd}})
            print(f"sweep {T}x{H}: fwd {fwd}, bwd {bwd}")
        if gpu:
            torch.cuda.empty_cache()
    path = Path(args.out) if args.out else results_path("norm")
    save_results("bench_norm", rows, {"what": "device-to-device copy (read + write)", "value": round(copy_gbs, 1),
                                      "unit": "GB/s"}, path=path, sweeps=sweeps,
                 timing="graph replay" if args.graphs and gpu else "eager")
    print_table(rows, ["case", "ms", "sol_ms", "value", "ratio", "vs_torch", "y_err", "dx_err", "dw_err", "error"])
    print(f"speed-of-light: copy {copy_gbs:.0f} GB/s (sol_ms: the bytes at that speed); vs_torch: torch's time "
          f"over this one's; errors: max |difference| / max |torch's|. saved {path}")


if __name__ == "__main__":
    main()
