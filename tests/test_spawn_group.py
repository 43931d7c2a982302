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
