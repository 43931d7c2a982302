"""Router: weights, bias balancing, auxiliary loss, errors (the selection itself: tests/kernels/test_route.py)."""

import pytest
import torch

from moefp8.router import Router, load_stats, seq_aux_loss


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_weights_are_unbiased_scores(score_func):
    torch.manual_seed(0)
    r = Router(64, 8, 2, score_func=score_func, route_scale=2.5)
    x = torch.randn(50, 64, dtype=torch.bfloat16)
    r.bias[3] = 100.0  # forces expert 3 into every selection, must not change its weight
    out = r(x)
    assert (out.topk_idx_TK == 3).any(1).all()
    logits = x.float() @ r.weight.float().t()
    scores = logits.sigmoid() if score_func == "sigmoid" else logits.softmax(-1)
    w = scores.gather(1, out.topk_idx_TK)
    if score_func == "sigmoid":
        w = w / w.sum(-1, keepdim=True)
    torch.testing.assert_close(out.topk_w_TK, w * 2.5, rtol=1e-6, atol=0)
    assert out.topk_w_TK.dtype == torch.float32 and out.aux_loss is None
    assert torch.equal(out.load_E, torch.bincount(out.topk_idx_TK.view(-1), minlength=8))


@pytest.mark.gpu
def test_gpu_router_does_not_sync_with_the_host():
    """The router runs at the head of every MoE layer: a device sync there (torch.bincount reads the
    ids' max on the host) drains the GPU queue each layer and makes the step host-paced."""
    torch.manual_seed(0)
    r = Router(256, 64, 8, n_groups=8, topk_groups=4, seq_aux_alpha=1e-3).cuda()
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r(x, seq_len=128)  # warm-up: lazy initialisation may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = r(x, seq_len=128)
        (out.topk_w_TK.sum() + out.aux_loss).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out.load_E.cpu(), torch.bincount(out.topk_idx_TK.view(-1).cpu(), minlength=64))


def test_force_balance_spreads_a_collapsed_router():
    """model.force_balanced_routing (benchmarks): a fresh router whose tokens all look alike (the
    residual stream's shared direction at init) sends every token to the same K experts; with random
    logits each expert gets its share up to sampling noise. The weights are the random logits' scores
    renormalized, and the gradient still reaches the router's weight (the same backward work)."""
    T, E, K = 4096, 16, 2
    torch.manual_seed(0)
    x = torch.randn(1, 64).expand(T, 64).contiguous()  # every token the same
    plain, forced = Router(64, E, K), Router(64, E, K, force_balance=True)
    forced.load_state_dict(plain.state_dict())
    assert load_stats(plain(x).load_E)["load_max_over_mean"] == E / K  # collapsed: one set of K experts
    out = forced(x)
    stats = load_stats(out.load_E)
    # T*K/E = 512 tokens per expert, binomial sd ~21: max over 16 experts < mean + 5 sd
    assert stats["load_max_over_mean"] < 1.2 and stats["experts_empty"] == 0, stats
    w = out.topk_w_TK
    assert torch.isfinite(w).all() and torch.allclose(w.sum(-1), torch.ones(T))
    assert not torch.equal(out.topk_idx_TK, forced(x).topk_idx_TK)  # new logits every call
    x.requires_grad_(True)
    forced(x).topk_w_TK.pow(2).sum().backward()
    assert forced.weight.grad is not None and forced.weight.grad.abs().sum() > 0 and x.grad.abs().sum() > 0


def test_force_balanced_routing_reaches_every_router():
    from moefp8.config import ModelConfig
    from moefp8.model import Transformer

    cfg = ModelConfig(n_layers=3, n_dense_layers=1, force_balanced_routing=True)
    routers = [b.mlp.router for b in Transformer(cfg).layers if b.is_moe]
    assert len(routers) == 2 and all(r.force_balance for r in routers)
    assert not any(b.mlp.router.force_balance for b in Transformer(ModelConfig(n_layers=2)).layers if b.is_moe)


