"""The ncu target of bench/notes/gemm.md (session 41): one call each of moefp8's m-grouped and k-grouped kernels and
DeepGEMM's on the same bytes, DeepSeek-V3 fc1 with 8 experts x 4096 tokens (K 7168 -> N 4096), between
cudaProfilerStart/Stop after two warm-up calls each (DeepGEMM compiles its kernels at the first). Needs `deep_gemm`.

    ncu --profile-from-start off --kernel-name regex:"grouped|gemm|Gemm" --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section WarpStateStats --section LaunchStats --section Occupancy \
        --section MemoryWorkloadAnalysis python tools/ncu_gemm.py
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moefp8.kernels import deepgemm, grouped_gemm as gg  # noqa: E402
from moefp8.kernels.quant import quant_colwise, quant_rowwise, quant_weight  # noqa: E402



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per expert (a multiple of 128)")
    ap.add_argument("--n", type=int, default=4096, help="output features N")
    ap.add_argument("--k", type=int, default=7168, help="input features K")
    a = ap.parse_args()
    E, per, N, K = a.experts, a.tokens, a.n, a.k
    M = E * per
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    a8, w8 = quant_rowwise(x), quant_weight(w)
    off = torch.tensor([i * per for i in range(E + 1)], dtype=torch.int32, device="cuda")
    dg = deepgemm.load()
    if dg is None:
        raise SystemExit(f"tools/ncu_gemm.py: `import deep_gemm` failed. {deepgemm.INSTALL}")
    m_idx = deepgemm.m_indices(off, M)
    dyc, xc = quant_colwise(dy), quant_colwise(x)
    ks = [per] * E
    dyk, xk = deepgemm.k_grouped_operand(dyc, ks), deepgemm.k_grouped_operand(xc, ks)
    ks_dev = torch.tensor(ks, dtype=torch.int32, device="cuda")
    dw = torch.zeros(E, N, K, device="cuda")
    fns = {"moefp8 m-grouped": lambda: gg.fp8_grouped_gemm(a8, w8, off, validate=False),
           "DeepGEMM m-grouped": lambda: deepgemm.m_grouped(a8, w8, m_idx, dg),
           "moefp8 k-grouped": lambda: gg.fp8_grouped_gemm_wgrad(dyc, xc, off, validate=False),
           "DeepGEMM k-grouped": lambda: deepgemm.k_grouped(dyk, xk, ks, dg, out=dw, ks_dev=ks_dev)}
    for f in fns.values():
        f()
        f()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, f in fns.items():
        torch.cuda.nvtx.range_push(name)
        f()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("done")


if __name__ == "__main__":
    main()
