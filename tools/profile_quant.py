"""Runs each quantization kernel a few times on one shape, for `ncu` (Nsight Compute), and
prints its registers and spills. Example on a GPU machine:

    ncu --clock-control none -k regex:requant --section SpeedOfLight python tools/profile_quant.py
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moefp8.kernels import quant as Q  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--shape", default="16384x7168")
p.add_argument("--kernels", default="rowwise,colwise,requant_colwise,dequant_swiglu_quant_colwise")
args = p.parse_args()
M, K = (int(v) for v in args.shape.split("x"))
x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
x8 = Q.quant_rowwise(x)
fns = {"rowwise": (Q.quant_rowwise, x), "colwise": (Q.quant_colwise, x), "requant_colwise": (Q.requant_colwise, x8),
       "swiglu_quant": (Q.swiglu_quant, x), "dequant_swiglu_quant_colwise": (Q.dequant_swiglu_quant_colwise, x8)}
for name in args.kernels.split(","):
    fn, inp = fns[name]
    for _ in range(3):
        fn(inp)
torch.cuda.synchronize()
for kern in (Q._quant_rowwise_kernel, Q._quant_colwise_kernel, Q._requant_colwise_kernel,
             Q._dequant_swiglu_quant_colwise_kernel):
    for dev_cache in kern.device_caches.values():
        for c in dev_cache[0].values():
            print(f"{kern.fn.__name__}: regs {c.n_regs} spills {c.n_spills} shared {c.metadata.shared}")
