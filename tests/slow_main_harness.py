"""Run under torchrun (2 gloo processes) by tests/test_spawn_group.py: rank 0's `on_main` job outlasts
train.dist_timeout_s (2 s); with slow=True the other rank waits for it, without it times out."""

import sys
import time

import torch

from moefp8.hydra_config import compose_config
from moefp8.parallel import Parallel

if __name__ == "__main__":
    cfg = compose_config(["train.device=cpu", "train.dist_timeout_s=2"])
    with Parallel(cfg, torch.device("cpu")) as par:
        out = par.on_main(lambda: time.sleep(5) or "prepared", slow=sys.argv[1] == "slow")
        par.all_reduce_(torch.ones(1))
        print(f"rank {par.rank}: {out}", flush=True)
