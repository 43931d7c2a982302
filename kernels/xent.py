"""The LM head's cross-entropy and its gradient for one chunk of tokens, in place over the BF16
logits (moefp8.loss.linear_cross_entropy): Triton kernel -> public wrapper -> `_ref` twin.

    loss_c = xent_grad_(logits_cV, targets_c, n)   # logits now hold g = (softmax - onehot) / n, BF16

The reference takes the fp32 copy of the logits [c, V] and makes a pass for each of: the copy, the
log-sum-exp (two), the subtraction, the exponent, the one-hot, the division and the cast back:
~25 bytes per logit. The kernel reads the BF16 logits twice (an online max and sum of exponents,
then the gradient) and writes the gradient once: 6 bytes per logit (the 3B preset's 32k x 32k
logits per step: 26 GB -> 6 GB). Math in fp32 in the reference's order per element:
exp(x - lse), minus 1 at the target, IEEE division by n, rounded to BF16; the log-sum-exp sums in
another order, so the two agree to a few fp32 ulp, not bit for bit. A NaN or inf among a row's
logits makes its loss non-finite, as in the reference.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from moefp8.kernels import use_triton

BLOCK_V, NUM_WARPS = 4096, 8  # one row per program, walked in 4096-wide blocks (16 fp32 per thread)


@triton.jit
def _xent_grad_kernel(x_ptr, t_ptr, loss_ptr, V, stride_x, n, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for v0 in range(0, V, BLOCK_V):  # online log-sum-exp: running max m, sum of exp(x - m)
        x = tl.load(x_row + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)  # a NaN logit makes s NaN; +inf makes m inf and exp(inf - inf) NaN
    t = tl.load(t_ptr + row)
    tl.store(loss_ptr + row, lse - tl.load(x_row + t).to(tl.float32))
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        x = tl.load(x_row + cols, mask=cols < V, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        p = tl.where(cols == t, p - 1.0, p)
        tl.store(x_row + cols, tl.math.div_rn(p, n).to(tl.bfloat16), mask=cols < V)


def xent_grad_(logits_cV: Tensor, targets_c: Tensor, n: int, impl: str | None = None) -> Tensor:
    """logits BF16 [c, V] (rows contiguous), targets int [c] in [0, V) -> each row's loss
    lse - logit[target] (fp32 [c]); the logits are overwritten with the gradient of the mean
    loss over `n` tokens: (softmax - onehot(target)) / n, BF16."""
    if logits_cV.dtype != torch.bfloat16 or logits_cV.dim() != 2 or logits_cV.stride(1) != 1:
        raise ValueError(f"xent_grad_: expected BF16 logits [c, V] with contiguous rows, got {logits_cV.dtype} "
                         f"{tuple(logits_cV.shape)} strides {logits_cV.stride()}")
    if targets_c.shape != logits_cV.shape[:1]:
        raise ValueError(f"xent_grad_: targets {tuple(targets_c.shape)} do not match {logits_cV.shape[0]} rows")
    if not use_triton(logits_cV, impl):
        return xent_grad_ref_(logits_cV, targets_c, n)
    c, V = logits_cV.shape
    loss = torch.empty(c, dtype=torch.float32, device=logits_cV.device)
    if c:
        _xent_grad_kernel[(c,)](logits_cV, targets_c.contiguous(), loss, V, logits_cV.stride(0), float(n),
                                BLOCK_V=min(BLOCK_V, triton.next_power_of_2(V)), num_warps=NUM_WARPS)
    return loss


@torch.no_grad()
def xent_grad_ref_(logits_cV: Tensor, targets_c: Tensor, n: int) -> Tensor:
    """moefp8.loss's former chunk body: the logits in fp32, their log-sum-exp, the softmax in
    place, minus the one-hot, divided by n, cast back into the BF16 logits."""
    logits = logits_cV.float()
    lse = torch.logsumexp(logits, dim=-1)
    loss = lse - logits.gather(1, targets_c[:, None].long()).squeeze(1)
    g = logits.sub_(lse[:, None]).exp_()
    g[torch.arange(len(targets_c), device=g.device), targets_c] -= 1
    logits_cV.copy_(g.div_(n))
    return loss
