"""Benchmark the FP8 blockwise GEMMs against cuBLAS / torch baselines (docs/design.md §5, §6).

Cases (DeepSeek-V3 defaults): expert fc1 (K=7168 -> N=4096) and fc2 (K=2048 -> N=7168) with
8..32 local experts, balanced and skewed token counts (512..8192 per expert); dense 8192^3.
For each: TFLOP/s of ours (m-grouped fprop and dgrad, k-grouped wgrad: the warp-specialized Gluon
kernels "ws", the GPU default on Hopper, and the Triton TMA kernels) and of
cuBLAS dense blockwise `_scaled_mm` on the same total
shape, a per-expert loop of blockwise `_scaled_mm`, BF16 `torch._grouped_mm` and row-wise FP8
`torch._scaled_grouped_mm`; the FP8 peak (per-tensor `_scaled_mm` 8192^3) measured in the same
run; DeepGEMM's m-grouped GEMM (fprop, and dgrad on the transposed weight copy) and k-grouped wgrad
(on its per-expert copy of the "128x1" operands) where `deep_gemm` imports (kernels/deepgemm.py), with
whether ours equals it bit for bit and, for the wgrad, the relative difference (JSON `deep_gemm`). FLOPs count the padded rows (the work every implementation does).

Timing: an H100 running FP8 GEMMs reaches its 700 W power limit within ~2.5 s, and its SM clock
falls from 1980 MHz to ~1200-1500 MHz (bench/notes/gemm.md, session 32): a figure taken in the first
seconds reads up to ~20% fast. So the run first holds the GPU busy for --soak seconds (the state a
training run is in), and the implementations compared in one case are timed side by side: --rounds
rounds, the order reversed every other round, the median of the rounds kept. Every result of ours is
checked against a reference (column `err`, relative error) before it is timed. Diagnostic rows
time the same Triton kernels without the per-128-K promotion (wrong numerics) to show its cost.

Steady state (--hold S): each implementation instead runs alone for S seconds and is timed over the
second half (CUDA events), with the SM clock, power and clock reasons sampled there (`GpuSampler`):
on an H100 every FP8 and BF16 GEMM then sits at the 700 W cap, so TFLOP/s measures energy per FLOP
as a training step meets it. The JSON's `held` list gives each (case, implementation)'s clock and power.

    python tools/bench_gemm.py            # full sweep -> bench/results/gemm-<device>.json
    python tools/bench_gemm.py --quick    # 2 expert cases + dense
    python tools/bench_gemm.py --probe    # which cuBLAS blockwise scale layouts are correct
    python tools/bench_gemm.py --hold 3 --modes balanced --variants ws   # steady state, with clocks
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moefp8.kernels import deepgemm  # noqa: E402
from moefp8.kernels import grouped_gemm as gg  # noqa: E402
from moefp8.fp8 import col_major  # noqa: E402
from moefp8.kernels.gemm import _cublas_weight_scale, fp8_gemm, fp8_gemm_dgrad, transpose_weight  # noqa: E402
from moefp8.kernels.quant import quant_colwise, quant_rowwise, quant_weight  # noqa: E402
from moefp8.testing import GpuSampler, bench, print_table, rel_err, save_results  # noqa: E402


def tflops(flop: float, ms: float) -> float:
    return flop / ms / 1e9


def _round128(n: int) -> int:
    return -(-n // 128) * 128


def counts_for(E: int, mode: str, mean: int, lo: int = 512, hi: int = 8192) -> list[int]:
    if mode == "balanced":
        return [mean] * E
    # skewed: geometric spread lo..hi (token counts not multiples of 128: padding included)
    return [int(lo * (hi / lo) ** (i / max(E - 1, 1))) + 37 for i in range(E)][::-1]


def peak_fp8(n: int = 8192, soak_s: float = 0.0) -> float:
    """Per-tensor FP8 `_scaled_mm` n^3 TFLOP/s, after running it for `soak_s` seconds (the GPU at its
    steady power / clock state)."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    end = time.perf_counter() + soak_s
    while time.perf_counter() < end:
        for _ in range(20):
            torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
    ms = bench(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
    return tflops(2 * n**3, ms)


ROUNDS = 3
HOLD = 0.0  # --hold: seconds each implementation runs alone (0: do_bench, interleaved)
HELD = []  # with --hold: per (case, implementation) its time, SM clock and power over the timed half
DEEPGEMM = "DeepGEMM m_grouped_fp8_gemm_nt_contiguous"  # a baseline where `deep_gemm` imports
DEEPGEMM_K = "DeepGEMM k_grouped_fp8_gemm_nt_contiguous"  # the wgrad's baseline where `deep_gemm` imports
SAME_AS_DEEPGEMM = {}  # "case moefp8-variant": its output equals DeepGEMM's bit for bit
DEEPGEMM_K_ERR = {}  # "k-grouped case moefp8-variant": relative difference from DeepGEMM's dW


def held(fn) -> tuple[float, dict]:
    """(ms per call of fn, the GPU's clocks and power) with fn run back to back for HOLD seconds, timed
    over the second half (CUDA events) while `GpuSampler` samples the GPU: the state a long run of it
    settles at."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    # batches of ~25 ms between host syncs (the GPU idles < 1% of the timed half, which holds >= 1 batch)
    batch = max(1, int(0.025 / max(time.perf_counter() - t0, 1e-6)))
    t0, start, end = time.perf_counter(), torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    while time.perf_counter() - t0 <= HOLD / 2:
        for _ in range(batch):
            fn()
        torch.cuda.synchronize()
    n = 0
    with GpuSampler() as gpu:
        start.record()
        while n == 0 or time.perf_counter() - t0 < HOLD:
            for _ in range(batch):
                fn()
            n += batch
            torch.cuda.synchronize()
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / n, gpu.summary.get(torch.cuda.current_device(), {})


def timed(fns: dict, case: str = "") -> dict:
    """Median ms of each callable over ROUNDS rounds, the order reversed every other round: the
    implementations of one comparison are timed side by side, under the same clock and power state.
    With HOLD each is timed by `held` and its state appended to HELD."""
    got = {k: [] for k in fns}
    for r in range(ROUNDS):
        for k in list(fns)[:: 1 if r % 2 == 0 else -1]:
            if HOLD:
                ms, state = held(fns[k])
                HELD.append({"case": case, "impl": " ".join(map(str, k)) if isinstance(k, tuple) else k,
                             "round": r, "ms": round(ms, 4), **state})
            else:
                ms = bench(fns[k])
            got[k].append(ms)
    return {k: statistics.median(v) for k, v in got.items()}


def policy(v: str) -> gg.GemmPolicy:
    """The GEMM policy whose grouped kernels (and dense Triton fallback) are variant v."""
    return gg.GemmPolicy(variant=v)


def row(case, impl, value, baseline, baseline_value, err=None):
    r = {"case": case, "impl": impl, "value": round(value, 1), "unit": "TFLOP/s", "baseline": baseline,
         "baseline_value": round(baseline_value, 1), "ratio": round(value / baseline_value, 3)}
    if err is not None:
        r["err"] = float(f"{err:.3g}")
    return r


def timed_rows(rows, case, flop, base, ours, diag, errs, extra=None) -> dict:
    """Times the baselines, our variants, the diagnostics (`diag`: variants without promotion) and any
    `extra` callables side by side (`timed`); appends a row per (variant, baseline) and per diagnostic,
    and returns the times."""
    t = timed({**base, **{("ours", v): f for v, f in ours.items()}, **{("diag", v): f for v, f in diag.items()},
               **(extra or {})}, case)
    for v in ours:
        for bname in base:
            rows.append(row(case, f"moefp8-{v}", tflops(flop, t["ours", v]), bname, tflops(flop, t[bname]), errs[v]))
    for v in diag:
        rows.append(row(case, f"diagnostic: moefp8-{v} without promotion (wrong numerics)", tflops(flop, t["diag", v]),
                        f"moefp8-{v}", tflops(flop, t["ours", v])))
    return t


def expert_case(rows, name, K, N, counts, variants):
    E = len(counts)
    seg = [_round128(c) for c in counts]
    off = [0]
    for s in seg:
        off.append(off[-1] + s)
    M = off[-1]
    flop = 2 * M * N * K
    case = f"{name} E{E} M{M} {'balanced' if len(set(counts)) == 1 else 'skewed'}"
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    a8, w8, dy8 = quant_rowwise(x), quant_weight(w), quant_rowwise(dy)
    off_t = torch.tensor(off, dtype=torch.int32, device="cuda")
    ends = off_t[1:].contiguous()

    # fprop: the baselines and ours, timed side by side (`timed`) ---------------------------
    sa_cm = col_major(a8.scale)
    sb_dense = _cublas_weight_scale(w8.scale[0])  # one expert's weight for all rows: same FLOPs
    b_dense = w8.data[0]
    per = []
    for e in range(E):
        s, t = off[e], off[e + 1]
        if t > s:
            per.append((a8.data[s:t], w8.data[e].t(), col_major(a8.scale[s:t]), _cublas_weight_scale(w8.scale[e])))
    xb, wbt = x, w.transpose(1, 2)
    sa_row = x.float().abs().amax(1).clamp_min(1e-4) / 448
    a_row8 = (x.float() / sa_row[:, None]).to(torch.float8_e4m3fn)
    sb_row = w.float().abs().amax(2).clamp_min(1e-4) / 448
    b_row8 = (w.float() / sb_row[:, :, None]).to(torch.float8_e4m3fn).transpose(1, 2)
    base = {"cuBLAS dense blockwise _scaled_mm (same total shape)":
            lambda: torch._scaled_mm(a8.data, b_dense.t(), sa_cm, sb_dense, out_dtype=torch.bfloat16),
            "per-expert loop of blockwise _scaled_mm":
            lambda: [torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16) for a, b, sa, sb in per],
            "torch._grouped_mm bf16": lambda: torch._grouped_mm(xb, wbt, offs=ends, out_dtype=torch.bfloat16),
            "torch._scaled_grouped_mm rowwise fp8":
            lambda: torch._scaled_grouped_mm(a_row8, b_row8, sa_row, sb_row, offs=ends, out_dtype=torch.bfloat16)}
    try:
        base["torch._scaled_grouped_mm rowwise fp8"]()
    except RuntimeError as exc:  # noqa: BLE001
        print(f"_scaled_grouped_mm failed: {exc}"[:300])
        del base["torch._scaled_grouped_mm rowwise fp8"]
    dg, m_idx = deepgemm.load(), deepgemm.m_indices(off_t, M)
    if dg is not None:  # the same FP8 bytes and scales (x has data in the padding rows: DeepGEMM computes them too)
        base[DEEPGEMM] = lambda: deepgemm.m_grouped(a8, w8, m_idx, dg)
    ref = gg.fp8_grouped_gemm_ref(a8, w8, off).float() if M * N <= 2**28 else None
    ours, errs = {}, {}
    for v in variants:
        out = gg.fp8_grouped_gemm(a8, w8, off_t, validate=False, policy=policy(v))
        if dg is not None:
            SAME_AS_DEEPGEMM[f"m-grouped fprop {case} moefp8-{v}"] = torch.equal(out, base[DEEPGEMM]())
        errs[v] = rel_err(out, ref) if ref is not None else rel_err(out[:off[1]], (a8.dequantize()[:off[1]] @ w8.dequantize()[0].t()))
        ours[v] = lambda p=policy(v): gg.fp8_grouped_gemm(a8, w8, off_t, validate=False, policy=p)
    diag = {}
    if "tma" in variants:  # what the per-128-K promotion costs: same kernel and tiles, no promotion
        o2 = torch.empty_like(out)
        diag["tma"] = lambda o2=o2: gg.launch_mgrouped(a8, w8, off_t, o2, variant="tma", _promote=False)
    timed_rows(rows, f"m-grouped fprop {case}", flop, base, ours, diag, errs)
    # dgrad
    ours = {}
    for v in variants:
        dx = gg.fp8_grouped_gemm(dy8, w8, off_t, transpose_b=True, validate=False, policy=policy(v))
        s1 = off[1]
        errs[v] = rel_err(dx[:s1], dy8.dequantize()[:s1] @ w8.dequantize()[0])
        ours[v] = lambda p=policy(v): gg.fp8_grouped_gemm(dy8, w8, off_t, transpose_b=True, validate=False, policy=p)
    dyb, wb = dy, w
    dgrad_base = {"bf16": lambda: torch._grouped_mm(dyb, wb, offs=ends, out_dtype=torch.bfloat16)}
    if dg is not None:  # DeepGEMM's NT kernel on the transposed weight copy (made outside the timing)
        w8t = transpose_weight(w8)
        dgrad_base[DEEPGEMM] = lambda: deepgemm.m_grouped(dy8, w8t, m_idx, dg)
        for v in variants:
            SAME_AS_DEEPGEMM[f"m-grouped dgrad {case} moefp8-{v}"] = torch.equal(
                gg.fp8_grouped_gemm(dy8, w8, off_t, transpose_b=True, validate=False, policy=policy(v)),
                dgrad_base[DEEPGEMM]())
    t = timed({**dgrad_base, **ours}, f"m-grouped dgrad {case}")
    for v in variants:
        rows.append(row(f"m-grouped dgrad {case}", f"moefp8-{v} incl. Wᵀ copy", tflops(flop, t[v]),
                        "torch._grouped_mm bf16", tflops(flop, t["bf16"]), errs[v]))
        if dg is not None:
            rows.append(row(f"m-grouped dgrad {case}", f"moefp8-{v} incl. Wᵀ copy", tflops(flop, t[v]),
                            f"{DEEPGEMM} (Wᵀ copy not timed)", tflops(flop, t[DEEPGEMM]), errs[v]))
    # wgrad: ours k-grouped vs BF16 _grouped_mm (2d x 2d, both operands token-major, as ours)
    dyc, xc = quant_colwise(dy), quant_colwise(x)
    dyt, xt = dy.t().contiguous(), x.t().contiguous()
    per_w = []
    for e in range(E):
        s, t = off[e], off[e + 1]
        if t > s:
            per_w.append((dyc.data[:, s:t], xc.data[:, s:t].t(), col_major(dyc.scale[:, s // 128:t // 128]),
                           xc.scale[:, s // 128:t // 128].t().contiguous()))
    base = {"torch._grouped_mm bf16 wgrad": lambda: torch._grouped_mm(dyt, xt.t(), offs=ends, out_dtype=torch.bfloat16),
            "per-expert loop of cuBLAS blockwise 1x128x1x128 fp32":
            lambda: [torch._scaled_mm(a, b, sa, sb, out_dtype=torch.float32) for a, b, sa, sb in per_w]}
    try:
        base["per-expert loop of cuBLAS blockwise 1x128x1x128 fp32"]()
    except RuntimeError as exc:
        print(f"per-expert cuBLAS wgrad failed: {exc}"[:300])
        del base["per-expert loop of cuBLAS blockwise 1x128x1x128 fp32"]
    if dg is not None:  # DeepGEMM's k-grouped kernel on its own layout of the same bytes (copied outside the timing)
        dy_k, x_k, ks_dev = deepgemm.k_grouped_operand(dyc, seg), deepgemm.k_grouped_operand(xc, seg), torch.tensor(
            seg, dtype=torch.int32, device="cuda")
        dw_dg = torch.zeros(E, N, K, device="cuda")
        base[DEEPGEMM_K] = lambda: deepgemm.k_grouped(dy_k, x_k, seg, dg, out=dw_dg, ks_dev=ks_dev)
    ours, diag = {}, {}
    for v in variants:
        dw = gg.fp8_grouped_gemm_wgrad(dyc, xc, off_t, validate=False, policy=policy(v))
        if dg is not None:
            theirs = deepgemm.k_grouped(dy_k, x_k, seg, dg)
            SAME_AS_DEEPGEMM[f"k-grouped wgrad {case} moefp8-{v}"] = torch.equal(dw, theirs)
            DEEPGEMM_K_ERR[f"k-grouped wgrad {case} moefp8-{v}"] = float(f"{rel_err(dw, theirs):.3g}")
        e = 0
        errs[v] = rel_err(dw[e], dyc.dequantize()[off[e]:off[e + 1]].t() @ xc.dequantize()[off[e]:off[e + 1]])
        ours[v] = lambda p=policy(v): gg.fp8_grouped_gemm_wgrad(dyc, xc, off_t, validate=False, policy=p)
        if v == "tma":
            o2 = torch.empty_like(dw)
            diag[v] = lambda o2=o2: gg.launch_kgrouped(dyc, xc, off_t, o2, False, variant="tma", _promote=False)
    dw = gg.fp8_grouped_gemm_wgrad(dyc, xc, off_t, validate=False, impl="cublas")
    err_cublas = rel_err(dw[0], dyc.dequantize()[off[0]:off[1]].t() @ xc.dequantize()[off[0]:off[1]])
    t = timed_rows(rows, f"k-grouped wgrad {case}", flop, base, ours, diag, errs,
                   {"cublas": lambda: gg.fp8_grouped_gemm_wgrad(dyc, xc, off_t, validate=False, impl="cublas")})
    rows.append(row(f"k-grouped wgrad {case}", "moefp8 impl=cublas (per-expert loop, host sync)",
                    tflops(flop, t["cublas"]), "torch._grouped_mm bf16 wgrad", tflops(flop, t["torch._grouped_mm bf16 wgrad"]),
                    err_cublas))
    del x, w, dy, a8, w8, dy8, dyc, xc, dyt, xt
    torch.cuda.empty_cache()


def dense_case(rows, n, variants):
    M = N = K = n
    flop = 2 * M * N * K
    case = f"dense {M}x{N}x{K}"
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    a8, w8, dy8 = quant_rowwise(x), quant_weight(w), quant_rowwise(dy)
    ref = fp8_gemm(a8, w8, impl="cublas").float()
    errs = {}
    for v in variants:
        errs[v] = rel_err(fp8_gemm(a8, w8, impl="triton", policy=policy(v)), ref)
    t = timed({"cublas": lambda: fp8_gemm(a8, w8, impl="cublas"), "bf16": lambda: x @ w.t(),
               **{v: lambda p=policy(v): fp8_gemm(a8, w8, impl="triton", policy=p) for v in variants}}, f"fprop {case}")
    for v in variants:
        rows.append(row(f"fprop {case}", f"moefp8-triton-{v}", tflops(flop, t[v]), "cuBLAS blockwise _scaled_mm",
                        tflops(flop, t["cublas"]), errs[v]))
    rows.append(row(f"fprop {case}", "cuBLAS blockwise (moefp8 default)", tflops(flop, t["cublas"]), "torch mm bf16",
                    tflops(flop, t["bf16"])))
    # dgrad: both paths multiply by an FP8 copy of Wᵀ (FP8 wgmma needs K-major operands)
    w8t = transpose_weight(w8)
    ref = fp8_gemm(dy8, w8t, impl="cublas").float()
    for v in variants:
        errs[v] = rel_err(fp8_gemm_dgrad(dy8, w8, impl="triton", policy=policy(v)), ref)
    t = timed({"transpose": lambda: transpose_weight(w8), "cached": lambda: fp8_gemm(dy8, w8t, impl="cublas"),
               "copy": lambda: fp8_gemm_dgrad(dy8, w8, impl="cublas"),
               **{v: lambda p=policy(v): fp8_gemm_dgrad(dy8, w8, impl="triton", policy=p) for v in variants}},
              f"dgrad {case}")
    print(f"transpose_weight {N}x{K}: {t['transpose'] * 1e3:.1f} us")
    for v in variants:
        rows.append(row(f"dgrad {case}", f"moefp8-triton-{v} incl. Wᵀ copy", tflops(flop, t[v]),
                        "cuBLAS blockwise on cached Wᵀ", tflops(flop, t["cached"]), errs[v]))
    rows.append(row(f"dgrad {case}", "cuBLAS blockwise incl. Wᵀ copy (moefp8 default)", tflops(flop, t["copy"]),
                    "cuBLAS blockwise on cached Wᵀ", tflops(flop, t["cached"])))
    # wgrad
    dyc, xc = quant_colwise(dy), quant_colwise(x)
    dyt, xt = dy.t().contiguous(), x.t().contiguous()
    ref = dyc.dequantize().t() @ xc.dequantize()
    for v in variants:
        errs[v] = rel_err(fp8_gemm(dyc, xc, impl="triton", policy=policy(v)), ref)
    err_cublas = rel_err(fp8_gemm(dyc, xc, impl="cublas"), ref)
    main_grad = torch.zeros(N, K, device="cuda")
    t = timed({"bf16": lambda: dyt @ xt.t(), "cublas": lambda: fp8_gemm(dyc, xc, impl="cublas"),
               "cublas main": lambda: fp8_gemm(dyc, xc, out=main_grad, impl="cublas"),
               **{v: lambda p=policy(v): fp8_gemm(dyc, xc, impl="triton", policy=p) for v in variants},
               **{(v, "main"): lambda p=policy(v): fp8_gemm(dyc, xc, out=main_grad, impl="triton", policy=p)
                  for v in variants}}, f"wgrad {case}")
    bf = "torch mm bf16 (token-major operands)"
    for v in variants:
        rows.append(row(f"wgrad {case}", f"moefp8-triton-{v}", tflops(flop, t[v]), bf, tflops(flop, t["bf16"]),
                        errs[v]))
    rows.append(row(f"wgrad {case}", "cuBLAS blockwise 1x128x1x128 fp32 (moefp8 default)", tflops(flop, t["cublas"]),
                    bf, tflops(flop, t["bf16"]), err_cublas))
    rows.append(row(f"wgrad {case} into main grad", "cuBLAS blockwise fp32 + add_", tflops(flop, t["cublas main"]),
                    bf, tflops(flop, t["bf16"])))
    for v in variants:
        rows.append(row(f"wgrad {case} into main grad", f"moefp8-triton-{v} (accumulates in-kernel)",
                        tflops(flop, t[v, "main"]), bf, tflops(flop, t["bf16"])))


def probe():
    """Which scale layouts give correct blockwise _scaled_mm results (K/128 not a multiple of 4 too)."""
    torch.manual_seed(0)
    for K in (384, 640, 7168):
        M, N = 256, 512
        a8 = quant_rowwise(torch.randn(M, K, device="cuda"))
        w8 = quant_weight(torch.randn(N, K, device="cuda"))
        ref = a8.dequantize() @ w8.dequantize().t()
        s = w8.scale
        for name, sb in [("s.t()", s.t()), ("padded L4 view", _cublas_weight_scale(s)), ("s.t().contiguous()", s.t().contiguous())]:
            for aname, sa in [("sa col-major", col_major(a8.scale)), ("sa row-major", a8.scale)]:
                try:
                    y = torch._scaled_mm(a8.data, w8.data.t(), sa, sb, out_dtype=torch.bfloat16)
                    print(f"probe fprop K={K} scale_b {name:20s} {aname}: rel_err {rel_err(y, ref):.3g}")
                except RuntimeError as exc:
                    print(f"probe fprop K={K} scale_b {name:20s} {aname}: refused: {str(exc)[:120]}")
    for T in (256, 384, 1000):
        N, K = 256, 512
        dyc, xc = quant_colwise(torch.randn(T, N, device="cuda")), quant_colwise(torch.randn(T, K, device="cuda"))
        ref = dyc.dequantize().t() @ xc.dequantize()
        for name, sb in [("xs.t()", xc.scale.t()), ("xs.t().contiguous()", xc.scale.t().contiguous())]:
            for dt in (torch.float32, torch.bfloat16):
                try:
                    y = torch._scaled_mm(dyc.data, xc.data.t(), col_major(dyc.scale), sb, out_dtype=dt)
                    print(f"probe wgrad T={T} scale_b {name:20s} {dt}: rel_err {rel_err(y, ref):.3g}")
                except RuntimeError as exc:
                    print(f"probe wgrad T={T} scale_b {name:20s} {dt}: refused: {str(exc)[:120]}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048, help="expert intermediate size (fc1 N = 2*inter)")
    p.add_argument("--experts", default="8,32", help="local expert counts")
    p.add_argument("--tokens", type=int, default=4096, help="mean tokens per expert of the balanced cases at "
                   "E <= 8; at E > 8, tokens * 8 / E (the same rows in all, at least 512)")
    p.add_argument("--dense", type=int, default=8192, help="size of the dense M = N = K case (0: none)")
    p.add_argument("--variants", default="ws,tma", help="kernel variants to time (ws, tma, ptr)")
    p.add_argument("--quick", action="store_true", help="fc1 E8 balanced, fc2 E8 skewed, dense")
    p.add_argument("--probe", action="store_true", help="only probe cuBLAS blockwise scale layouts")
    p.add_argument("--soak", type=float, default=5.0, help="seconds of FP8 GEMMs before anything is timed")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per comparison (median kept)")
    p.add_argument("--hold", type=float, default=0.0, help="seconds each implementation runs alone, timed over "
                   "the second half with its SM clock and power (steady state; default: do_bench)")
    p.add_argument("--modes", default="balanced,skewed", help="token distributions of the expert cases")
    p.add_argument("--out", default=None, help="results path (default bench/results/gemm-<device>.json)")
    args = p.parse_args()
    if args.probe:
        probe()
        return
    torch.manual_seed(0)
    variants = args.variants.split(",")
    global ROUNDS, HOLD
    ROUNDS, HOLD = args.rounds, args.hold
    with GpuSampler() as gpu:
        peak = peak_fp8(soak_s=args.soak)
    soaked = gpu.summary.get(torch.cuda.current_device(), {})
    print(f"fp8 per-tensor _scaled_mm 8192^3: {peak:.0f} TFLOP/s (after {args.soak:g} s of it; GPU over the soak: "
          f"{soaked})")
    rows = []
    H, N1 = args.hidden, 2 * args.inter
    shapes = [("fc1", H, N1), ("fc2", args.inter, H)]
    cases = []
    for E in [int(e) for e in args.experts.split(",")]:
        mean = args.tokens if E <= 8 else max(512, args.tokens * 8 // E)
        for mode in args.modes.split(","):
            for name, K, N in shapes:
                cases.append((name, K, N, counts_for(E, mode, mean)))
    if args.quick:
        cases = [("fc1", H, N1, counts_for(8, "balanced", args.tokens)), ("fc2", args.inter, H, counts_for(8, "skewed", 0))]
    for name, K, N, counts in cases:
        expert_case(rows, name, K, N, counts, variants)
        print(f"done {name} {counts}", flush=True)
    if args.dense:
        dense_case(rows, args.dense, variants)
    for name, k in [("m-grouped tma", gg._mgrouped_tma_tuned), ("k-grouped tma", gg._kgrouped_tma_tuned),
                    ("m-grouped ptr", gg._mgrouped_tuned)]:
        for key, cfg in getattr(k, "cache", {}).items():
            print(f"best config {name} {key}: {cfg}")
    print_table(rows, ["case", "impl", "value", "baseline", "baseline_value", "ratio", "err"])
    if HELD:
        print_table(HELD, ["case", "impl", "round", "ms", "sm_mhz_median", "power_w_median", "temp_c_max",
                           "clock_reasons"])
    path = save_results("bench_gemm", rows, {"what": "fp8 per-tensor _scaled_mm 8192^3", "value": round(peak, 1),
                                             "unit": "TFLOP/s"}, path=args.out,
                        timing={"soak_s": args.soak, "rounds": args.rounds, "hold_s": args.hold,
                                "gpu_over_soak": soaked}, **({"held": HELD} if HELD else {}),
                        deep_gemm=({"version": getattr(deepgemm.load(), "__version__", "?"),
                                    "bit_identical": SAME_AS_DEEPGEMM, "wgrad_rel_diff": DEEPGEMM_K_ERR}
                                   if deepgemm.load() else "not installed"))
    if SAME_AS_DEEPGEMM:
        print(f"bit-identical to DeepGEMM: {sum(SAME_AS_DEEPGEMM.values())} of {len(SAME_AS_DEEPGEMM)} "
              f"{[k for k, v in SAME_AS_DEEPGEMM.items() if not v] or ''}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
