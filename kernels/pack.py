"""Gather tokens into send order and pack each into one wire row, in one pass (the all_to_all
dispatch's send buffer; the row format is described in `moefp8.dispatch.all_to_all`).

    row s (token t = send_tok[s]):
      | topk_w fp32 [K] | topk_idx int32 [K] | data (FP8 H bytes or BF16 2H) | scales | pad |
    (no routing fields when topk_* are None; scales: UE8M0 bytes, fp32 words, or none for BF16)

`pack_rows` (Triton on CUDA) and `pack_rows_ref` (torch: concatenate, then gather) give the same
bytes, pad bytes excepted (left unwritten by the kernel, zero in the reference).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from moefp8.fp8 import Fp8Tensor, pack_ue8m0
from moefp8.kernels import use_triton


@triton.jit
def _pack_rows_kernel(tok_ptr, w_ptr, idx_ptr, x_ptr, s_ptr, out_ptr, K, DATA_WORDS, G, stride_x, stride_s,
                      ROW_WORDS, HAS_ROUTE: tl.constexpr, SCALES: tl.constexpr, K_PAD: tl.constexpr,
                      G_PAD: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    t = tl.load(tok_ptr + s).to(tl.int64)
    row = out_ptr + s * ROW_WORDS  # int32 words
    off = 0
    if HAS_ROUTE:
        k = tl.arange(0, K_PAD)
        w = tl.load(w_ptr + t * K + k, mask=k < K)
        i = tl.load(idx_ptr + t * K + k, mask=k < K)
        tl.store(row + k, w.to(tl.int32, bitcast=True), mask=k < K)
        tl.store(row + K + k, i, mask=k < K)
        off = 2 * K
    for c in range(0, DATA_WORDS, BLOCK):  # data as int32 words (H and 2H are multiples of 4 bytes)
        j = c + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + t * stride_x + j, mask=j < DATA_WORDS)
        tl.store(row + off + j, v, mask=j < DATA_WORDS)
    off += DATA_WORDS
    g = tl.arange(0, G_PAD)
    if SCALES == 1:  # UE8M0: one byte per scale, the fp32 exponent field
        sc = tl.load(s_ptr + t * stride_s + g, mask=g < G)
        e8 = ((sc.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)
        tl.store((row + off).to(tl.pointer_type(tl.uint8)) + g, e8, mask=g < G)
    if SCALES == 2:  # fp32 scales as words
        sc = tl.load(s_ptr + t * stride_s + g, mask=g < G)
        tl.store(row + off + g, sc.to(tl.int32, bitcast=True), mask=g < G)


def pack_rows(x, send_tok: Tensor, row_bytes: int, scales: str, topk_idx: Tensor | None = None,
              topk_w: Tensor | None = None, impl: str | None = None) -> Tensor:
    """x: "1x128" Fp8Tensor [T, H] or bf16 [T, H]; send_tok int64 [S]; scales "ue8m0"|"fp32"|"none"
    -> uint8 [S, row_bytes] (row_bytes a multiple of 16, as `row_bytes()` of the dispatcher)."""
    data = x.data if isinstance(x, Fp8Tensor) else x
    if not use_triton(data, impl):
        return pack_rows_ref(x, send_tok, row_bytes, scales, topk_idx, topk_w)
    S = send_tok.numel()
    out = torch.empty(S, row_bytes, dtype=torch.uint8, device=data.device)
    if S == 0:
        return out
    data = data if data.stride(-1) == 1 else data.contiguous()
    words = data.view(torch.int32)  # [T, bytes/4]: H % 128 == 0 under FP8, 2H for BF16
    sc = x.scale.float().contiguous() if isinstance(x, Fp8Tensor) else words
    G = sc.shape[1] if isinstance(x, Fp8Tensor) else 0
    K = topk_idx.shape[1] if topk_idx is not None else 0
    w = topk_w.float().contiguous() if topk_w is not None else words
    idx = topk_idx.int().contiguous() if topk_idx is not None else words
    _pack_rows_kernel[(S,)](send_tok, w, idx, words, sc, out.view(torch.int32), K, words.shape[1], G,
                            words.stride(0), sc.stride(0), row_bytes // 4, HAS_ROUTE=topk_idx is not None,
                            SCALES={"none": 0, "ue8m0": 1, "fp32": 2}[scales],
                            K_PAD=triton.next_power_of_2(max(K, 1)), G_PAD=triton.next_power_of_2(max(G, 1)),
                            BLOCK=1024, num_warps=4)
    return out


def pack_rows_ref(x, send_tok: Tensor, row_bytes: int, scales: str, topk_idx: Tensor | None = None,
                  topk_w: Tensor | None = None) -> Tensor:
    def as_bytes(t: Tensor) -> Tensor:
        return t.contiguous().view(torch.uint8) if t.numel() else torch.empty(
            t.shape[0], t.shape[1] * t.element_size(), dtype=torch.uint8, device=t.device)

    parts = []
    if topk_idx is not None:
        parts += [as_bytes(topk_w.float()), as_bytes(topk_idx.int())]
    parts.append(as_bytes(x.data if isinstance(x, Fp8Tensor) else x))
    if scales == "ue8m0":
        parts.append(pack_ue8m0(x.scale, check=False))
    elif scales == "fp32":
        parts.append(as_bytes(x.scale.float()))
    used = sum(p.shape[1] for p in parts)
    if row_bytes > used:
        parts.append(torch.zeros(parts[0].shape[0], row_bytes - used, dtype=torch.uint8, device=parts[0].device))
    return torch.cat(parts, dim=1).index_select(0, send_tok)
