"""The low-precision copies kept on the weights (moefp8.weight_copy): made once, refreshed where the
weight changed, what a CUDA graph capture gets, the optimizer's refresh (FP8 and BF16),
`experts.WeightCache` around them, and training with them repeating training without them bit for bit."""

import pytest
import torch

from moefp8 import experts as X
from moefp8 import linear as L
from moefp8 import weight_copy as W
from moefp8.config import ModelConfig, OptimConfig
from moefp8.kernels.quant import quant_weight_ref, transpose_weight_ref
from moefp8.model import Transformer
from moefp8.optim import AdamW
from moefp8.recipe import Recipe
from moefp8.testing import assert_fp8_equal


def count_quant(monkeypatch):
    """The weight quantizations weight_copy runs, as (transposed,) entries."""
    calls, real = [], W.quant_weight
    monkeypatch.setattr(W, "quant_weight", lambda *a, **k: calls.append(k.get("transposed", False)) or real(*a, **k))
    return calls


def assert_copy_of(c, w, exact=True):
    """exact=False: made by Triton's interpreter, whose casts round a few values wrongly (moefp8.testing)."""
    q = quant_weight_ref(w.detach())
    assert_fp8_equal(c.low, q, exact=exact)
    if c.low_t is not None:
        assert_fp8_equal(c.low_t, transpose_weight_ref(q), exact=exact)


def test_made_once_with_its_transpose_and_refreshed_in_place(monkeypatch):
    """A trainable weight's copy and its transpose come from one quantization, also with grad mode off (the
    layers ask inside their autograd Functions' forwards); asked again, nothing runs; after an in-place
    change the same buffers (which a CUDA graph may have captured) get the new codes; a frozen weight's copy
    is made without the transpose until one is asked for."""
    calls = count_quant(monkeypatch)
    w = torch.nn.Parameter(torch.randn(4, 256, 128))
    with torch.no_grad():
        c = W.copy_of(w, "pow2")
        assert W.copy_of(w, "pow2", transposed=True) is c and w.low_copy is c
    assert calls == [True] and c.low_t is not None
    assert_copy_of(c, w)
    ptrs = [t.data_ptr() for t in (c.low.data, c.low.scale, c.low_t.data, c.low_t.scale)]
    with torch.no_grad():
        w.mul_(-3.0)
    assert W.copy_of(w, "pow2") is c and calls == [True, True] and c.version == w._version
    assert ptrs == [t.data_ptr() for t in (c.low.data, c.low.scale, c.low_t.data, c.low_t.scale)]
    assert_copy_of(c, w)
    assert W.copy_of(w, "fp32").fmt == "fp32" and calls[-1] is True  # another format: a copy of its own
    frozen = torch.nn.Parameter(torch.randn(256, 128), requires_grad=False)
    assert W.copy_of(frozen, "pow2").low_t is None and calls[-1] is False
    assert W.copy_of(frozen, "pow2", transposed=True).low_t is not None and calls[-1] is True
    assert W.copy_of(torch.nn.Parameter(torch.randn(200, 128)), "pow2") is None  # N % 128: no transpose to keep
    b = W.copy_of(w, "bf16")  # the BF16 cast, any shape
    assert b.low_t is None and torch.equal(b.low, w.detach().bfloat16()) and w.low_copy is b
    with torch.no_grad():
        w.add_(0.5)
    ptr = b.low.data_ptr()
    assert W.copy_of(w, "bf16") is b and b.low.data_ptr() == ptr and torch.equal(b.low, w.detach().bfloat16())


def test_under_a_capture_only_a_matching_copy(monkeypatch):
    """During a CUDA graph capture nothing is quantized or refreshed: a copy that matches the weight is
    returned (the graph reads its buffers), a missing or stale one gives None (the caller quantizes
    inside the capture). (The capture faked: CPU.)"""
    capturing = [True]
    monkeypatch.setattr(W, "capturing", lambda w: capturing[0])
    calls = count_quant(monkeypatch)
    w = torch.nn.Parameter(torch.randn(2, 256, 128))
    assert W.copy_of(w, "pow2") is None and calls == []
    capturing[0] = False
    c = W.copy_of(w, "pow2")
    capturing[0] = True
    assert W.copy_of(w, "pow2") is c
    with torch.no_grad():
        w.add_(1.0)
    assert W.copy_of(w, "pow2") is None and len(calls) == 1


