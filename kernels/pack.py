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
    idx = topk_idx.contiguous() if topk_idx is not None else words  # int32 or int64: stores cast
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


# ----------------------------------------------------------------------------------------------
# Dispatch layout: routes, counts, positions and input checks in one launch


@triton.jit
def _route_tile(idx_ptr, t, T, K, E, E_LOCAL, R, K_PAD: tl.constexpr, R_PAD: tl.constexpr):
    """-> (m [BLOCK_T, R_PAD] int32: token goes to rank, bad [BLOCK_T, K_PAD] bool, ids)."""
    k = tl.arange(0, K_PAD)
    ids = tl.load(idx_ptr + t[:, None] * K + k[None, :], mask=(t < T)[:, None] & (k < K)[None, :], other=-1)
    ids = ids.to(tl.int64)
    ok = (ids >= 0) & (ids < E)
    r_of = tl.where(ok, ids // E_LOCAL, R_PAD)
    r = tl.arange(0, R_PAD)
    m = tl.max((r_of[:, :, None] == r[None, None, :]).to(tl.int32), axis=1)  # dedupe over the k slots
    m = tl.where((t < T)[:, None] & (r < R)[None, :], m, 0)
    return m, (ids < -1) | (ids >= E), ids


@triton.jit
def _dispatch_layout_kernel(idx_ptr, sc_ptr, meta_ptr, pos_ptr, tok_ptr, dest_ptr, n_ptr, T, K, E, E_LOCAL, R, G,
                            ROW_BYTES, CHECK_SCALES: tl.constexpr, K_PAD: tl.constexpr, R_PAD: tl.constexpr,
                            G_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    r = tl.arange(0, R_PAD)
    counts = tl.zeros((R_PAD,), dtype=tl.int32)
    bad_any = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    bad_val = tl.full((BLOCK_T, K_PAD), -(2**62), dtype=tl.int64)
    for t0 in range(0, T, BLOCK_T):  # pass 1: tokens per destination rank, bad ids
        t = t0 + tl.arange(0, BLOCK_T)
        m, bad, ids = _route_tile(idx_ptr, t, T, K, E, E_LOCAL, R, K_PAD, R_PAD)
        counts += tl.sum(m, axis=0)
        bad_any = tl.maximum(bad_any, bad.to(tl.int32))
        bad_val = tl.maximum(bad_val, tl.where(bad, ids, -(2**62)))
    code = (tl.max(tl.max(bad_any, axis=1), axis=0) > 0).to(tl.int64)  # 1: a bad expert id
    val = tl.where(code > 0, tl.max(tl.max(bad_val, axis=1), axis=0), 0)
    if CHECK_SCALES:  # 2: a scale that is not a positive power of two (no UE8M0 byte for it)
        g = tl.arange(0, G_PAD)
        worst = tl.zeros((BLOCK_T, G_PAD), dtype=tl.int32)
        for t0 in range(0, T, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            sc = tl.load(sc_ptr + t[:, None] * G + g[None, :], mask=(t < T)[:, None] & (g < G)[None, :], other=1.0)
            bits = sc.to(tl.int32, bitcast=True)  # sign bit or mantissa set: not a positive power of two
            worst = tl.maximum(worst, ((bits < 0) | ((bits & 0x7FFFFF) != 0)).to(tl.int32))
        code = tl.where((code == 0) & (tl.max(tl.max(worst, axis=1), axis=0) > 0), 2, code)
    start = tl.cumsum(counts, axis=0) - counts  # each rank's first row in send order
    running = tl.zeros((R_PAD,), dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):  # pass 2: positions (rank, then token order), send_tok, dest
        t = t0 + tl.arange(0, BLOCK_T)
        m, bad, ids = _route_tile(idx_ptr, t, T, K, E, E_LOCAL, R, K_PAD, R_PAD)
        pos = start[None, :] + running[None, :] + tl.cumsum(m, axis=0) - m
        pos = tl.where(m > 0, pos, -1)
        tl.store(pos_ptr + t[:, None] * R + r[None, :], pos, mask=(t < T)[:, None] & (r < R)[None, :])
        tl.store(tok_ptr + pos, (t[:, None] + r[None, :] * 0).to(tl.int64), mask=m > 0)
        tl.store(dest_ptr + pos, (r[None, :] + t[:, None] * 0).to(tl.int64), mask=m > 0)
        running += tl.sum(m, axis=0)
    tl.store(n_ptr, tl.sum(counts, axis=0).to(tl.int64))
    rm = r < R  # the count exchange's rows: (rows, bytes per row, error code, offending value)
    tl.store(meta_ptr + r * 4, counts.to(tl.int64), mask=rm)
    tl.store(meta_ptr + r * 4 + 1, (r * 0 + ROW_BYTES).to(tl.int64), mask=rm)
    tl.store(meta_ptr + r * 4 + 2, (r * 0).to(tl.int64) + code, mask=rm)
    tl.store(meta_ptr + r * 4 + 3, (r * 0).to(tl.int64) + val, mask=rm)


def dispatch_layout(topk_idx: Tensor, num_experts: int, world: int, row_bytes: int, scale: Tensor | None = None,
                    impl: str | None = None):
    """topk_idx int [T, K] global ids -> (meta int64 [R, 4] = (rows, row_bytes, code, value) per
    destination rank, pos_TR int32 [T, R] (-1: not sent there), send_tok int64 [R*T] and dest int64
    [R*T] (the first n entries valid, rows by rank then token), n int64 scalar), all on the device,
    one launch. code 1: an id outside [-1, E) (value: the largest such id); code 2: `scale` given and
    holding a value that is not a positive power of two."""
    if not use_triton(topk_idx, impl):
        return dispatch_layout_ref(topk_idx, num_experts, world, row_bytes, scale)
    T, K = topk_idx.shape
    dev = topk_idx.device
    meta = torch.empty(world, 4, dtype=torch.int64, device=dev)
    pos = torch.empty(T, world, dtype=torch.int32, device=dev)
    tok = torch.empty(world * T, dtype=torch.int64, device=dev)
    dest = torch.empty(world * T, dtype=torch.int64, device=dev)
    n = torch.empty((), dtype=torch.int64, device=dev)
    idx = topk_idx.contiguous()
    sc = scale.float().contiguous() if scale is not None else meta
    G = sc.shape[1] if scale is not None else 1
    _dispatch_layout_kernel[(1,)](idx, sc, meta, pos, tok, dest, n, T, K, num_experts, num_experts // world, world,
                                  G, row_bytes, CHECK_SCALES=scale is not None,
                                  K_PAD=triton.next_power_of_2(max(K, 1)), R_PAD=triton.next_power_of_2(world),
                                  G_PAD=triton.next_power_of_2(G), BLOCK_T=128, num_warps=8)
    return meta, pos, tok, dest, n


def pairs_per_expert(topk_idx: Tensor, num_experts: int) -> Tensor:
    """topk_idx int [T, K] -> int64 [E]: the (token, slot) pairs routed to each expert; -1 (not routed) and
    ids outside [0, E) count nowhere. No host sync (a scatter-add, not bincount's min/max read-back)."""
    bins = (topk_idx.reshape(-1).long() + 1).clamp_(0, num_experts + 1)  # -1 -> 0, e -> e + 1, bad -> 0 or E + 1
    ones = torch.ones(1, dtype=torch.int64, device=bins.device).expand(bins.numel())
    return torch.zeros(num_experts + 2, dtype=torch.int64, device=bins.device).scatter_add_(0, bins, ones)[1:-1]


def dispatch_layout_ref(topk_idx: Tensor, num_experts: int, world: int, row_bytes: int, scale: Tensor | None = None):
    T, R = topk_idx.shape[0], world
    idx = topk_idx.long()
    ok = (idx >= 0) & (idx < num_experts)
    dest_TK = torch.where(ok, idx // (num_experts // world), R)
    mask = torch.zeros(T, R + 1, dtype=torch.bool, device=idx.device).scatter_(1, dest_TK, True)[:, :R]
    counts = mask.sum(0)
    order = torch.argsort((~mask.t().reshape(-1)).to(torch.int8), stable=True)  # set (rank, token) pairs first
    pos_flat = torch.empty(R * T, dtype=torch.int32, device=idx.device)
    pos_flat[order] = torch.arange(R * T, dtype=torch.int32, device=idx.device)
    pos = torch.where(mask, pos_flat.view(R, T).t(), -1)
    bad = (idx < -1) | (idx >= num_experts)
    code = bad.any().long()
    val = torch.where(bad, idx, torch.iinfo(torch.int64).min).amax() if idx.numel() else idx.new_zeros(())
    val = torch.where(code > 0, val, 0)
    if scale is not None and scale.numel():
        inval = ((scale.float().contiguous().view(torch.int32) & 0x807FFFFF) != 0).any()
        code = torch.where((code == 0) & inval, 2, code)
    meta = torch.stack([counts, torch.full_like(counts, row_bytes), code.expand(R), val.expand(R)], dim=1)
    return meta, pos, order % max(T, 1), order // max(T, 1), counts.sum()


# ----------------------------------------------------------------------------------------------
# Fixed-capacity send buffer: R blocks of CAP + 1 rows, token t at row t of every block, a header
# row last; routes, checks and positions computed in the same launch (no count exchange)

HDR_MAGIC = 0x4D6F4538  # "MoE8": a header row that did not arrive as sent reads as garbage
HDR_WORDS = 6  # int64 header fields: magic, row bytes, rows per block, tokens, error code, offending value
ERR_BAD_EXPERT, ERR_BAD_SCALE, ERR_OVER_CAPACITY = 1, 2, 3


@triton.jit
def _input_errors(idx_ptr, s_ptr, T, K, E, G, stride_s, CHECK_SCALES: tl.constexpr, K_PAD: tl.constexpr,
                     G_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """-> (code, value) over T tokens: 1 an id outside [-1, E) (value: the largest), 2 a scale that
    is not a positive power of two (CHECK_SCALES), 0 none. One program scans everything."""
    k = tl.arange(0, K_PAD)
    bad_any = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    bad_val = tl.full((BLOCK_T, K_PAD), -(2**62), dtype=tl.int64)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        ids = tl.load(idx_ptr + t[:, None] * K + k[None, :], mask=(t < T)[:, None] & (k < K)[None, :], other=-1)
        ids = ids.to(tl.int64)
        bad = (ids < -1) | (ids >= E)
        bad_any = tl.maximum(bad_any, bad.to(tl.int32))
        bad_val = tl.maximum(bad_val, tl.where(bad, ids, -(2**62)))
    code = (tl.max(tl.max(bad_any, axis=1), axis=0) > 0).to(tl.int64)
    val = tl.where(code > 0, tl.max(tl.max(bad_val, axis=1), axis=0), 0)
    if CHECK_SCALES:
        g = tl.arange(0, G_PAD)
        worst = tl.zeros((BLOCK_T, G_PAD), dtype=tl.int32)
        for t0 in range(0, T, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            sc = tl.load(s_ptr + t[:, None] * stride_s + g[None, :], mask=(t < T)[:, None] & (g < G)[None, :],
                         other=1.0)
            bits = sc.to(tl.int32, bitcast=True)
            worst = tl.maximum(worst, ((bits < 0) | ((bits & 0x7FFFFF) != 0)).to(tl.int32))
        code = tl.where((code == 0) & (tl.max(tl.max(worst, axis=1), axis=0) > 0), 2, code)
    return code, val


@triton.jit
def _pack_capacity_kernel(idx_ptr, w_ptr, x_ptr, s_ptr, out_ptr, pos_ptr, cnt_ptr, err_ptr, T, CAP, ROWS, K, E,
                          E_LOCAL, R, DATA_WORDS, G, stride_x, stride_s, ROW_WORDS, ROW_BYTES,
                          CHECK_SCALES: tl.constexpr, CAPPED: tl.constexpr, SCALES: tl.constexpr,
                          K_PAD: tl.constexpr, R_PAD: tl.constexpr, G_PAD: tl.constexpr, BLOCK: tl.constexpr):
    # Blocks of ROWS + 1 rows (the last the header). Not CAPPED (ROWS == CAP): one program per token
    # slot t < CAP, its row in every block r (row r * (CAP + 1) + t), the token read once. CAPPED:
    # pos [T, R] (input, `capped_positions`) holds each sent token's row, blocks compacted in token
    # order; programs q < max(min(T, CAP), ROWS) pack token q where it goes and write block r's row q
    # as unsent where q >= cnt[r] (its used rows). Then R programs for the header rows. The input
    # checks are spread over the token programs (atomics into err int64 [4]: bad id seen, the largest
    # bad id, bad scale seen, token programs done); the last token program to finish writes every
    # block's header fields (with no token to check, the header programs write them).
    q = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, K_PAD)
    km = k < K
    n = tl.minimum(T, CAP)
    if q < tl.maximum(n, ROWS):
        t = q
        live = k * 0 + t < T  # tensor-shaped masks: the interpreter refuses a scalar-broadcast one
        ids = tl.load(idx_ptr + t * K + k, mask=km & live, other=-1).to(tl.int64)
        w = tl.load(w_ptr + t * K + k, mask=km & live, other=0.0)
        rr = tl.arange(0, R_PAD)
        prow = tl.full((R_PAD,), -1, dtype=tl.int64)  # CAPPED: token t's row in each block (-1: not sent)
        if CAPPED:
            prow = tl.load(pos_ptr + t * R + rr, mask=(rr < R) & (rr * 0 + t < n), other=-1).to(tl.int64)
        for r in range(R):  # the routing fields of the rows t takes, or of unsent rows, and where t went
            mine = (ids >= r * E_LOCAL) & (ids < (r + 1) * E_LOCAL)
            if CAPPED:
                if t < n:
                    p = tl.max(tl.where(rr == r, prow, -1), axis=0)
                    if p >= 0:
                        tl.store(out_ptr + p * ROW_WORDS + k, w.to(tl.int32, bitcast=True), mask=km)
                        tl.store(out_ptr + p * ROW_WORDS + K + k, tl.where(mine, ids - r * E_LOCAL, -1).to(tl.int32),
                                 mask=km)
                if t < ROWS:
                    if t >= tl.load(cnt_ptr + r):
                        row = out_ptr + (r * (ROWS + 1) + t) * ROW_WORDS
                        tl.store(row + k, tl.zeros((K_PAD,), dtype=tl.int32), mask=km)
                        tl.store(row + K + k, tl.full((K_PAD,), -1, dtype=tl.int32), mask=km)
            else:
                hit = _sends_to(ids, r, E_LOCAL)
                row = out_ptr + (r * (CAP + 1) + t) * ROW_WORDS  # int32 words
                tl.store(row + k, tl.where(hit, w, 0.0).to(tl.int32, bitcast=True), mask=km)
                tl.store(row + K + k, tl.where(mine, ids - r * E_LOCAL, -1).to(tl.int32), mask=km)
                if t < T:
                    tl.store(pos_ptr + t * R + r, tl.where(hit, r * (CAP + 1) + t, -1).to(tl.int32))
        if t < n:
            # the payload: read once, written into each destination's row
            for c in range(0, DATA_WORDS, BLOCK):
                j = c + tl.arange(0, BLOCK)
                v = tl.load(x_ptr + t * stride_x + j, mask=j < DATA_WORDS)
                for r in range(R):
                    p = _row_of(prow, rr, ids, t, r, CAP, E_LOCAL, CAPPED)
                    if p >= 0:
                        tl.store(out_ptr + p * ROW_WORDS + 2 * K + j, v, mask=j < DATA_WORDS)
            g = tl.arange(0, G_PAD)
            if SCALES > 0:
                sc = tl.load(s_ptr + t * stride_s + g, mask=g < G, other=1.0)
                bits = sc.to(tl.int32, bitcast=True)
                for r in range(R):
                    p = _row_of(prow, rr, ids, t, r, CAP, E_LOCAL, CAPPED)
                    if p >= 0:
                        srow = out_ptr + p * ROW_WORDS + 2 * K + DATA_WORDS
                        if SCALES == 1:
                            tl.store(srow.to(tl.pointer_type(tl.uint8)) + g, ((bits >> 23) & 0xFF).to(tl.uint8),
                                     mask=g < G)
                        else:
                            tl.store(srow + g, bits, mask=g < G)
                if CHECK_SCALES:  # a scale that is not a positive power of two
                    if tl.max(((bits < 0) | ((bits & 0x7FFFFF) != 0)).to(tl.int32), axis=0) > 0:
                        tl.atomic_max(err_ptr + 2, 1)
            bad = km & ((ids < -1) | (ids >= E))
            if tl.max(bad.to(tl.int32), axis=0) > 0:
                tl.atomic_max(err_ptr + 1, tl.max(tl.where(bad, ids, -(2**62)), axis=0))
                tl.atomic_max(err_ptr, 1)
            if tl.atomic_add(err_ptr + 3, 1, sem="acq_rel") == n - 1:  # the last checker: every header
                bad_id, bad_scale = tl.atomic_add(err_ptr, 0) > 0, tl.atomic_add(err_ptr + 2, 0) > 0
                code = tl.where(bad_id, 1, tl.where(bad_scale, 2, 0))
                val = tl.where(bad_id, tl.atomic_add(err_ptr + 1, 0), 0)
                for r in range(R):
                    _write_header(out_ptr + (r * (ROWS + 1) + ROWS) * ROW_WORDS + 2 * K, T, CAP, ROWS, ROW_BYTES,
                                  code, val)
    else:  # block r's header row: no expert (-1 ids); the fields where the data goes
        row = out_ptr + ((q - tl.maximum(n, ROWS)) * (ROWS + 1) + ROWS) * ROW_WORDS
        tl.store(row + k, tl.zeros((K_PAD,), dtype=tl.int32), mask=km)
        tl.store(row + K + k, tl.full((K_PAD,), -1, dtype=tl.int32), mask=km)
        if n == 0:
            _write_header(row + 2 * K, T, CAP, ROWS, ROW_BYTES, 0, 0)


@triton.jit
def _row_of(prow, rr, ids, t, r, CAP, E_LOCAL, CAPPED: tl.constexpr):
    """The send row of token t for rank r, -1 where it is not sent there (CAPPED: from its pos row)."""
    if CAPPED:
        return tl.max(tl.where(rr == r, prow, -1), axis=0)
    return tl.where(_sends_to(ids, r, E_LOCAL), r * (CAP + 1) + t, -1)


@triton.jit
def _sends_to(ids, r, E_LOCAL):
    """Whether a token with these expert ids goes to rank r (once, however many of its experts are there)."""
    return tl.max(((ids >= r * E_LOCAL) & (ids < (r + 1) * E_LOCAL)).to(tl.int32), axis=0) > 0


@triton.jit
def _write_header(ptr, T, CAP, ROWS, ROW_BYTES, code, val):
    """int64 [magic, row bytes, rows per block, tokens, code, value] at ptr (int32 words); T > CAP
    overrides the code (3, value T: the tokens past CAP were not looked at)."""
    over = T > CAP
    code = tl.where(over, 3, code).to(tl.int64)
    val = tl.where(over, T, val).to(tl.int64)
    h = tl.arange(0, 8)
    fields = tl.where(h == 0, 0x4D6F4538, tl.where(h == 1, ROW_BYTES, tl.where(h == 2, ROWS, tl.where(
        h == 3, T, 0)))).to(tl.int64)
    fields = tl.where(h == 4, code, tl.where(h == 5, val, fields))
    tl.store(ptr.to(tl.pointer_type(tl.int64)) + h, fields, mask=h < 6)


@triton.jit
def _pack_capacity_cached_kernel(pos_ptr, x_ptr, s_ptr, out_ptr, T, CAP, R, DATA_WORDS, G, stride_x, stride_s,
                                 ROW_WORDS, SCALES: tl.constexpr, R_PAD: tl.constexpr, G_PAD: tl.constexpr,
                                 BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # token t, read once, written into each row pos[t, r] >= 0
    rr = tl.arange(0, R_PAD)
    pos = tl.load(pos_ptr + t * R + rr, mask=rr < R, other=-1).to(tl.int64)
    for c in range(0, DATA_WORDS, BLOCK):
        j = c + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + t * stride_x + j, mask=j < DATA_WORDS)
        for r in range(R):
            p = tl.max(tl.where(rr == r, pos, -1), axis=0)
            if p >= 0:
                tl.store(out_ptr + p * ROW_WORDS + j, v, mask=j < DATA_WORDS)
    if SCALES > 0:
        g = tl.arange(0, G_PAD)
        bits = tl.load(s_ptr + t * stride_s + g, mask=g < G, other=1.0).to(tl.int32, bitcast=True)
        for r in range(R):
            p = tl.max(tl.where(rr == r, pos, -1), axis=0)
            if p >= 0:
                srow = out_ptr + p * ROW_WORDS + DATA_WORDS
                if SCALES == 1:
                    tl.store(srow.to(tl.pointer_type(tl.uint8)) + g, ((bits >> 23) & 0xFF).to(tl.uint8), mask=g < G)
                else:
                    tl.store(srow + g, bits, mask=g < G)


def _send_out(out: Tensor | None, rows: int, row_bytes: int, dev, alloc: bool) -> Tensor | None:
    """The send buffer to write: `out` checked, or a new one (None for the references, which make their own)."""
    if out is None:
        return torch.empty(rows, row_bytes, dtype=torch.uint8, device=dev) if alloc else None
    if out.shape != (rows, row_bytes) or out.dtype != torch.uint8 or not out.is_contiguous():
        raise ValueError(f"pack: out must be a contiguous uint8 [{rows}, {row_bytes}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    return out


def _payload_args(x):
    """(int32 words [T, W] of the data, fp32 scales [T, G] or the words again, G)."""
    fp8 = isinstance(x, Fp8Tensor)
    data = x.data if fp8 else x
    data = data if data.stride(-1) == 1 or data.numel() == 0 else data.contiguous()
    if data.numel():
        words = data.view(torch.int32)
    else:  # an empty tensor's strides may refuse the view
        words = data.new_empty(data.shape[0], data.shape[1] * data.element_size() // 4, dtype=torch.int32)
    sc = x.scale.float().contiguous() if fp8 else words
    return words, sc, (sc.shape[1] if fp8 else 0)


def pack_capacity(x, topk_idx: Tensor, topk_w: Tensor, num_experts: int, world: int, cap: int, row_bytes: int,
                  scales: str, check_scales: bool = False, impl: str | None = None,
                  out: Tensor | None = None, rows: int | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The fixed-capacity send buffer of one dispatch, with its routes and checks, in one launch.

    x "1x128" Fp8Tensor [T, H] or bf16 [T, H]; topk_idx int [T, K] global ids (-1: none); topk_w
    float [T, K]; scales "ue8m0"|"fp32"|"none" -> (send uint8 [R * (cap + 1), row_bytes], pos_TR
    int32 [T, R], None). Block r (rows r*(cap+1) ...) goes to rank r: row t holds token t if one of its
    experts lives on r (| topk_w fp32 K | local ids int32 K | data | scales |, as `pack_rows`), else
    only w = 0 and ids = -1 (the data left unwritten); rows t >= T likewise; row cap is the header,
    ids -1 and then int64 [magic, row_bytes, rows per block (cap), T, code, value] where the data goes.
    code: 3 T > cap (value T; only the first cap tokens are sent), 1 an expert id outside [-1, E)
    (value: the largest), 2 (check_scales) a scale that is not a positive power of two, 0 none; the
    same in every block. pos_TR[t, r]: the row of (t, r) in the send buffer (and in the combine's
    return buffer), -1 where t is not sent to r (and for t >= cap). out: uint8 [R * (B + 1), row_bytes]
    to write the send buffer into (e.g. a transport's send slot), else a new tensor.

    rows: blocks of B = rows rows instead of cap (B < cap: fewer bytes on the wire, where a token
    reaches a rank with probability p < 1), each compacted: the tokens sent to rank r in token order
    (`capped_positions`), then unsent rows; a token that finds its block full is not sent, and the
    third output (int32 [1] on the device, no sync) is 1 -- the caller must not use that exchange."""
    T, K = topk_idx.shape
    B = cap if rows is None else rows
    if not isinstance(B, int) or not 0 <= B <= max(cap, 0):
        raise ValueError(f"pack_capacity: rows={rows!r}, expected an integer in [0, capacity {cap}]")
    out = _send_out(out, world * (B + 1), row_bytes, topk_idx.device, use_triton(topk_idx, impl))
    if not use_triton(topk_idx, impl):
        send, pos, over = pack_capacity_ref(x, topk_idx, topk_w, num_experts, world, cap, row_bytes, scales,
                                            check_scales, rows)
        return (send if out is None else out.copy_(send)), pos, over
    dev = topk_idx.device
    over = cnt = None
    if rows is not None:
        pos, cnt, over = capped_positions(topk_idx, num_experts, world, cap, B, impl)
    else:  # the kernel writes pos for t < cap; past cap (an error, reported in the header) they stay -1
        pos = torch.full((T, world), -1, dtype=torch.int32, device=dev) if T > cap else \
            torch.empty(T, world, dtype=torch.int32, device=dev)
    words, sc, G = _payload_args(x)
    err = torch.zeros(4, dtype=torch.int64, device=dev)  # the token programs' checks and their count
    _pack_capacity_kernel[(max(min(T, cap), B) + world,)](  # the token programs first, then the header rows
        topk_idx.contiguous(), topk_w.float().contiguous(), words, sc, out.view(torch.int32), pos,
        cnt if cnt is not None else err, err, T, cap, B, K, num_experts, num_experts // world, world,
        words.shape[1], G, words.stride(0), sc.stride(0), row_bytes // 4, row_bytes, CHECK_SCALES=check_scales,
        CAPPED=rows is not None, SCALES={"none": 0, "ue8m0": 1, "fp32": 2}[scales],
        K_PAD=triton.next_power_of_2(max(K, 1)), R_PAD=triton.next_power_of_2(world),
        G_PAD=triton.next_power_of_2(max(G, 1)), BLOCK=1024, num_warps=4)
    return out, pos, over


@triton.jit
def _capped_positions_kernel(idx_ptr, pos_ptr, cnt_ptr, over_ptr, n, K, E_LOCAL, R, ROWS, K_PAD: tl.constexpr,
                             BLOCK: tl.constexpr):
    # One program per destination rank r: a running scan over the tokens, BLOCK at a time.
    r = tl.program_id(0)
    k = tl.arange(0, K_PAD)
    carry = tl.zeros((), dtype=tl.int32)
    for t0 in range(0, n, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        ids = tl.load(idx_ptr + t.to(tl.int64)[:, None] * K + k[None, :], mask=(t < n)[:, None] & (k < K)[None, :],
                      other=-1)
        hit = tl.max(((ids >= r * E_LOCAL) & (ids < (r + 1) * E_LOCAL)).to(tl.int32), axis=1)
        j = tl.cumsum(hit, 0) - 1 + carry
        tl.store(pos_ptr + t.to(tl.int64) * R + r, tl.where((hit > 0) & (j < ROWS), r * (ROWS + 1) + j, -1),
                 mask=t < n)
        carry += tl.sum(hit, 0)
    tl.store(cnt_ptr + r, tl.minimum(carry, ROWS))
    if carry > ROWS:
        tl.atomic_max(over_ptr, 1)


def capped_positions(topk_idx: Tensor, num_experts: int, world: int, cap: int, rows: int,
                     impl: str | None = None):
    """The compacted blocks' routes, on the device without a sync: token t < min(T, cap) goes to
    rank r if one of its experts lives there, as the j-th such token (token order) -> row
    r * (rows + 1) + j if j < rows. -> (pos_TR int32 [T, R] (-1: not sent), used int32 [R] (rows
    of each block holding a token), overflow int32 [1]: 1 if any token found its block full).
    One launch (a scan per rank); the reference: `capped_positions_ref`."""
    if not use_triton(topk_idx, impl):
        return capped_positions_ref(topk_idx, num_experts, world, cap, rows)
    T, K = topk_idx.shape
    n, dev = min(T, cap), topk_idx.device
    pos = torch.full((T, world), -1, dtype=torch.int32, device=dev) if T > n else \
        torch.empty(T, world, dtype=torch.int32, device=dev)
    cnt = torch.empty(world, dtype=torch.int32, device=dev)
    over = torch.zeros(1, dtype=torch.int32, device=dev)
    _capped_positions_kernel[(world,)](topk_idx.contiguous(), pos, cnt, over, n, K, num_experts // world, world, rows,
                                       K_PAD=triton.next_power_of_2(max(K, 1)), BLOCK=1024, num_warps=4)
    return pos, cnt, over


def pack_capacity_cached(x, pos_TR: Tensor, cap: int, row_bytes: int, scales: str, impl: str | None = None,
                         out: Tensor | None = None) -> Tensor:
    """The send buffer of a dispatch that reuses the routes of an earlier `pack_capacity`: row
    pos_TR[t, r] holds token t's data and scales (| data | scales |, no routing fields); the other
    rows are left unwritten. -> uint8 [R * (cap + 1), row_bytes] (written into `out` if given)."""
    T, R = pos_TR.shape
    data = x.data if isinstance(x, Fp8Tensor) else x
    out = _send_out(out, R * (cap + 1), row_bytes, data.device, use_triton(data, impl))
    if not use_triton(data, impl):
        send = pack_capacity_cached_ref(x, pos_TR, cap, row_bytes, scales)
        return send if out is None else out.copy_(send)
    words, sc, G = _payload_args(x)
    if T == 0:
        return out
    _pack_capacity_cached_kernel[(T,)](  # one program per token (compacted blocks: token t may have row >= t)
        pos_TR, words, sc, out.view(torch.int32), T, cap, R, words.shape[1], G, words.stride(0), sc.stride(0),
        row_bytes // 4, SCALES={"none": 0, "ue8m0": 1, "fp32": 2}[scales], R_PAD=triton.next_power_of_2(R),
        G_PAD=triton.next_power_of_2(max(G, 1)), BLOCK=1024, num_warps=4)
    return out


def _payload_bytes(x, scales: str) -> Tensor:
    """[T, data | scales] as uint8 (the wire form of each token's payload)."""
    def as_bytes(t: Tensor) -> Tensor:
        return t.contiguous().view(torch.uint8) if t.numel() else torch.empty(
            t.shape[0], t.shape[1] * t.element_size(), dtype=torch.uint8, device=t.device)

    parts = [as_bytes(x.data if isinstance(x, Fp8Tensor) else x)]
    if scales == "ue8m0":
        parts.append(pack_ue8m0(x.scale, check=False))
    elif scales == "fp32":
        parts.append(as_bytes(x.scale.float()))
    return torch.cat(parts, dim=1)


def capped_positions_ref(topk_idx: Tensor, num_experts: int, world: int, cap: int, rows: int):
    """PyTorch twin of `capped_positions`. The compacted blocks' routes (no sync): token t < min(T, cap) goes
    to rank r if one of its experts lives there, as the j-th such token (token order) -> row
    r * (rows + 1) + j if j < rows. -> (pos_TR int32 [T, R] (-1: not sent), used int32 [R] (rows
    of each block holding a token), overflow int32 [1]: 1 if any token found its block full)."""
    T = topk_idx.shape[0]
    R, E_l, dev = world, num_experts // world, topk_idx.device
    idx = topk_idx.long()[:min(T, cap)]
    ok = (idx >= 0) & (idx < num_experts)
    dest = torch.where(ok, idx // E_l, R)  # R: no rank
    # [R, n]: the scans run along the contiguous dimension (along dim 0 of [n, R] a GPU scans R columns
    # with R threads: ~1.6 ms at 16384 tokens)
    hit = torch.zeros(R + 1, idx.shape[0], dtype=torch.int32, device=dev).scatter_(0, dest.t(), 1)[:R]
    j = torch.cumsum(hit, 1, dtype=torch.int32) - 1
    count = j[:, -1] + 1 if idx.shape[0] else torch.zeros(R, dtype=torch.int32, device=dev)
    sent = (hit > 0) & (j < rows)
    pos = torch.full((T, R), -1, dtype=torch.int32, device=dev)
    pos[:idx.shape[0]] = torch.where(sent, torch.arange(R, device=dev, dtype=torch.int32)[:, None] * (rows + 1) + j,
                                     -1).t()
    return pos, count.clamp(max=rows), (count > rows).any().to(torch.int32).view(1)


def pack_capacity_ref(x, topk_idx: Tensor, topk_w: Tensor, num_experts: int, world: int, cap: int, row_bytes: int,
                      scales: str, check_scales: bool = False, rows: int | None = None):
    """PyTorch twin of `pack_capacity`: the same bytes where the kernel writes (unwritten bytes are 0 here)."""
    T, K = topk_idx.shape
    R, E_l, dev = world, num_experts // world, topk_idx.device
    B = cap if rows is None else rows
    n = min(T, cap)
    idx = topk_idx.long()[:n]
    r = torch.arange(R, device=dev)
    mine = (idx[None] >= r[:, None, None] * E_l) & (idx[None] < (r[:, None, None] + 1) * E_l)  # [R, n, K]
    hit = mine.any(-1)  # [R, n]
    pos = torch.full((T, R), -1, dtype=torch.int32, device=dev)
    if rows is None:
        pos[:n] = torch.where(hit.t(), (r[None, :] * (cap + 1) + torch.arange(n, device=dev)[:, None]).int(), -1)
        over = None
    else:  # token order within each block, up to B tokens
        pos, _, over = capped_positions_ref(topk_idx, num_experts, world, cap, B)
    out = torch.zeros(R * (B + 1), row_bytes, dtype=torch.uint8, device=dev)
    out[:, 4 * K:8 * K] = torch.full((K,), -1, dtype=torch.int32, device=dev).view(torch.uint8)  # unsent rows
    w = topk_w.float()[:n]
    pay = _payload_bytes(x, scales)[:n]
    for rr in range(R):
        p = pos[:n, rr].long()
        sel = p >= 0
        out[p[sel], :4 * K] = w[sel].contiguous().view(torch.uint8)
        out[p[sel], 4 * K:8 * K] = torch.where(mine[rr][sel], idx[sel] - rr * E_l, -1).int().contiguous().view(
            torch.uint8)
        out[p[sel], 8 * K:8 * K + pay.shape[1]] = pay[sel]
    bad = (idx < -1) | (idx >= num_experts)
    code, val = (ERR_BAD_EXPERT, int(idx[bad].max())) if bool(bad.any()) else (0, 0)
    if code == 0 and check_scales and n and bool(((x.scale[:n].float().contiguous().view(torch.int32)
                                                   & 0x807FFFFF) != 0).any()):
        code = ERR_BAD_SCALE
    if T > cap:
        code, val = ERR_OVER_CAPACITY, T
    hdr = torch.tensor([HDR_MAGIC, row_bytes, B, T, code, val], dtype=torch.int64, device=dev)
    blocks = out.view(R, B + 1, row_bytes)
    blocks[:, B, :4 * K] = 0
    blocks[:, B, 8 * K:8 * K + 8 * HDR_WORDS] = hdr.view(torch.uint8)
    return out, pos, over


def pack_capacity_cached_ref(x, pos_TR: Tensor, cap: int, row_bytes: int, scales: str) -> Tensor:
    T, R = pos_TR.shape
    pay = _payload_bytes(x, scales)
    out = torch.zeros(R * (cap + 1), row_bytes, dtype=torch.uint8, device=pay.device)
    p = pos_TR.long().reshape(-1)
    ok = p >= 0
    out[p[ok], :pay.shape[1]] = pay.repeat_interleave(R, dim=0)[ok]
    return out


# ----------------------------------------------------------------------------------------------
# Bad expert ids for the DeepEP backend: a flag that rides DeepEP's own count exchange

BAD_RANK_FLAG = 1 << 24  # added to a per-expert token count; real counts stay below it


@triton.jit
def _flag_bad_experts_kernel(idx_ptr, cnt_ptr, out_ptr, T, K, E, E_LOCAL, R, K_PAD: tl.constexpr,
                             R_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    code, val = _input_errors(idx_ptr, idx_ptr, T, K, E, 1, 0, False, K_PAD, 1, BLOCK_T)
    h = tl.arange(0, 2)
    tl.store(out_ptr + h, tl.where(h == 0, code, val))
    r = tl.arange(0, R_PAD)
    rm = (r < R) & (r * 0 + code > 0)
    old = tl.load(cnt_ptr + r * E_LOCAL, mask=rm, other=0)
    tl.store(cnt_ptr + r * E_LOCAL, old + 16777216, mask=rm)  # BAD_RANK_FLAG


def flag_bad_experts(topk_idx: Tensor, num_experts: int, world: int, counts_E: Tensor,
                     impl: str | None = None) -> Tensor:
    """topk_idx int64 [T, K] global ids; counts_E int32 [E] tokens per expert (DeepEP's layout) ->
    int64 [2] on the device: (1, the largest id outside [-1, E)) or (0, 0). When there is a bad id,
    BAD_RANK_FLAG is added in place to counts_E[r * E / R] for every rank r (the first local expert
    of each rank), so that every receiver's per-expert total says how many ranks had one. One launch."""
    if not use_triton(topk_idx, impl):
        return flag_bad_experts_ref(topk_idx, num_experts, world, counts_E)
    T, K = topk_idx.shape
    out = torch.empty(2, dtype=torch.int64, device=topk_idx.device)
    _flag_bad_experts_kernel[(1,)](topk_idx.contiguous(), counts_E, out, T, K, num_experts, num_experts // world,
                                   world, K_PAD=triton.next_power_of_2(max(K, 1)),
                                   R_PAD=triton.next_power_of_2(world), BLOCK_T=128, num_warps=4)
    return out


def flag_bad_experts_ref(topk_idx: Tensor, num_experts: int, world: int, counts_E: Tensor) -> Tensor:
    idx = topk_idx.long()
    bad = (idx < -1) | (idx >= num_experts)
    if not bool(bad.any()):
        return torch.zeros(2, dtype=torch.int64, device=idx.device)
    counts_E[::num_experts // world] += BAD_RANK_FLAG
    return torch.stack([torch.ones((), dtype=torch.int64, device=idx.device), idx[bad].max()])
