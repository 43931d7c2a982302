"""moefp8/optim.py's gradient norm and clipping factor: the norm of the scaled gradients against a
float64 one, the factor's cases, and the folded update (the gradients' sums over the ranks, the
mean's 1/world and the clipping applied as AdamW reads them) against the former passes (divide,
clip in place, update), bit for bit at a power-of-two world."""

import math

import pytest
import torch

from moefp8.config import OptimConfig
from moefp8.optim import AdamW, clip_scale, grad_norm


def _params(seed: int, shapes=((7, 5), (33,), (2, 3, 4)), dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    ps = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype))
        p.grad = (torch.randn(s, generator=gen) * 10).to(dtype)
        ps.append(p)
    return ps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_norm_is_the_scaled_l2_norm_of_every_gradient(dtype):
    rep, shard = _params(0, dtype=dtype), _params(1, ((9, 2),), dtype=dtype)
    shard.append(torch.nn.Parameter(torch.ones(3)))  # no gradient: left out
    want = math.sqrt(sum(float(p.grad.double().square().sum()) for p in rep + shard[:1]))
    for scale in (1.0, 0.25, 1 / 3):
        got = grad_norm(rep, shard, None, scale)
        assert got.dtype == torch.float32 and got.dim() == 0
        assert abs(float(got) - want * scale) <= 1e-6 * want * scale, scale
    assert float(grad_norm(rep, (), None)) < want  # the sharded part counts
    nan = _params(2)
    nan[1].grad[3] = float("nan")
    assert math.isnan(float(grad_norm(nan)))


def test_clip_scale_cases():
    n = torch.tensor(4.0)
    assert float(clip_scale(n, 0.0, 0.5)) == 0.5  # no clipping: the mean alone
    assert float(clip_scale(n, 8.0, 0.5)) == 0.5  # below the bar
    assert float(clip_scale(n, 1.0, 0.5)) == pytest.approx(0.5 / 4.0, rel=1e-6)
    assert float(clip_scale(n, 1.0)) == pytest.approx(0.25, rel=1e-6)
    for bad in (float("inf"), float("nan")):  # non-finite: the gradients as they are (the step is skipped upstream)
        assert float(clip_scale(torch.tensor(bad), 1.0, 0.5)) == 0.5


@pytest.mark.parametrize("max_norm", [0.0, 1.0, 1e9])
def test_folded_update_equals_divide_clip_then_update(max_norm):
    """The training loop's update at world 2 (gradients hold sums; grad_scale = clip x 1/2) gives the
    same parameters and moments, bit for bit, as dividing the sums by 2, clipping them in place and
    updating from them (the loop's former passes)."""
    world, cfg = 2, OptimConfig()
    init = _params(3)
    named = lambda: [(f"w{i}", torch.nn.Parameter(p.detach().clone())) for i, p in enumerate(init)]  # noqa: E731
    old, new = AdamW(named(), cfg), AdamW(named(), cfg)
    old.impl = new.impl = "ref"
    for k in range(3):
        sums = [p.grad * (k + 1) for p in init]
        for opt in (old, new):
            for p, g in zip(opt.params.values(), sums):
                p.grad = g.clone()
        grads = [p.grad for p in old.params.values()]  # former: mean, norm, clip in place, update
        torch._foreach_div_(grads, world)
        norm = torch.sqrt(sum(torch.linalg.vector_norm(g) ** 2 for g in grads))
        if max_norm > 0:
            torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        old.step(1e-2)
        gn = grad_norm(list(new.params.values()), (), None, 1 / world)  # now: one factor, read by the update
        assert float(gn) == pytest.approx(float(norm), rel=1e-6)
        new.step(1e-2, grad_scale=clip_scale(gn, max_norm, 1 / world))
        for n in old.params:
            assert torch.equal(old.params[n], new.params[n]), (n, k)
            assert torch.equal(old.exp_avg[n], new.exp_avg[n]) and torch.equal(old.exp_avg_sq[n], new.exp_avg_sq[n])
