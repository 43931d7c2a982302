"""The low-precision copy of a weight that its GEMMs read, kept on the parameter and refreshed by the
optimizer's update (docs/design.md §1).

The FP8 recipe's GEMMs read each weight as "128x128" FP8, and its backward the transposed copy for
dgrad (`quant_weight(transposed=True)`: both from one pass); the BF16 recipe's (and the LM head's, in
both recipes) a BF16 cast. `copy_of(w, fmt)` makes that copy once, the first time a forward asks, and
stores it on the parameter (`w.low_copy`, a `WeightCopy`). From then on the optimizer writes the new
copy into the same buffers in its own pass over the weight (`optim.AdamW.step` ->
`kernels.adamw.adamw_quant_step_` for FP8, `adamw_step_(low=)` for BF16): no step converts its weights
again, and a CUDA graph that captured a GEMM reading the copy reads each step's weights at its replays
(moefp8.graphs).

A copy records the parameter's version counter it matches. Where the weight changed outside the optimizer
(a checkpoint loaded, an in-place edit), the next eager request converts it again into the same buffers.
Under a CUDA graph capture nothing is made or refreshed: a copy that matches is returned (the graph reads its
buffers), otherwise None, and the caller converts inside the capture as before (`experts.WeightCache`).
"""

import torch
from torch import Tensor

from moefp8.fp8 import TILE
from moefp8.kernels.quant import quant_weight

BF16 = "bf16"  # the copy format of a BF16 cast; the FP8 ones are the scale formats, "pow2" | "fp32"


class WeightCopy:
    """A weight's low-precision copy (`low`) in `fmt`: the "128x128" FP8 quantization ("pow2" | "fp32")
    and, where a backward wants it, its transpose (`low_t`); or the BF16 cast ("bf16", no transpose);
    matching the parameter at version `version`."""

    def __init__(self, w: Tensor, fmt: str, transposed: bool):
        self.fmt = fmt
        if fmt == BF16:
            self.low, self.low_t = w.detach().to(torch.bfloat16), None
        elif transposed:
            self.low, self.low_t = quant_weight(w.detach(), fmt, transposed=True)
        else:
            self.low, self.low_t = quant_weight(w.detach(), fmt), None
        self.version = w._version

    def refresh_(self, w: Tensor) -> None:
        """Converts w again into the same buffers (which CUDA graphs may have captured)."""
        if self.fmt == BF16:
            self.low.copy_(w.detach())
        else:
            fresh = WeightCopy(w, self.fmt, self.low_t is not None)
            for dst, src in ((self.low, fresh.low), (self.low_t, fresh.low_t)):
                if dst is not None:
                    dst.data.copy_(src.data)
                    dst.scale.copy_(src.scale)
        self.version = w._version


def capturing(w: Tensor) -> bool:
    """Whether w's device stream is capturing a CUDA graph (moefp8.graphs)."""
    return w.is_cuda and torch.cuda.is_current_stream_capturing()


def copy_of(w: Tensor, fmt: str, transposed: bool = False) -> "WeightCopy | None":
    """w's persistent copy in `fmt` ("pow2" | "fp32": FP8, made with its transpose where w requires grad
    or `transposed` asks; "bf16"), made, or refreshed where w changed since; None under a CUDA graph
    capture where w has no copy that matches it, and for weights an FP8 copy does not cover (K or, for
    the transpose, N not a multiple of 128)."""
    want_t = fmt != BF16 and (transposed or w.requires_grad)
    if fmt != BF16:
        N, K = w.shape[-2:]
        if K % TILE or (want_t and N % TILE):
            return None
    c = getattr(w, "low_copy", None)
    current = c is not None and c.fmt == fmt and (c.low_t is not None or not want_t)
    if capturing(w):
        return c if current and c.version == w._version else None
    if not current:
        c = WeightCopy(w, fmt, want_t)
        w.low_copy = c
    elif c.version != w._version:
        c.refresh_(w)
    return c


def bf16_of(w: Tensor) -> Tensor:
    """W in BF16 for a GEMM: its copy (`copy_of(w, "bf16")`), or a cast where a capture has none."""
    c = copy_of(w, BF16)
    return c.low if c is not None else w.to(torch.bfloat16)
