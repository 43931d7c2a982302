"""moefp8.scope: the MoE path's named ranges exist under a profiler and cost nothing outside one."""

from contextlib import nullcontext

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from moefp8.scope import scope


def test_scope_records_under_a_profiler_only():
    assert isinstance(scope("fc1"), nullcontext)  # nothing records: no dispatcher call
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert isinstance(scope("fc1"), record_function)
        with scope("fc1"):
            torch.ones(4).sum()
    names = [e.name for e in prof.events()]
    assert "fc1" in names
    assert any(e.name == "aten::sum" and e.cpu_parent is not None and e.cpu_parent.name == "fc1"
               for e in prof.events())  # the op is charged to the range (profile_step's `scopes`)
    assert isinstance(scope("fc1"), nullcontext)  # and off again after it
