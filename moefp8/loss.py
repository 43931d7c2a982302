"""The LM head and its cross-entropy without the [T, V] logits in memory: chunks of tokens.

    loss = linear_cross_entropy(x_TH, w_VH, targets_T, chunk)       # = the reference below

The reference, `linear_cross_entropy_ref`, is what `Transformer.forward` computes by default:
BF16 logits `x · W_bf16ᵀ`, cast to fp32, mean cross-entropy; autograd keeps the fp32
log-softmax [T, V] and the backward makes an fp32 [T, V] gradient: ~10 bytes per token and
vocabulary entry at the peak (moefp8.memory's "logits"), 7.8 GiB for 8192 tokens of a 102400
vocabulary.

`linear_cross_entropy` computes the same per `chunk` tokens and takes each chunk's gradients in the forward
(the loss is the last op: its gradient is known up to the incoming scale): the BF16 logits of a chunk, their
log-sum-exp in fp32, then `g = (softmax - onehot) / T` cast to BF16 (the reference's gradient dtype at the
BF16 GEMMs), in place over the logits by one Triton kernel on CUDA (`moefp8.kernels.xent`; its twin the
reference's ops), `dx = g · W_bf16` and `dW += gᵀ · x` (on CUDA a GEMM of BF16 operands that adds into the
fp32 dW in its epilogue; on CPU each chunk's BF16 product rounds, then adds in fp32; the reference's one
BF16-output GEMM rounds once). It keeps dx (BF16 [T, H]) and dW (fp32 [V, H]) for the backward, which scales
them by the incoming gradient. Peak: chunk x V x 2 bytes on CUDA (the kernel works in place; ~10 through the
reference twin) plus dW. Same GEMM FLOPs as the reference, no recompute. W_bf16 is the weight's BF16 copy,
which the optimizer writes in its pass (moefp8.weight_copy).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from moefp8.kernels.xent import xent_grad_
from moefp8.linear import HAS_OUT_DTYPE
from moefp8.weight_copy import bf16_of

BF16 = torch.bfloat16


def linear_cross_entropy_ref(x_TH: Tensor, w_VH: Tensor, targets_T: Tensor) -> Tensor:
    """Mean cross-entropy of F.linear(x, W_bf16) in fp32: x BF16 [T, H], w [V, H] (fp32 master),
    targets int64 [T] -> fp32 scalar."""
    return F.cross_entropy(F.linear(x_TH, w_VH.to(BF16)).float(), targets_T)


def _add_mm_(dw_VH: Tensor, g_Vc: Tensor, x_cH: Tensor) -> None:
    """dw (fp32) += g · x of BF16 operands. On CUDA one cuBLAS GEMM that adds into dw in its epilogue,
    fp32 throughout (`out_dtype`: torch >= 2.8); elsewhere the BF16 product cast and added (three passes
    over a [V, H] tensor a chunk: 3B preset, 8 chunks, ~3 ms a step, bench/notes/scale.md session 56)."""
    if dw_VH.is_cuda and HAS_OUT_DTYPE:
        torch.addmm(dw_VH, g_Vc, x_cH, out_dtype=torch.float32, out=dw_VH)
    else:
        dw_VH += (g_Vc @ x_cH).float()



class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH: Tensor, w_VH: Tensor, targets_T: Tensor, chunk: int) -> Tensor:
        T = x_TH.shape[0]
        wb = bf16_of(w_VH)
        loss = torch.zeros((), dtype=torch.float32, device=x_TH.device)
        dx = torch.empty_like(x_TH)
        dw = torch.zeros(w_VH.shape, dtype=torch.float32, device=w_VH.device)
        for s in range(0, T, chunk):
            xc, tc = x_TH[s: s + chunk], targets_T[s: s + chunk]
            gb = F.linear(xc, wb)  # [c, V] BF16: the reference's logits, bit for bit, once in fp32
            loss += xent_grad_(gb, tc, T).sum()  # gb now (softmax - onehot) / T, BF16 (moefp8.kernels.xent)
            torch.mm(gb, wb, out=dx[s: s + chunk])
            _add_mm_(dw, gb.t(), xc)
            del gb
        ctx.save_for_backward(dx, dw)
        ctx.w_dtype = w_VH.dtype
        return loss / T

    @staticmethod
    def backward(ctx, grad: Tensor):
        dx, dw = ctx.saved_tensors
        return dx * grad.to(dx.dtype), (dw * grad).to(ctx.w_dtype), None, None


def linear_cross_entropy(x_TH: Tensor, w_VH: Tensor, targets_T: Tensor, chunk: int) -> Tensor:
    """linear_cross_entropy_ref in chunks of `chunk` tokens (module docstring); chunk <= 0: the
    reference itself. Without a gradient to take (evaluation), the chunks' losses only."""
    if chunk <= 0:
        return linear_cross_entropy_ref(x_TH, w_VH, targets_T)
    if torch.is_grad_enabled() and (x_TH.requires_grad or w_VH.requires_grad):
        return _LinearCrossEntropy.apply(x_TH, w_VH, targets_T, chunk)
    wb = bf16_of(w_VH)
    return sum(F.cross_entropy(F.linear(x_TH[s: s + chunk], wb).float(), targets_T[s: s + chunk], reduction="sum")
               for s in range(0, x_TH.shape[0], chunk)) / x_TH.shape[0]