@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=pytest.mark.interp)])
def test_the_optimizer_refreshes_the_copy(monkeypatch, impl):
    """AdamW.step writes the updated weight's copy in its pass: afterwards the FP8 copy is `quant_weight`
    of the new weight and the BF16 copy its cast, each matches its weight's version, and the next forward's
    request converts nothing; a weight without a copy (the embedding) gets the plain update."""
    w = torch.nn.Parameter(torch.randn(2, 256, 384))
    h = torch.nn.Parameter(torch.randn(300, 128))
    e = torch.nn.Parameter(torch.randn(300, 128))
    opt = AdamW([("layers.0.w1", w), ("head.weight", h), ("embed.weight", e)], OptimConfig())
    opt.impl = impl
    c, hc = W.copy_of(w, "pow2"), W.copy_of(h, "bf16")
    calls = count_quant(monkeypatch)
    for _ in range(2):
        w.grad, h.grad, e.grad = torch.randn_like(w), torch.randn_like(h), torch.randn_like(e)
        before = w.detach().clone()
        opt.step(1e-2)
        assert not torch.equal(before, w) and c.version == w._version and not hasattr(e, "low_copy")
        assert W.copy_of(w, "pow2") is c and W.copy_of(h, "bf16") is hc and calls == []
        assert_copy_of(c, w, exact=impl == "ref")
        assert hc.version == h._version
        if impl == "ref":
            assert torch.equal(hc.low, h.detach().bfloat16())
        else:  # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): within one bf16 step
            assert torch.allclose(hc.low.float(), h.detach(), rtol=2.0**-7, atol=0)


def test_weight_cache_falls_back_inside_a_capture(monkeypatch):
    """`WeightCache.get` hands out the weight's copy; during a capture where that copy does not match the
    weight, it makes one inside the capture, which the rest of the capture reuses (a capture runs no
    kernel: that buffer holds values only once a replay fills it), and which nothing after the capture
    reads. (The capture faked: CPU.)"""
    capturing = [False]
    monkeypatch.setattr(W, "capturing", lambda w: capturing[0])
    monkeypatch.setattr(X, "weight_capturing", lambda w: capturing[0])
    w = torch.nn.Parameter(torch.randn(2, 256, 128))
    cache = X.WeightCache()
    eager = cache.get(w, "pow2")
    assert eager is w.low_copy.low and cache.get(w, "pow2", transposed=True) is w.low_copy.low_t
    capturing[0] = True
    assert cache.get(w, "pow2") is eager  # the copy matches: the graph reads its buffers
    with torch.no_grad():
        w.add_(1.0)
    inside = cache.get(w, "pow2")
    assert inside is not eager and cache.get(w, "pow2") is inside and cache.get(w, "pow2", transposed=True) is not None
    capturing[0] = False
    after = cache.get(w, "pow2")
    assert after is eager and after is not inside
    assert_fp8_equal(after, inside, exact=True)


def train_losses(recipe, steps=3, seed=0, device="cpu"):
    model = Transformer(ModelConfig(), Recipe(recipe), seed=seed, loss_chunk=48).to(device)  # the head by chunks
    opt = AdamW(model.named_parameters(), OptimConfig())
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        t = torch.randint(0, 257, (2, 65), generator=g).to(device)
        o = model(t[:, :-1], t[:, 1:])
        (o.out + o.aux_loss).backward()
        opt.step(3e-3)
        opt.zero_grad()
        losses.append(o.out.item())
    copies = sum(hasattr(p, "low_copy") for p in model.parameters())
    return losses, copies


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("recipe", ["fp8", "bf16"])
def test_training_with_copies_repeats_training_without(monkeypatch, device, recipe):
    """The tiny model, three optimizer steps: with the copies (the optimizer quantizes or casts) and without
    (each forward converts the weights it reads), the same losses bit for bit. The copies cover every
    weight a GEMM reads in low precision: under FP8 the routed and shared experts', the dense MLP's and the
    dense linears' (FP8) and the LM head's (BF16); under BF16 the same, all BF16."""
    losses, copies = train_losses(recipe, device=device)
    model = Transformer(ModelConfig(), Recipe(recipe))
    gemm_weights = sum(p.dim() >= 2 for n, p in model.named_parameters() if not n.startswith("embed.")
                       and "router" not in n)
    assert copies == gemm_weights > 0
    monkeypatch.setattr(X, "copy_of", lambda *a, **k: None)
    monkeypatch.setattr(L, "copy_of", lambda *a, **k: None)
    monkeypatch.setattr(W, "copy_of", lambda *a, **k: None)  # bf16_of's
    plain, none = train_losses(recipe, device=device)
    assert none == 0 and all(torch.isfinite(torch.tensor(losses)))
    assert losses == plain, (losses, plain)