def test_update_bias_moves_towards_mean_load():
    r = Router(16, 4, 1, bias_update_rate=0.01)
    r.update_bias(torch.tensor([10, 2, 6, 6]))
    assert torch.allclose(r.bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    # balancing works: a router whose scores favour one expert spreads out as the bias updates
    torch.manual_seed(1)
    r = Router(16, 4, 1, score_func="sigmoid", bias_update_rate=0.05)
    with torch.no_grad():
        r.weight[0] += 1.0
    x = torch.randn(256, 16).abs()
    first = load_stats(r(x).load_E)["load_max_over_mean"]
    for _ in range(100):
        r.update_bias(r(x).load_E)
    assert load_stats(r(x).load_E)["load_max_over_mean"] < first


def test_seq_aux_loss_matches_formula_and_has_gradient():
    torch.manual_seed(2)
    E, k, S, B = 6, 2, 10, 3
    r = Router(32, E, k, score_func="softmax", seq_aux_alpha=0.1)
    x = torch.randn(B * S, 32, dtype=torch.float64)
    out = r(x, seq_len=S)
    scores = (x @ r.weight.detach().double().t()).softmax(-1)
    want = 0.0
    for b in range(B):
        sb, ib = scores[b * S:(b + 1) * S], out.topk_idx_TK[b * S:(b + 1) * S]
        f = torch.stack([(ib == i).sum().double() * E / (k * S) for i in range(E)])
        p = (sb / sb.sum(-1, keepdim=True)).mean(0)
        want += float((f * p).sum().detach()) / B
    assert abs(float(out.aux_loss.detach()) - 0.1 * want) < 1e-12
    out.aux_loss.backward()
    assert r.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="30 tokens are not a whole number of sequences of 7"):
        seq_aux_loss(scores, out.topk_idx_TK, E, k, 7)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kw", [dict(score_func="softmax", seq_aux_alpha=0.1),
                                dict(score_func="sigmoid", seq_aux_alpha=0.1, n_groups=3, topk_groups=2)])
def test_router_of_no_token(device, kw):
    """A rank that holds no token (EP's zero-token case): empty routing, and the sequence-wise loss 0 with a
    gradient of zeros (a mean over no sequence was NaN). On a GPU: BF16 input, the bf16x3 logits and the
    selection kernel on no row."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    r = Router(256, 6, 2, **kw).to(device)
    out = r(torch.zeros(0, 256, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32),
            seq_len=10)
    assert out.topk_idx_TK.shape == (0, 2) and out.topk_w_TK.shape == (0, 2)
    assert float(out.aux_loss.detach()) == 0.0
    out.aux_loss.backward()
    assert r.weight.grad is None or not r.weight.grad.any()


def test_routing_weight_gradient_float64():
    torch.manual_seed(3)
    r = Router(8, 6, 2, n_groups=3, topk_groups=2).double()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)

    def f(x, w):
        return torch.func.functional_call(r, {"weight": w, "bias": r.bias}, (x,)).topk_w_TK

    assert torch.autograd.gradcheck(f, (x, r.weight.detach().clone().requires_grad_()))


@pytest.mark.parametrize("kwargs,msg", [
    (dict(n_experts=4, topk=5), "topk=5 must be between 1 and the number of experts"),
    (dict(n_experts=10, topk=2, n_groups=4), "n_groups=4 does not divide n_experts=10"),
    (dict(n_experts=8, topk=2, n_groups=4, topk_groups=5), "topk_groups=5 must be between 1 and n_groups=4"),
    (dict(n_experts=8, topk=4, n_groups=4, topk_groups=1), "topk=4 experts cannot come from topk_groups=1 groups"),
    (dict(n_experts=8, topk=2, score_func="relu"), "score_func='relu'"),
])
def test_config_errors(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        Router(16, **kwargs)


def test_load_stats():
    st = load_stats(torch.tensor([4, 0, 2, 2]))
    assert st == {"load_max_over_mean": 2.0, "load_min": 0, "load_max": 4, "experts_empty": 1}


# ----------------------------------------------------------------------------------------------
# The router's GEMMs as three BF16 products (router.logits_bf16x3): fp32 accuracy


def _values_with_outliers(shape, seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 21, shape, generator=g).float())
    v.view(-1)[::7] = 0.0
    v.view(-1)[1] = 3.0e38
    v.view(-1)[2] = -1.0e-30
    return v


def test_bf16x3_parts_sum_exactly():
    from moefp8.router import bf16x3
    v = _values_with_outliers((37, 96), 0)
    parts = bf16x3(v, 0)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3 * 37, 96)
    p = parts.double().view(3, 37, 96)
    assert torch.equal(p[0] + p[1] + p[2], v.double())
    # the first part alone is v rounded to BF16: the other two carry what it lost (a check that can fail)
    assert not torch.equal(p[0], v.double())


def _normalized_err(got, want, scale):
    return float(((got.detach().double() - want) / scale.clamp_min(1e-300)).abs().max())


@pytest.mark.parametrize("T", [1, 67, 256])
def test_logits_bf16x3_forward_and_backward_at_fp32_accuracy(T):
    """Against fp64 on the same inputs, error normalized by sum |x_k w_k| (so cancellation does not
    inflate it): logits and dW within 2^-20 (an fp32 GEMM of H = 512 terms: <= ~H * 2^-24 worst
    case, far less typically), dx within BF16's rounding (2^-8: it is returned in BF16)."""
    from moefp8.router import bf16x3, logits_backward_bf16x3, logits_bf16x3
    torch.manual_seed(T)
    H, E = 512, 16
    x = (torch.randn(T, H) * 3).to(torch.bfloat16)
    x[0, :5] = 0
    w = torch.randn(E, H) * H**-0.5
    w[3] *= 1000.0  # an outlier expert row
    g = torch.randn(T, E) * torch.exp2(torch.randint(-8, 9, (T, E)).float())
    xd, wd, gd = x.double(), w.double(), g.double()
    logits = logits_bf16x3(x, bf16x3(w, 0))
    assert logits.dtype == torch.float32 and logits.shape == (T, E)
    assert _normalized_err(logits, xd @ wd.t(), xd.abs() @ wd.abs().t()) < 2**-20
    dx, dw = logits_backward_bf16x3(g, x, bf16x3(w, 0), True, True)
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    assert _normalized_err(dw, gd.t() @ xd, gd.abs().t() @ xd.abs()) < 2**-20
    assert _normalized_err(dx, gd @ wd, gd.abs() @ wd.abs()) < 2**-8
    # a BF16-rounded W alone (one part) misses the forward bound: the test can fail
    w1 = w.to(torch.bfloat16).double()
    assert _normalized_err((xd @ w1.t()).float(), xd @ wd.t(), xd.abs() @ wd.abs().t()) > 2**-20


