"""Triton kernels of moefp8, each beside its wrapper and its pure-PyTorch `_ref` twin.

Installed as `moefp8.kernels` (the top-level folder is `kernels/`).
"""


def use_triton(x, impl: str | None) -> bool:
    """The wrappers' dispatch rule: impl None -> the Triton kernel for CUDA tensors, the reference
    for CPU ones; "triton" forces the kernel (on CPU tensors under TRITON_INTERPRET=1); "ref"
    forces the reference."""
    if impl is None:
        return x.is_cuda
    if impl not in ("triton", "ref"):
        raise ValueError(f"impl={impl!r}: expected None, 'triton' or 'ref'")
    return impl == "triton"
