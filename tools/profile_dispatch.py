"""Profiles the all_to_all dispatch on rank 0 (torch profiler): where a full FP8 dispatch spends
its time, device kernels and host ops. Launch like the benchmark:

    torchrun --standalone --nproc_per_node 4 tools/profile_dispatch.py [--cached] [--mode capacity]
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from moefp8.dispatch.all_to_all import AllToAllDispatcher
from moefp8.kernels.quant import quant_rowwise

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, default=4096)
p.add_argument("--hidden", type=int, default=7168)
p.add_argument("--experts", type=int, default=256)
p.add_argument("--topk", type=int, default=8)
p.add_argument("--cached", action="store_true", help="profile the dispatch that reuses a handle")
p.add_argument("--mode", default="exact", choices=("exact", "capacity"), help="all_to_all mode (capacity: --tokens)")
args = p.parse_args()
rank = int(os.environ["RANK"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
g = torch.Generator(device="cuda").manual_seed(rank)
x8 = quant_rowwise(torch.randn(args.tokens, args.hidden, device="cuda", generator=g).bfloat16())
scores = torch.randn(args.tokens, args.experts, device="cuda", generator=g).abs() + 1
idx = scores.topk(args.topk, dim=-1).indices
w = torch.rand(args.tokens, args.topk, device="cuda", generator=g)
disp = AllToAllDispatcher(args.experts, capacity=args.tokens, mode=args.mode)
h = disp.dispatch(x8, idx, w).handle
fn = (lambda: disp.dispatch(x8, handle=h)) if args.cached else (lambda: disp.dispatch(x8, idx, w))
for _ in range(5):
    fn()
torch.cuda.synchronize()
dist.barrier()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
if rank == 0:
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
dist.destroy_process_group()