def test_logits_bf16x3_of_no_token():
    """A rank that holds no token (T = 0, EP's zero-token case): logits [0, E], dx [0, H], dW zeros."""
    from moefp8.router import bf16x3, logits_backward_bf16x3, logits_bf16x3
    H, E = 256, 8
    x, w3 = torch.zeros(0, H, dtype=torch.bfloat16), bf16x3(torch.randn(E, H), 0)
    assert logits_bf16x3(x, w3).shape == (0, E)
    dx, dw = logits_backward_bf16x3(torch.zeros(0, E), x, w3, True, True)
    assert dx.shape == (0, H) and dw.shape == (E, H) and not dw.any()


@pytest.mark.gpu
def test_gpu_router_logits_on_bf16_tensor_cores_match_fp32():
    """On a GPU the router's GEMMs take the three-product path (torch.mm with an fp32 output): the
    logits and both gradients agree with the fp32 GEMMs within fp32 accumulation error."""
    from moefp8.router import _bf16x3_applies, _Logits
    torch.manual_seed(0)
    T, H, E = 4099, 2048, 64
    x = (torch.randn(T, H, device="cuda") * 2).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(E, H, device="cuda") * H**-0.5).requires_grad_()
    assert _bf16x3_applies(x, w, torch.float32)
    g = torch.randn(T, E, device="cuda")
    out = _Logits.apply(x, w, torch.float32)
    out.backward(g)
    xd, wd, gd = x.detach().double(), w.detach().double(), g.double()
    assert torch.isfinite(out).all()
    assert _normalized_err(out, xd @ wd.t(), xd.abs() @ wd.abs().t()) < 2**-18
    assert _normalized_err(w.grad, gd.t() @ xd, gd.abs().t() @ xd.abs()) < 2**-18
    assert _normalized_err(x.grad, gd @ wd, gd.abs() @ wd.abs()) < 2**-8
    ref = torch.nn.functional.linear(x.detach().float(), w.detach())  # cuBLAS fp32, the former path
    assert _normalized_err(out, ref.double(), xd.abs() @ wd.abs().t()) < 2**-18


def test_logits_function_takes_the_bf16x3_path_end_to_end(monkeypatch):
    """The autograd wiring of the GPU path (the forward's parts saved for the backward), run on the CPU with
    the path forced: the logits and both gradients at fp32 accuracy; a router on it gives the same routes."""
    import moefp8.router as R
    monkeypatch.setattr(R, "_bf16x3_applies", lambda x, w, dt: x.dtype == torch.bfloat16 and dt == torch.float32)
    torch.manual_seed(1)
    x = (torch.randn(33, 256) * 2).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(8, 256) * 0.06).requires_grad_()
    g = torch.randn(33, 8)
    out = R._Logits.apply(x, w, torch.float32)
    out.backward(g)
    xd, wd, gd = x.detach().double(), w.detach().double(), g.double()
    assert _normalized_err(out.detach(), xd @ wd.t(), xd.abs() @ wd.abs().t()) < 2**-20
    assert _normalized_err(w.grad, gd.t() @ xd, gd.abs().t() @ xd.abs()) < 2**-20
    assert x.grad.dtype == torch.bfloat16 and _normalized_err(x.grad, gd @ wd, gd.abs() @ wd.abs()) < 2**-8
    r = Router(256, 8, 2)
    xs = torch.randn(40, 256).to(torch.bfloat16)
    got = r(xs)
    monkeypatch.setattr(R, "_bf16x3_applies", lambda x, w, dt: False)
    want = r(xs)
    assert torch.equal(got.topk_idx_TK, want.topk_idx_TK)
    torch.testing.assert_close(got.topk_w_TK, want.topk_w_TK, rtol=1e-5, atol=0)
