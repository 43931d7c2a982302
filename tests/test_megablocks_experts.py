"""moefp8/megablocks_experts.py: megablocks' dMoE standing in for the BF16 recipe's routed experts
on moefp8's router and weights. On CPU a stand-in with megablocks' interface (Arguments,
ParallelDroplessMLP with GLU weights w1/v1/w2 [E*I, H]) checks the wiring: the weight layout, no
weights of its own, gradients reaching moefp8's fp32 masters, the configuration errors. On a GPU
with megablocks built, the real dMoE must match moefp8's BF16 recipe (both BF16; see tolerances)."""

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moefp8 import megablocks_experts
from moefp8.config import Config, validate
from moefp8.launch import check_launch
from moefp8.megablocks_experts import MegablocksExperts, megablocks_weights
from moefp8.moe import MoELayer
from moefp8.recipe import Recipe
from moefp8.testing import rel_err

H, I, E, K = 256, 128, 8, 2


class _StandInDMoE(nn.Module):
    """megablocks.ParallelDroplessMLP's interface over plain torch math: per (token, slot),
    w * (silu(x·w1[e]ᵀ) * (x·v1[e]ᵀ)) · w2[e] with w1, v1, w2 [E*I, H] (megablocks' GLU layout)."""

    def __init__(self, args):
        super().__init__()
        self.args, self.mlp = args, nn.Module()
        for name in ("w1", "v1", "w2"):
            setattr(self.mlp, name, nn.Parameter(torch.empty(args.moe_num_experts * args.ffn_hidden_size,
                                                             args.hidden_size, device=args.device)))

    def forward(self, x, scores, expert_weights, top_experts):
        a = self.args
        assert scores is None and x.dtype == expert_weights.dtype == torch.bfloat16 and a.mlp_type == "glu"
        assert all(getattr(self.mlp, n).is_contiguous() and getattr(self.mlp, n).dtype == torch.bfloat16
                   for n in ("w1", "v1", "w2"))
        n, h = a.moe_num_experts, a.hidden_size
        w1, v1, w2 = (getattr(self.mlp, n_).view(n, -1, h) for n_ in ("w1", "v1", "w2"))
        out = torch.zeros(x.shape, dtype=torch.float32)
        for k in range(a.moe_top_k):
            for e in range(n):
                rows = (top_experts[:, k] == e).nonzero().flatten()
                xe = x[rows].float()
                act = (a.activation_fn(xe @ w1[e].float().t()) * (xe @ v1[e].float().t())).bfloat16()
                out = out.index_add(0, rows, expert_weights[rows, k, None].float() * (act.float() @ w2[e].float()))
        return out.bfloat16()


STAND_IN = types.SimpleNamespace(Arguments=types.SimpleNamespace, ParallelDroplessMLP=_StandInDMoE)


def layers(monkeypatch, seed=0):
    monkeypatch.setattr(megablocks_experts, "load", lambda: STAND_IN)
    torch.manual_seed(seed)
    ours = MoELayer(H, I, E, K, recipe=Recipe("bf16"))
    mb = MoELayer(H, I, E, K, recipe=Recipe("bf16", moe_impl="megablocks"))
    mb.load_state_dict(ours.state_dict())  # the same weights copied in
    return ours, mb


def run(m: MoELayer, T: int, seed: int = 100):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16().to(m.w1.device).requires_grad_()
    dout = torch.randn(T, H, generator=g).bfloat16().to(m.w1.device)
    m.router.bias[3] = -1e4  # expert 3 gets no token
    o = m(x)
    o.out.backward(dout)
    assert o.load_E[3] == 0
    return [o.out.detach(), x.grad, m.w1.grad, m.w2.grad, m.router.weight.grad]


