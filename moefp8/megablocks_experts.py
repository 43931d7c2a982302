"""megablocks' dropless MoE (dMoE: BF16, its grouped-GEMM path) standing in for moefp8's routed
experts: the BF16 MoE a user would pick instead, measured on the same router, weights and data
(issue "megablocks"; `recipe.moe_impl=megablocks`, docs/training.md).

moefp8's router picks the experts and weights; megablocks' `ParallelDroplessMLP` does the rest:
gather the rows per expert, w1/v1 grouped GEMMs (`grouped_gemm`), SiLU(gate) * up, w2, and the
weighted scatter back. The weights stay moefp8's (fp32 masters w1 [E, 2I, H] = [gate | up] and w2
[E, H, I]: the same init, optimizer and checkpoints as the BF16 recipe); each forward casts them to
BF16 in megablocks' layout (`megablocks_weights`, the cast every BF16 step does anyway), and
autograd carries megablocks' weight gradients back to the masters. megablocks is BF16, one process
(EP=1), the plain schedule; its grouped GEMM reads the expert sizes on the host (one sync per layer).

megablocks (0.10.0, PyPI source only) needs `grouped_gemm` (0.3.0) and `stanford-stk` (0.7.1),
built against the installed torch (bench/notes/megablocks.md: what it takes with CUDA 13); nothing
imports it unless asked (`load`).
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moefp8.scope import scope

INSTALL = ("megablocks is built from source against the installed torch: `pip install --no-deps "
           "--no-build-isolation stanford-stk==0.7.1 grouped_gemm==0.3.0 megablocks==0.10.0` on a CUDA machine "
           "(megablocks pins an older torch: --no-deps keeps yours; with CUDA 13 megablocks' csrc/cumsum.h needs "
           "a one-line fix first: bench/notes/megablocks.md)")


def load():
    """The `megablocks` module, or None where it (or its grouped GEMM) does not import."""
    try:
        import grouped_gemm  # noqa: F401  (megablocks only warns without it; its grouped path needs it)
        import megablocks
    except ImportError:
        return None
    return megablocks


def megablocks_weights(w1_E2IH: Tensor, w2_EHI: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """moefp8's expert weights -> megablocks' GLU weights in BF16, each [E*I, H] contiguous: w1 (the
    gate rows of each expert's fc1), v1 (its up rows) and w2 (each expert's fc2 transposed, [I, H]).
    Differentiable: the gradients flow back to the arguments."""
    E, I2, H = w1_E2IH.shape
    inter = I2 // 2
    gate = w1_E2IH[:, :inter].to(torch.bfloat16).contiguous().view(E * inter, H)
    up = w1_E2IH[:, inter:].to(torch.bfloat16).contiguous().view(E * inter, H)
    down = w2_EHI.transpose(1, 2).to(torch.bfloat16).contiguous().view(E * inter, H)
    return gate, up, down


class MegablocksExperts(nn.Module):
    """megablocks' dMoE experts of `n_experts` x SwiGLU(hidden -> inter), top-`topk`, holding no
    weights of their own (megablocks' parameters are removed; `forward` is handed moefp8's).
    mb: the megablocks module (default: `load()`)."""

    def __init__(self, hidden: int, inter: int, n_experts: int, topk: int, mb=None):
        super().__init__()
        mb = mb if mb is not None else load()
        if mb is None:
            raise ImportError(f"recipe.moe_impl=megablocks: `import megablocks` failed. {INSTALL}")
        args = mb.Arguments(hidden_size=hidden, ffn_hidden_size=inter, moe_num_experts=n_experts, moe_top_k=topk,
                            mlp_type="glu", mlp_impl="grouped", activation_fn=F.silu, bias=False,
                            return_bias=False, bf16=True, fp16=False, moe_loss_weight=0.0,
                            device=torch.device("meta"))  # its own weights never materialize
        self.dmoe = mb.ParallelDroplessMLP(args)
        for name in ("w1", "v1", "w2"):
            delattr(self.dmoe.mlp, name)
            setattr(self.dmoe.mlp, name, None)

    def forward(self, x_TH: Tensor, topk_w_TK: Tensor, topk_idx_TK: Tensor, w1_E2IH: Tensor, w2_EHI: Tensor) -> Tensor:
        """x [T, H] bf16, the router's weights [T, K] and expert ids [T, K] -> [T, H] bf16:
        sum_k w[t, k] * SwiGLU_e(x[t]) over the picked experts e = idx[t, k]."""
        mlp = self.dmoe.mlp
        with scope("megablocks_weights"):
            mlp.w1, mlp.v1, mlp.w2 = megablocks_weights(w1_E2IH, w2_EHI)
        try:
            with scope("megablocks_dmoe"):
                out = self.dmoe(x_TH, None, topk_w_TK.to(x_TH.dtype), topk_idx_TK)
        finally:
            mlp.w1 = mlp.v1 = mlp.w2 = None  # autograd keeps what backward needs; nothing else holds them
        return out
