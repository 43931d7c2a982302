"""CPU affinity of multi-GPU ranks: cpulist parsing, the per-rank slices, pinning."""

import os

import pytest

from moefp8.affinity import bind_cpus, cpu_slice, parse_cpulist


def test_parse_cpulist():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("5") == [5]


def test_slices_are_disjoint_within_a_numa_node():
    node0, node1 = list(range(0, 16)), list(range(16, 32))
    pools = [node0, node0, node1, node1]  # GPUs 0-1 near node 0, 2-3 near node 1
    got = [cpu_slice(r, pools) for r in range(4)]
    assert got == [list(range(0, 8)), list(range(8, 16)), list(range(16, 24)), list(range(24, 32))]
    assert cpu_slice(1, [[0], [0]]) == [0]  # fewer CPUs than ranks: shared


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no sched_setaffinity on this OS")
def test_bind_cpus_pins_this_process():
    before = os.sched_getaffinity(0)
    try:
        cpus = bind_cpus(0, 1)  # one local rank: every allowed CPU (or those near GPU 0)
        assert set(cpus) == os.sched_getaffinity(0) and set(cpus) <= before
    finally:
        os.sched_setaffinity(0, before)