def test_megablocks_weights_layout():
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    gate, up, down = megablocks_weights(w1, w2)
    assert all(t.shape == (E * I, H) and t.dtype == torch.bfloat16 and t.is_contiguous() for t in (gate, up, down))
    e = 5
    assert torch.equal(gate[e * I:(e + 1) * I], w1[e, :I].bfloat16())  # [gate | up]: swiglu's halves
    assert torch.equal(up[e * I:(e + 1) * I], w1[e, I:].bfloat16())
    assert torch.equal(down[e * I:(e + 1) * I], w2[e].t().bfloat16())


@pytest.mark.parametrize("T", [200, 37])
def test_stand_in_dmoe_matches_the_bf16_recipe(monkeypatch, T):
    """Both compute in BF16 with fp32 accumulation; they round the SwiGLU output and the weighted
    sum at different points (ours: each expert's fc2 output in BF16, then the weighted combine).
    Measured: rel. error <= 5e-3 on the output and every gradient; bound 1e-2 (gate and up halves
    swapped: 0.46-0.92)."""
    ours, mb = layers(monkeypatch)
    assert set(mb.state_dict()) == set(ours.state_dict())  # megablocks holds no weights of its own
    a, b = run(ours, T), run(mb, T)
    assert mb.megablocks.dmoe.mlp.w1 is None  # the BF16 copies are not kept past the step
    for name, x, y in zip(("out", "dx", "dw1", "dw2", "drouter"), b, a):
        assert x.dtype == y.dtype and torch.isfinite(x).all(), name
        assert rel_err(x, y) < 1e-2, (name, rel_err(x, y))
    assert mb.w1.grad.dtype == torch.float32 and mb.w1.grad[3].abs().max() == 0  # the empty expert


def test_megablocks_needs_bf16_one_process_and_the_package(monkeypatch):
    with pytest.raises(ValueError, match="megablocks' dMoE is BF16"):
        Recipe("fp8", moe_impl="megablocks")
    with pytest.raises(ValueError, match="expected one of"):
        Recipe("bf16", moe_impl="mb")
    cfg = Config()
    cfg.recipe.recipe, cfg.recipe.moe_impl = "bf16", "megablocks"
    validate(cfg)
    cfg.dispatch.overlap = True
    with pytest.raises(ValueError, match="recipe.moe_impl=megablocks: .*dispatch.overlap=True"):
        validate(cfg)
    cfg.dispatch.overlap, cfg.recipe.recipe = False, "fp8"
    with pytest.raises(ValueError, match="recipe.moe_impl=megablocks: .*recipe=fp8"):
        validate(cfg)
    cfg.recipe.recipe, cfg.train.device = "bf16", "cpu"
    with pytest.raises(ValueError, match="recipe.moe_impl=megablocks: megablocks' kernels run on CUDA GPUs .*"
                                         "use recipe.moe_impl=moefp8"):
        check_launch(cfg)
    monkeypatch.setattr(megablocks_experts, "load", lambda: None)
    with pytest.raises(ImportError, match="import megablocks` failed.*--no-deps"):
        MegablocksExperts(H, I, E, K)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [4096, 1001])
def test_megablocks_dmoe_matches_the_bf16_recipe_on_gpu(T):
    """The real dMoE (grouped_gemm's GEMMs, megablocks' gather/scatter kernels) against moefp8's BF16
    recipe, same weights: BF16 both, summation orders differ; rel. error bound 1e-2 as above."""
    if not torch.cuda.is_available() or megablocks_experts.load() is None:
        pytest.skip("needs a CUDA GPU with megablocks built")
    torch.manual_seed(0)
    ours = MoELayer(H, I, E, K, recipe=Recipe("bf16")).cuda()
    mb = MoELayer(H, I, E, K, recipe=Recipe("bf16", moe_impl="megablocks")).cuda()
    mb.load_state_dict(ours.state_dict())
    a, b = run(ours, T), run(mb, T)
    for name, x, y in zip(("out", "dx", "dw1", "dw2", "drouter"), b, a):
        assert torch.isfinite(x).all() and rel_err(x, y) < 1e-2, (name, rel_err(x, y))
    assert mb.w1.grad[3].abs().max() == 0
    assert F.silu is mb.megablocks.dmoe.args.activation_fn
