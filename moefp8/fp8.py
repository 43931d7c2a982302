"""The FP8 tensor format of the recipe (docs/design.md §1).

Elements are E4M3 (``torch.float8_e4m3fn``, max 448) for activations, weights and gradients.
Each 128-element tile carries one fp32 scale, ``x ~= q * s``. Three tile layouts:

=========  =====================  ==================================  ==============================
layout     logical x              data (stored)                       scale (fp32)
=========  =====================  ==================================  ==============================
"1x128"    [..., K]               [..., K]            row-wise        [..., K/128]
"128x1"    [M, K]                 [K, M] = xᵀ, so the contraction     [K, ceil(M/128)]
                                  dim M is contiguous (K-major for
                                  the wgrad GEMM, as FP8 wgmma needs)
"128x128"  [..., N, K]            [..., N, K]                         [..., ceil(N/128), K/128]
=========  =====================  ==================================  ==============================

A "128x1" tensor is the "1x128" quantization of xᵀ; the last tile along M may be partial (the
tiles are padded with zeros for the amax, nothing is stored past M).

Scale storage: a scale grid is a 2-D (or 3-D) tensor of the shape above with any strides.
"128x1" scales are always stored column-major (memory [ceil(M/128), K], the tensor its
transposed view, `col_major`): the layout cuBLAS's blockwise `_scaled_mm` and the grouped
GEMMs read, so the wgrad GEMMs need no transposing copy. "1x128" scales are row-major unless the
producer was asked for ``colmajor_scale=True`` (memory [K/128, M]), which the kernels do for
GEMM operands; every kernel that reads scales takes both strides.

Scale formats (one switch for the whole recipe): ``"pow2"`` (default) stores
``s = 2**ceil(log2(amax/448))`` so ``x/s`` is exact and only the FP8 cast rounds; ``"fp32"``
stores ``s = amax/448``. amax is clamped to >= `AMAX_MIN` = 1e-30, only so that an all-zero
tile gets a finite, normal scale (2**-108; 1/s = 2**108 and its UE8M0 byte stay in range).
Where bytes matter (dispatch payloads, cached activations) pow2 scales travel as UE8M0 bytes
(``exponent + 127``): see `pack_ue8m0` / `unpack_ue8m0`.

Non-finite input (both formats): NaN elements are ignored by the tile's amax and stay NaN;
an Inf makes its tile's scale Inf, so the whole tile dequantizes to NaN. Non-finite input
never turns into finite output.
"""

from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
TILE = 128  # quantization tile length along the contraction dimension
# The first design clamped amax at 1e-4, as DeepSeek's reference casts of activations do (docs/design.md
# §1). Gradients are far smaller: training the small model at 16k tokens per step, the median
# backward 1x128 tile has scale 2**-25 at step 1 and 2**-29..2**-31 later, so the 1e-4 floor (scale 2**-22) left them
# 2**3..2**9 below their own scale, their values in E4M3's subnormals or flushed to 0. Measured on
# H200s (bench/notes/convergence.md, session 8), 32 x 1024 tokens: FP8 vs BF16 mean loss gap +0.55%
# with 1e-4, +0.07% with 1e-30; the clamp now only keeps 0/0 out.
AMAX_MIN = 1e-30
SCALE_FMTS = ("pow2", "fp32")
LAYOUTS = ("1x128", "128x1", "128x128")


class Fp8Tensor(NamedTuple):
    """FP8 data + fp32 scales + tile layout (see the module docstring for shapes)."""

    data: Tensor  # float8_e4m3fn
    scale: Tensor  # float32, one per tile
    layout: str  # "1x128" | "128x1" | "128x128"

    @property
    def shape(self) -> torch.Size:
        """Logical shape of the quantized tensor (for "128x1", that of x, not of data)."""
        return self.data.t().shape if self.layout == "128x1" else self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """q * s with the logical shape; for "128x1" a transposed view of the stored order."""
        if self.layout == "1x128":
            x = self.data.float() * _expand_last(self.scale, self.data.shape[-1])
        elif self.layout == "128x1":
            x = (self.data.float() * _expand_last(self.scale, self.data.shape[-1])).t()
        elif self.layout == "128x128":
            n, k = self.data.shape[-2:]
            s = _expand_last(self.scale, k)
            s = _expand_last(s.transpose(-1, -2), n).transpose(-1, -2)
            x = self.data.float() * s
        else:
            raise ValueError(f"unknown FP8 layout {self.layout!r}, expected one of {LAYOUTS}")
        return x.to(dtype)


def col_major(s: Tensor) -> Tensor:
    """The same 2-D grid stored column-major (a copy unless it already is): strides (1, rows)."""
    return s.t().contiguous().t()


def record_stream(stream, *objs) -> None:
    """Tensors made on one CUDA stream and read on `stream` (also inside Fp8Tensors and nested
    tuples or lists): tell the caching allocator, so their memory is not reused before `stream` is
    done with them. Nothing for stream None or CPU tensors."""
    if stream is None:
        return
    for o in objs:
        if isinstance(o, Tensor):
            if o.is_cuda:
                o.record_stream(stream)
        elif isinstance(o, (tuple, list)):  # an Fp8Tensor is a tuple too: its data and scale
            record_stream(stream, *o)


