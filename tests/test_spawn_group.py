"""moefp8.testing.spawn_group, the multi-process harness of the distributed tests: a rank that
fails is reported at once with its traceback while its peer is still blocked in a collective
(before, the failed rank's teardown waited on that peer and the error surfaced as a timeout)."""

import time

import pytest
import torch.distributed as dist

from moefp8.testing import spawn_group


def _rank0_fails(rank, world, dev):
    if rank == 0:
        raise AssertionError("boom on rank 0")
    dist.barrier()  # never joined by rank 0


def test_a_failed_rank_is_reported_with_its_traceback_not_a_hang():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)rank 0 of 2 failed:.*AssertionError: boom on rank 0"):
        spawn_group(_rank0_fails, 2, timeout_s=60)
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("slow", [True, False])
def test_rank0_job_longer_than_the_collectives_timeout(slow):
    """Data preparation at a run's first use runs on rank 0 while the others wait: longer than
    train.dist_timeout_s (here 2 s against a 5 s job), the wait on the world's group ends the run
    (gloo raises; NCCL's watchdog aborts), `on_main(..., slow=True)` waits on its own CPU group."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "tests/slow_main_harness.py", "slow" if slow else "fast"], cwd=repo, capture_output=True,
                       text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if slow:
        assert r.returncode == 0, r.stderr[-2000:]
        assert "rank 0: prepared" in r.stdout and "rank 1: None" in r.stdout
    else:
        assert r.returncode != 0 and "rank 1: None" not in r.stdout
