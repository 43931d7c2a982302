"""CPU affinity for multi-GPU runs: each local rank pinned to a disjoint slice of the CPUs nearest
its GPU (torchrun pins nothing: the ranks' host threads may migrate across cores and NUMA nodes).
Opt-in (`--bind-cpus` of the bench tools); bench/notes/overlap.md has what it measured (session 12).

The CPUs near GPU i are the `local_cpulist` sysfs lists of its PCI device; local ranks whose GPUs
share a list split it evenly, in local-rank order. Without that information (no sysfs, or a torch
build whose device properties lack the PCI ids) the process's allowed CPUs are split evenly over
the local ranks. Assumes local rank r drives GPU r, as torchrun launches do (when a rank sees fewer
GPUs than there are local ranks, the even split is used)."""

import os

import torch


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def gpu_local_cpus(index: int) -> list[int] | None:
    """The CPUs sysfs lists as local to CUDA device `index`, or None when unknown."""
    p = torch.cuda.get_device_properties(index)
    ids = [getattr(p, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if None in ids:
        return None
    path = f"/sys/bus/pci/devices/{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0/local_cpulist"
    try:
        with open(path) as f:
            cpus = parse_cpulist(f.read())
    except OSError:
        return None
    return cpus or None


def cpu_slice(local_rank: int, pools: list[list[int]]) -> list[int]:
    """This rank's CPUs: its pool (pools[r] = the CPUs rank r may use) split evenly over the ranks
    that have the same pool, in rank order. A pool smaller than its ranks is shared whole."""
    mine = pools[local_rank]
    peers = [r for r, p in enumerate(pools) if p == mine]
    n, i = len(peers), peers.index(local_rank)
    if len(mine) < n:
        return list(mine)
    per = len(mine) // n
    return mine[i * per:(i + 1) * per]


def bind_cpus(local_rank: int, local_world: int) -> list[int]:
    """Pins this process (all its threads created afterwards) to its slice; returns it."""
    allowed = sorted(os.sched_getaffinity(0))
    # every local GPU must be visible to map ranks to GPUs (not so under per-rank CUDA_VISIBLE_DEVICES)
    see_all = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    near = [gpu_local_cpus(r) for r in range(local_world)] if see_all else [None]
    if any(c is None for c in near):
        pools = [allowed] * local_world
    else:
        ok = set(allowed)
        pools = [[c for c in cpus if c in ok] or allowed for cpus in near]
    cpus = cpu_slice(local_rank, pools)
    os.sched_setaffinity(0, cpus)
    return cpus