def _expand_last(s: Tensor, n: int) -> Tensor:
    """[..., ceil(n/128)] -> [..., n] by repeating each scale over its tile."""
    return s.repeat_interleave(TILE, dim=-1)[..., :n]


def check_scale_fmt(scale_fmt: str) -> bool:
    """Validates the recipe's scale format; returns True for power-of-two scales."""
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt={scale_fmt!r}: expected one of {SCALE_FMTS}")
    return scale_fmt == "pow2"


def pack_ue8m0(scale: Tensor, check: bool = True) -> Tensor:
    """fp32 power-of-two scales -> uint8 biased exponents (UE8M0: byte = exponent + 127).

    Raises if a scale is not a positive power of two (fp32-format scales cannot be packed); the
    check reads a flag on the host, so hot paths that validate otherwise pass check=False (the
    dispatch checks on the device, in its layout kernel). Inf packs to 255 and unpacks to Inf.
    """
    bits = scale.float().contiguous().view(torch.int32)
    if not check:
        return (bits >> 23).to(torch.uint8)
    bad = (bits & 0x807FFFFF) != 0  # sign bit or mantissa set: not a positive power of two
    if bool(bad.any()):
        v = scale.reshape(-1)[bad.reshape(-1).nonzero()[0, 0]].item()
        raise ValueError(f"pack_ue8m0: scale {v!r} is not a positive power of two (use scale_fmt='pow2')")
    return (bits >> 23).to(torch.uint8)


def unpack_ue8m0(e8: Tensor) -> Tensor:
    """uint8 biased exponents -> fp32 scales 2**(e8 - 127) (byte 0 maps to 0.0, never produced)."""
    return (e8.to(torch.int32) << 23).view(torch.float32)


class ScaleStats:
    """Statistics of the FP8 tile scales the recipe makes, recorded while `on`. A model owns one
    (`moefp8.model.Transformer.scale_stats`) and hands it to every layer that quantizes; the training
    loop turns it on for one step every `train.fp8_stats_every`. Per kind, "act" (activations
    quantized for a GEMM or the dispatch) and "grad" (output gradients quantized for dgrad/wgrad):
    the tiles, the share at the amax-clamp floor (all-zero tiles, or, with a clamp that bites, tiles
    too small for their own scale: what exposed the old 1e-4 clamp on gradients) and the mean and
    min log2 of the other finite scales. Sums stay on the device; `report` reads them once and resets.
    """

    def __init__(self):
        self.on = False
        self._rows: dict[str, list[Tensor]] = {}

    @contextmanager
    def paused(self):
        """Records nothing inside (a recomputation in the backward: its tiles were counted once)."""
        on, self.on = self.on, False
        try:
            yield
        finally:
            self.on = on

    def record(self, kind: str, q: Fp8Tensor, src_M: Tensor | None = None) -> Fp8Tensor:
        """Records q's scales (while `on`); returns q, so a call can wrap the quantization. src_M: for
        a "1x128" q [M, C] of permuted rows, the layout's `src_M` (-1 on padding rows): only the routed
        rows' tiles count (the padding is zeros, or whatever a GEMM leaves past the last segment)."""
        if not self.on or q.scale.numel() == 0:
            return q
        s = q.scale.detach().float()
        ok = torch.ones_like(s, dtype=torch.bool) if src_M is None else (src_M >= 0)[:, None].expand_as(s)
        at_floor = (s < 2 * AMAX_MIN / FP8_MAX) & ok
        fin = torch.isfinite(s) & ~at_floor & ok  # the mean and min are over the other tiles
        l2 = torch.where(fin, s, torch.ones_like(s)).log2()
        # one row per tensor, made on the producer's stream (the overlap schedule quantizes on two):
        # nothing is accumulated across streams before `report` synchronizes
        self._rows.setdefault(kind, []).append(torch.stack([
            ok.sum().float(), at_floor.sum().float(), l2.sum(), fin.sum().float(),
            torch.where(fin, l2, torch.full_like(l2, 1e9)).min()]))
        return q

    def report(self) -> dict[str, float]:
        """{"fp8/<kind>_tiles", "fp8/<kind>_at_floor" (share), "fp8/<kind>_log2_scale_mean", "..._min"}."""
        if any(r[0].is_cuda for r in self._rows.values()):
            torch.cuda.synchronize()
        out = {}
        for kind, rows in sorted(self._rows.items()):
            r = torch.stack(rows)
            n, floor, l2sum, nfin = r[:, :4].sum(0).tolist()
            out[f"fp8/{kind}_tiles"] = n
            out[f"fp8/{kind}_at_floor"] = floor / n
            if nfin:
                out[f"fp8/{kind}_log2_scale_mean"] = l2sum / nfin
                out[f"fp8/{kind}_log2_scale_min"] = r[:, 4].min().item()
        self._rows.clear()
        return out
