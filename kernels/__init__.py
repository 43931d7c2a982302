"""Triton kernels of moefp8, each beside its wrapper and its pure-PyTorch `_ref` twin.

Installed as `moefp8.kernels` (the top-level folder is `kernels/`).
"""
