"""DeepGEMM's m-grouped FP8 GEMM on moefp8's operands, where `deep_gemm` is installed (issue
"Grouped FP8 GEMMs at DeepGEMM's speed"; docs/design.md §1 for the formats).

DeepGEMM (github.com/deepseek-ai/DeepGEMM) is not on PyPI: it is built by hand, and its kernels
compile at the first call of each shape. Nothing here imports it unless asked (`load`), so moefp8
runs the same without it (CPU, CI).

Both libraries compute out[m] = a[m] · b[e]ᵀ for the rows m of expert e's segment with "1x128"
activation tiles and "128x128" weight blocks, FP32 promotion every 128 of K: the same operands
go to DeepGEMM untouched (its API takes the FP8 data with fp32 scales and lays the scales out for
TMA itself). What differs is how the segments are named: moefp8 passes group offsets (each
expert's rows contiguous, padded to 128), DeepGEMM one expert index per row (`m_indices`, -1 on
rows of no expert).

    m_idx = m_indices(off, M)                 # once per layout
    out = m_grouped(a8, w8, m_idx, dg)        # dg = load()

The k-grouped wgrad (dW[e] = dY_eᵀ · X_e, FP32, "128x1" operands with a scale per 128 tokens) has
the same numerics in both, but DeepGEMM wants each expert's [N, k_e] block of a "128x1" operand
stored whole (`k_grouped_operand`: one copy, made outside any timing) where moefp8's kernel reads
the expert's columns of the one [N, M] array in place:

    dy_k, x_k = k_grouped_operand(dy_col, ks), k_grouped_operand(x_col, ks)   # ks: rows per expert
    dw = k_grouped(dy_k, x_k, ks, dg)                                          # [E, N, K] fp32
"""

from itertools import accumulate

import torch
from torch import Tensor

from moefp8.fp8 import Fp8Tensor

INSTALL = ("DeepGEMM is not on PyPI: build it from https://github.com/deepseek-ai/DeepGEMM (clone it with its "
           "submodules, link third-party/cutlass/include/{cutlass,cute} into deep_gemm/include, then "
           "`CC=gcc CXX=g++ python setup.py build` and put the build on PYTHONPATH)")


def load():
    """The `deep_gemm` module, or None where it does not import (not installed, no CUDA)."""
    try:
        import deep_gemm
    except ImportError:
        return None
    return deep_gemm


def m_indices(offsets, M: int) -> Tensor:
    """int32 [M]: the expert of each row by the group offsets (E + 1 ascending row indices from 0,
    a tensor on the rows' device or a list), -1 on rows past the last segment (DeepGEMM's
    `grouped_layout`). No host sync: row m belongs to the expert whose segment end is the first
    one past m."""
    off = torch.as_tensor(offsets)
    ends = off[1:].to(torch.int64).contiguous()
    e = torch.searchsorted(ends, torch.arange(M, dtype=torch.int64, device=off.device), right=True)
    return torch.where(e < ends.numel(), e, -1).to(torch.int32)


def m_grouped(a: Fp8Tensor, b: Fp8Tensor, m_idx: Tensor, dg, out: Tensor | None = None) -> Tensor:
    """BF16 [M, N] = a [M, K] ("1x128") · b[e]ᵀ ([E, N, K], "128x128") per row's expert m_idx (int32
    [M]; -1: a row of no expert, whose output is DeepGEMM's to fill), by
    `dg.m_grouped_fp8_gemm_nt_contiguous`. dg: the module `load()` returned."""
    if a.layout != "1x128" or b.layout != "128x128":
        raise ValueError(f"deepgemm.m_grouped: expects a '1x128' and b '128x128', got {a.layout!r} and {b.layout!r}")
    M, K = a.data.shape
    E, N, Kb = b.data.shape
    if K != Kb or m_idx.shape != (M,) or m_idx.dtype != torch.int32:
        raise ValueError(f"deepgemm.m_grouped: a [{M}, {K}], b [{E}, {N}, {Kb}], m_idx {m_idx.dtype} "
                         f"{tuple(m_idx.shape)}: need equal K and int32 [M]")
    out = torch.empty(M, N, dtype=torch.bfloat16, device=a.data.device) if out is None else out
    if M:
        # the scales as fp32 (DeepGEMM lays them out for TMA itself); pow2 scales stay exact under
        # its UE8M0 cast, so the cast is left as DeepGEMM configures it
        dg.m_grouped_fp8_gemm_nt_contiguous((a.data, a.scale.float()), (b.data, b.scale.float()), out,
                                            m_idx.contiguous())
    return out


def k_grouped_operand(t: Fp8Tensor, ks: list[int]) -> tuple[Tensor, Tensor]:
    """A "128x1" operand (data [N, M], scales [N, M/128] stored column-major) as DeepGEMM's
    k-grouped operand: (each expert's [N, k_e] block contiguous, flattened; the same scales, whose
    layout is DeepGEMM's). ks: rows per expert, multiples of 128 summing to M."""
    if t.layout != "128x1":
        raise ValueError(f"deepgemm.k_grouped_operand: expects a '128x1' operand, got {t.layout!r}")
    N, M = t.data.shape
    if sum(ks) != M or any(k % 128 for k in ks):
        raise ValueError(f"deepgemm.k_grouped_operand: ks={ks} must be multiples of 128 summing to the {M} tokens")
    data = torch.cat([t.data[:, e - k:e].reshape(-1) for k, e in zip(ks, accumulate(ks))]) if M else t.data.reshape(-1)
    return data, t.scale.float()


def k_grouped(dy: tuple[Tensor, Tensor], x: tuple[Tensor, Tensor], ks: list[int], dg, out: Tensor | None = None,
              ks_dev: Tensor | None = None) -> Tensor:
    """FP32 [E, N, K]: out[e] (+)= dY_eᵀ · X_e by `dg.k_grouped_fp8_gemm_nt_contiguous` (accumulates into
    out when given, else into zeros). dy, x: `k_grouped_operand` of the "128x1" dY [M, N] and X [M, K];
    ks: rows per expert (host list; ks_dev: the same as an int32 tensor on the GPU, made here if None)."""
    E, N, K = len(ks), dy[1].shape[0], x[1].shape[0]
    if out is None:
        out = torch.zeros(E, N, K, dtype=torch.float32, device=dy[0].device)
    if ks_dev is None:
        ks_dev = torch.tensor(ks, dtype=torch.int32, device=dy[0].device)
    if sum(ks):
        dg.k_grouped_fp8_gemm_nt_contiguous(dy, x, out, ks, ks_dev, out)
    return out
