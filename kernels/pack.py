"""Gather tokens into send order and pack each into one wire row, in one pass (the all_to_all
dispatch's send buffer; the row format is described in `moefp8.dispatch.all_to_all`).

    row s (token t = send_tok[s]):
      | topk_w fp32 [K] | topk_idx int32 [K] | data (FP8 H bytes or BF16 2H) | scales | pad |
    (no routing fields when topk_* are None; scales: UE8M0 bytes, fp32 words, or none for BF16)

`pack_rows` (Triton on CUDA) and `pack_rows_ref` (torch: concatenate, then gather) give the same
bytes, pad bytes excepted (left unwritten by the kernel, zero in the reference). With `dest`, the
expert ids are written as the destination rank's local ids.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from moefp8.fp8 import Fp8Tensor, pack_ue8m0
from moefp8.kernels import use_triton


@triton.jit
def _pack_rows_kernel(tok_ptr, dest_ptr, n_ptr, w_ptr, idx_ptr, x_ptr, s_ptr, out_ptr, K, E_LOCAL, DATA_WORDS, G,
                      stride_x, stride_s, ROW_WORDS, HAS_ROUTE: tl.constexpr, LOCAL_IDS: tl.constexpr,
                      SCALES: tl.constexpr, K_PAD: tl.constexpr, G_PAD: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    n = tl.load(n_ptr)  # rows at or past the device-side count are left unwritten
    t = tl.load(tok_ptr + s).to(tl.int64)
    row = out_ptr + s * ROW_WORDS  # int32 words
    off = 0
    if HAS_ROUTE:
        k = tl.arange(0, K_PAD)
        km = (k < K) & (k * 0 + s < n)  # tensor-shaped masks (the interpreter wants them)
        w = tl.load(w_ptr + t * K + k, mask=km)
        i = tl.load(idx_ptr + t * K + k, mask=km)
        if LOCAL_IDS:  # global ids -> the destination rank's local ids, -1 for experts elsewhere
            r = tl.load(dest_ptr + s).to(tl.int32)
            i = tl.where((i >= 0) & (i // E_LOCAL == r), i - r * E_LOCAL, -1)
        tl.store(row + k, w.to(tl.int32, bitcast=True), mask=km)
        tl.store(row + K + k, i, mask=km)
        off = 2 * K
    for c in range(0, DATA_WORDS, BLOCK):  # data as int32 words (H and 2H are multiples of 4 bytes)
        j = c + tl.arange(0, BLOCK)
        jm = (j < DATA_WORDS) & (j * 0 + s < n)
        v = tl.load(x_ptr + t * stride_x + j, mask=jm)
        tl.store(row + off + j, v, mask=jm)
    off += DATA_WORDS
    g = tl.arange(0, G_PAD)
    gm = (g < G) & (g * 0 + s < n)
    if SCALES == 1:  # UE8M0: one byte per scale, the fp32 exponent field
        sc = tl.load(s_ptr + t * stride_s + g, mask=gm)
        e8 = ((sc.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)
        tl.store((row + off).to(tl.pointer_type(tl.uint8)) + g, e8, mask=gm)
    if SCALES == 2:  # fp32 scales as words
        sc = tl.load(s_ptr + t * stride_s + g, mask=gm)
        tl.store(row + off + g, sc.to(tl.int32, bitcast=True), mask=gm)


def pack_rows(x, send_tok: Tensor, row_bytes: int, scales: str, topk_idx: Tensor | None = None,
              topk_w: Tensor | None = None, dest: Tensor | None = None, experts_per_rank: int = 0,
              n_valid: Tensor | None = None, impl: str | None = None) -> Tensor:
    """x: "1x128" Fp8Tensor [T, H] or bf16 [T, H]; send_tok int64 [S]; scales "ue8m0"|"fp32"|"none"
    -> uint8 [S, row_bytes] (row_bytes a multiple of 16, as `row_bytes()` of the dispatcher).

    dest int64 [S] (with experts_per_rank): row s goes to rank dest[s]; its topk ids are written
    as that rank's local ids (-1 for experts on other ranks). n_valid: a device scalar; rows at or
    past it are not written (the send buffer can be packed before the host knows its length)."""
    data = x.data if isinstance(x, Fp8Tensor) else x
    if not use_triton(data, impl):
        return pack_rows_ref(x, send_tok, row_bytes, scales, topk_idx, topk_w, dest, experts_per_rank)
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
    n = n_valid if n_valid is not None else torch.full((), S, dtype=torch.int64, device=data.device)
    _pack_rows_kernel[(S,)](send_tok, dest if dest is not None else send_tok, n, w, idx, words, sc,
                            out.view(torch.int32), K, max(experts_per_rank, 1), words.shape[1], G,
                            words.stride(0), sc.stride(0), row_bytes // 4, HAS_ROUTE=topk_idx is not None,
                            LOCAL_IDS=dest is not None, SCALES={"none": 0, "ue8m0": 1, "fp32": 2}[scales],
                            K_PAD=triton.next_power_of_2(max(K, 1)), G_PAD=triton.next_power_of_2(max(G, 1)),
                            BLOCK=1024, num_warps=4)
    return out


def pack_rows_ref(x, send_tok: Tensor, row_bytes: int, scales: str, topk_idx: Tensor | None = None,
                  topk_w: Tensor | None = None, dest: Tensor | None = None, experts_per_rank: int = 0) -> Tensor:
    def as_bytes(t: Tensor) -> Tensor:
        return t.contiguous().view(torch.uint8) if t.numel() else torch.empty(
            t.shape[0], t.shape[1] * t.element_size(), dtype=torch.uint8, device=t.device)

    parts = []
    if topk_idx is not None:
        parts += [as_bytes(topk_w.float()), as_bytes(topk_idx.int())]
    parts.append(as_bytes(x.data if isinstance(x, Fp8Tensor) else x))
    ids = None
    if topk_idx is not None and dest is not None:  # local ids of each row's destination rank
        g = topk_idx.long()[send_tok]
        r = dest.long()[:, None]
        ids = torch.where((g >= 0) & (g // experts_per_rank == r), g - r * experts_per_rank, -1).int()
    if scales == "ue8m0":
        parts.append(pack_ue8m0(x.scale, check=False))
    elif scales == "fp32":
        parts.append(as_bytes(x.scale.float()))
    used = sum(p.shape[1] for p in parts)
    if row_bytes > used:
        parts.append(torch.zeros(parts[0].shape[0], row_bytes - used, dtype=torch.uint8, device=parts[0].device))
    out = torch.cat(parts, dim=1).index_select(0, send_tok)
    if ids is not None:
        K = topk_idx.shape[1]
        out[:, 4 * K:8 * K] = as_bytes(ids)
    return out
