"""`scope(name)`: a named range for torch.profiler (record_function) while a profiler records, else nothing.

The MoE path opens ~19 ranges per layer and micro-batch (router, quant, dispatch, fc1, ..., bwd_combine):
~1,000 a step on the 16B preset with the overlap. `torch.profiler.record_function` costs a dispatcher call
in and out even when nothing records (~4 us on a 2-core CPU); a profiled step (tools/profile_step.py's
`scopes`, a user's torch.profiler) gets the same ranges as before.
"""

from contextlib import nullcontext

import torch
from torch.profiler import record_function


def scope(name: str):
    """A context manager: record_function(name) while a profiler records, else a no-op."""
    return record_function(name) if torch.autograd._profiler_enabled() else nullcontext()
