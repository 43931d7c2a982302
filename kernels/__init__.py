"""Triton kernels of moefp8, each beside its wrapper and its pure-PyTorch `_ref` twin.

Installed as `moefp8.kernels` (the top-level folder is `kernels/`).
"""

import functools
import os

import torch


def use_triton(x, impl: str | None) -> bool:
    """The wrappers' dispatch rule: impl None -> the Triton kernel for CUDA tensors, the reference
    for CPU ones; "triton" forces the kernel (on CPU tensors under TRITON_INTERPRET=1); "ref"
    forces the reference."""
    if impl is None:
        return x.is_cuda
    if impl not in ("triton", "ref"):
        raise ValueError(f"impl={impl!r}: expected None, 'triton' or 'ref'")
    return impl == "triton"


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`: the persistent kernels' grid unit (4 on CPU tensors
    and under TRITON_INTERPRET=1, so that the interpreter runs several programs)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or device.type != "cuda":
        return 4
    return _cuda_sms(device_index(device))


def device_index(device: torch.device) -> int:
    """A CUDA device's index (`cuda` alone: the current device), a key for what is read once per GPU."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _cuda_sms(index: int) -> int:  # asked per launch (persistent grids): the properties read once
    return torch.cuda.get_device_properties(index).multi_processor_count
