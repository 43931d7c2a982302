"""The MoE transformer: shapes, parameter counts, causality, FP8 vs BF16 recipe (forward and
gradients), weight init; config validation."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from moefp8.config import Config, ModelConfig, validate
from moefp8.model import Transformer, flops_per_token, param_counts
from moefp8.recipe import Recipe
from moefp8.testing import saved_bytes, sqnr

TINY = ModelConfig()  # the schema's defaults are the tiny preset


def build(recipe="fp8", cfg=TINY, seed=0, **kw):
    return Transformer(cfg, Recipe(recipe), seed=seed, **kw)


def tokens(B=2, S=64, seed=1, V=257):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, S + 1), generator=g)


@pytest.mark.parametrize("recipe", ["fp8", "bf16"])
def test_shapes_and_load(recipe):
    m = build(recipe)
    t = tokens()
    o = m(t[:, :-1])
    assert o.out.shape == (2, 64, 257) and o.out.dtype == torch.float32
    Lm = TINY.n_layers - TINY.n_dense_layers
    assert o.load_LE.shape == (Lm, TINY.n_experts) and o.load_LE.dtype == torch.int64
    assert (o.load_LE.sum(1) == 2 * 64 * TINY.topk).all()  # every token picks topk experts in every MoE layer
    loss = m(t[:, :-1], t[:, 1:])
    assert loss.out.dim() == 0 and abs(loss.out.item() - 257 ** 0 * torch.log(torch.tensor(257.0)).item()) < 0.5
    assert loss.aux_loss.dim() == 0 and loss.aux_loss.item() > 0  # seq_aux_alpha > 0 in the default


@pytest.mark.parametrize("cfg", [TINY, replace(TINY, n_dense_layers=0, n_shared=0, n_experts=4, topk=1),
                                 replace(TINY, n_dense_layers=3)])
def test_param_counts(cfg):
    m = build("bf16", cfg)
    n = param_counts(cfg)
    assert n["total"] == sum(p.numel() for p in m.parameters())
    Lm = cfg.n_layers - cfg.n_dense_layers
    routed_inactive = Lm * (cfg.n_experts - cfg.topk) * 3 * cfg.hidden * cfg.moe_inter
    assert n["total"] - n["active"] == routed_inactive
    assert flops_per_token(cfg, 128) == 6 * (n["active"] - n["embedding"]) + 6 * cfg.n_layers * 128 * cfg.n_heads * cfg.head_dim


def test_dsv3_layer_counts():
    cfg = replace(TINY, hidden=7168, n_layers=1, n_dense_layers=0, n_heads=56, head_dim=128, moe_inter=2048,
                  n_experts=256, topk=8, n_groups=8, topk_groups=4)
    n = param_counts(cfg)
    expert = 3 * 7168 * 2048
    assert n["total"] - n["active"] == 248 * expert  # 256 - 8 routed experts idle per token


def test_causal():
    m = build("bf16")
    t = tokens(B=1, S=32)[:, :-1]
    t2 = t.clone()
    t2[0, 20] = (t2[0, 20] + 1) % 257
    a, b = m(t).out, m(t2).out
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=1e-5)
    assert (a[:, 20:] - b[:, 20:]).abs().max() > 1e-3


def test_fp8_vs_bf16_recipe():
    """Same weights, the two recipes: logits and gradients close. FP8 E4M3 operands carry ~3.6%
    RMS relative error each. Measured over seeds 0-2: logits SQNR 27.5-28.4 dB; gradients of the
    routed experts and the MoE norms 13.1-15.5 dB and of the routers 7.9-11.9 dB (some tokens pick
    other experts: discrete flips), every other gradient >= 20.5 dB. Floors a few dB below."""
    a, b = build("fp8"), build("bf16")
    b.load_state_dict(a.state_dict())
    t = tokens(B=2, S=128)
    la, lb = a(t[:, :-1], t[:, 1:]), b(t[:, :-1], t[:, 1:])
    (la.out + la.aux_loss).backward()
    (lb.out + lb.aux_loss).backward()
    assert abs(la.out.item() - lb.out.item()) < 0.02
    ga, gb = dict(a.named_parameters()), dict(b.named_parameters())
    for n in ga:
        floor = 6 if ".router." in n else 11 if ".mlp.w" in n and ga[n].dim() == 3 or "mlp_norm" in n else 18
        assert sqnr(ga[n].grad, gb[n].grad) > floor, (n, sqnr(ga[n].grad, gb[n].grad))
    with torch.no_grad():
        assert sqnr(a(t[:, :-1]).out, b(t[:, :-1]).out) > 25


def test_fp32_masters_and_bf16_activations():
    m = build("fp8")
    assert all(p.dtype == torch.float32 for p in m.parameters())
    seen = []
    h = m.layers[0].register_forward_hook(lambda mod, i, o: seen.append(o[0].dtype))
    m(tokens(B=1, S=16)[:, :-1])
    h.remove()
    assert seen == [torch.bfloat16]


def test_init_independent_of_expert_sharding():
    """Rank 1 of an EP group of 2 holds exactly the second half of the experts the EP=1 model has;
    every other weight is identical; a different seed changes everything."""
    full = build("bf16").state_dict()
    half = SimpleNamespace(num_experts=TINY.n_experts, num_local_experts=TINY.n_experts // 2, communicates=False,
                           scale_fmt=None)  # what the layer reads of a Dispatcher at construction
    shard = build("bf16", dispatcher=half, ep_rank=1).state_dict()
    experts = set(build("bf16").routed_expert_names())
    assert experts == {"layers.1.mlp.w1", "layers.1.mlp.w2", "layers.2.mlp.w1", "layers.2.mlp.w2"}
    for k, v in full.items():
        assert torch.equal(shard[k], v[TINY.n_experts // 2:] if k in experts else v), k
    other = build("bf16", seed=1).state_dict()
    assert not any(torch.equal(other[k], v) for k, v in full.items() if v.dim() >= 2)


def test_build_on_the_meta_device_is_the_same_model():
    """Transformer.build (what training builds: constructed on the meta device, allocated, drawn
    once) holds exactly the values of Transformer(...) -- norms at 1 and routers' biases at 0
    included -- and computes the same loss and gradients."""
    want = build("fp8", seed=5)
    got = Transformer.build(TINY, Recipe("fp8"), device=torch.device("cpu"), seed=5)
    sd_w, sd_g = want.state_dict(), got.state_dict()
    assert sd_w.keys() == sd_g.keys()
    for k, v in sd_w.items():
        assert torch.equal(sd_g[k], v), k
    assert any(k.endswith("router.bias") for k in sd_g) and any(k.endswith("norm.weight") for k in sd_g)
    t = tokens()
    for m in (want, got):
        out = m(t[:, :-1], t[:, 1:])
        (out.out + out.aux_loss).backward()
    for (n, a), b in zip(want.named_parameters(), got.parameters()):
        assert torch.equal(a.grad, b.grad), n


def test_init_is_each_tensors_own_draw():
    """reset_parameters draws on a pool of threads: every matrix (every expert) is still exactly
    randn(shape, generator seeded from (seed, its name)) times its std, whichever thread drew it."""
    import zlib

    m = build("bf16", seed=3)
    p = dict(m.named_parameters())

    def draw(shape, key):
        return torch.randn(shape, generator=torch.Generator().manual_seed(3 * 1_000_003 + zlib.crc32(key.encode())))
    s_out = TINY.init_std
    s_out *= (2 * TINY.n_layers) ** -0.5
    for e in range(TINY.n_experts):
        assert torch.equal(p["layers.2.mlp.w1"][e], draw((2 * TINY.moe_inter, TINY.hidden), f"layers.2.mlp.w1/{e}")
                           * TINY.init_std), e
        assert torch.equal(p["layers.1.mlp.w2"][e], draw((TINY.hidden, TINY.moe_inter), f"layers.1.mlp.w2/{e}") * s_out)
    w = p["layers.0.attn.wqkv.weight"]
    assert torch.equal(w, draw(w.shape, "layers.0.attn.wqkv.weight") * TINY.init_std)
    assert torch.equal(p["layers.1.mlp.router.weight"],
                       draw((TINY.n_experts, TINY.hidden), "layers.1.mlp.router.weight") * TINY.hidden ** -0.5)
    assert all(t.requires_grad for t in p.values())


def test_bf16_any_size():
    cfg = replace(TINY, hidden=96, n_heads=3, head_dim=32, dense_inter=80, moe_inter=48, n_experts=6, topk=3)
    m = build("bf16", cfg)
    t = tokens(B=2, S=17)
    o = m(t[:, :-1], t[:, 1:])
    o.out.backward()
    assert torch.isfinite(o.out)


def _cfg(**model):
    c = Config()
    c.model = replace(c.model, **model)
    c.data.path, c.data.prepare_from = "/nonexistent", "stdlib"
    return c


@pytest.mark.parametrize("model, recipe, match", [
    (dict(hidden=100), "fp8", "model.hidden=100"),
    (dict(hidden=100), "bf16", None),
    (dict(moe_inter=200), "fp8", "model.moe_inter=200"),
    (dict(n_heads=3), "fp8", r"model.n_heads\*model.head_dim=192"),
    (dict(topk=9), "fp8", "model.topk=9"),
    (dict(n_groups=3), "fp8", "model.n_groups=3"),
    (dict(n_groups=4, topk_groups=1, topk=4), "fp8", "model.topk=4"),
    (dict(n_dense_layers=4), "fp8", "model.n_dense_layers=4"),
    (dict(head_dim=63, n_heads=2), "bf16", "model.head_dim=63"),
])
def test_validate_model(model, recipe, match):
    c = _cfg(**model)
    c.recipe.recipe = recipe
    if match is None:
        validate(c)
    else:
        with pytest.raises(ValueError, match=match):
            validate(c)


def test_validate_other():
    c = _cfg()
    c.dispatch.backend, c.dispatch.ep_size = "all_to_all", 3
    with pytest.raises(ValueError, match="dispatch.ep_size=3"):
        validate(c)
    c = _cfg()
    c.train.seq_len = 0
    with pytest.raises(ValueError, match="train.seq_len=0"):
        validate(c)
    c = _cfg()
    c.data.prepare_from = ""
    with pytest.raises(ValueError, match="data.path='/nonexistent'"):
        validate(c)
    c = _cfg()
    c.recipe.recipe = "fp16"
    with pytest.raises(ValueError, match="recipe.recipe='fp16'"):
        validate(c)


def test_fp8_dense_false_keeps_dense_linears_in_bf16():
    """recipe.fp8_dense=false: attention projections and the dense MLP compute in BF16, experts in FP8;
    recipe.bf16_linears picks some of them; a name that is not a dense linear is refused."""
    from moefp8.config import Config
    from moefp8.linear import Bf16Linear, Fp8Linear

    c = Config(model=TINY)
    c.recipe.fp8_dense = False
    m = Transformer(TINY, Recipe.from_config(c.recipe))
    dense = [mod for n, mod in m.named_modules() if n.endswith(("wqkv", "wo"))]
    assert dense and all(isinstance(mod, Bf16Linear) for mod in dense)
    assert not any(isinstance(mod, Fp8Linear) for mod in m.modules())
    assert not any(b.mlp.fp8 for b in m.layers if not b.is_moe) and any(not b.is_moe for b in m.layers)
    assert all(b.mlp.recipe.fp8 and b.mlp.shared.fp8 for b in m.layers if b.is_moe)
    out = m(torch.randint(0, TINY.vocab_size, (2, 16)), torch.randint(0, TINY.vocab_size, (2, 16)))
    assert torch.isfinite(out.out)
    c.recipe.fp8_dense, c.recipe.bf16_linears = True, ["wqkv"]
    m = Transformer(TINY, Recipe.from_config(c.recipe))
    kinds = {n: type(mod).__name__ for n, mod in m.named_modules() if n.endswith(("wqkv", "wo"))}
    assert kinds["layers.0.attn.wqkv"] == "Bf16Linear" and kinds["layers.0.attn.wo"] == "Fp8Linear"
    assert m.layers[0].mlp.fp8 and kinds["layers.2.attn.wqkv"] == "Bf16Linear"
    c.recipe.bf16_linears = ["dense_mlp"]
    m = Transformer(TINY, Recipe.from_config(c.recipe))
    assert not m.layers[0].mlp.fp8 and m.layers[0].attn.wqkv.__class__.__name__ == "Fp8Linear"
    assert all(b.mlp.shared.fp8 for b in m.layers if b.is_moe)  # the shared experts follow the experts
    c.recipe.bf16_linears = ["wq"]
    with pytest.raises(ValueError, match="recipe.bf16_linears entry='wq': expected one of 'wqkv', 'wo', 'dense_mlp'"):
        validate(c)


def test_attention_backward_writes_d_qkv_once():
    """q, k, v come out of the wqkv output by `unbind`: its backward stacks the three gradients in
    one kernel. Three `qkv[:, :, i]` views would each zero-fill a full-size d(qkv) and autograd would
    add the three: 3 fills + 2 full-size adds per layer (~1 ms per layer on the small model)."""
    m = build("bf16")
    t = tokens()
    with torch.profiler.profile(record_shapes=True) as prof:
        m(t[:, :-1], t[:, 1:]).out.backward()
    qkv = [2, 64, 3, TINY.n_heads, TINY.head_dim]
    full = [e.key for e in prof.key_averages(group_by_input_shape=True) if e.input_shapes and e.input_shapes[0] == qkv]
    assert "aten::stack" in {e.key for e in prof.key_averages()}  # the unbind's backward ran
    assert not {"aten::zero_", "aten::fill_", "aten::add_", "aten::add"} & set(full), full


def test_fp8_attention_at_head_dim_128_takes_the_fused_qkv_rope(monkeypatch):
    """recipe=fp8, head_dim 128: every block's QKV projection and RoPE run as one function
    (`Fp8Linear.qkv_rope`: d(qkv) quantized in the RoPE backward); head_dim 64 keeps linear + rope_qkv."""
    from moefp8.linear import Fp8Linear

    calls = []
    fused = Fp8Linear.qkv_rope
    monkeypatch.setattr(Fp8Linear, "qkv_rope", lambda self, *a: calls.append(1) or fused(self, *a))
    cfg = replace(TINY, hidden=256, n_heads=2, head_dim=128)
    m = build("fp8", cfg)
    t = tokens(S=32)
    loss = m(t[:, :-1], t[:, 1:]).out
    loss.backward()
    assert len(calls) == cfg.n_layers and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
    calls.clear()
    build("fp8")(t[:, :-1], t[:, 1:])  # TINY: head_dim 64
    assert not calls


def test_rms_norm_rounds_once_to_bf16():
    """RMSNorm takes and returns BF16 (no fp32 copies of the activation either way) and computes in
    fp32 with the weight's BF16 copy, rounding once: equal to the fp32 computation rounded at the end."""
    from moefp8.model import RMSNorm

    norm = RMSNorm(256, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(8, 256) * 3).bfloat16()
    ref = torch.nn.functional.rms_norm(x.float(), (256,), norm.weight.bfloat16().float(), 1e-6).bfloat16()
    y = norm(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fused_norm_is_the_same_function(device, monkeypatch):
    """model.fused_norm: every RMSNorm by kernels/norm.py, each block's residual add before its MLP's
    norm in the same call, and its input's two gradients (its norm's, the residual's) summed in the
    attention norm's backward pass. CPU: the same code (bit for bit); CUDA: the kernels, whose roundings differ
    from torch's by BF16 ulps (a loss within 1e-3, gradients within 2% relative: BF16 rounding flips
    through a few layers; a wrong gradient is O(1))."""
    import moefp8.model as M

    calls, splits = [], []
    fused_add, fused_split = M.add_rms_norm, M.rms_norm_split
    monkeypatch.setattr(M, "add_rms_norm", lambda *a, **k: calls.append(1) or fused_add(*a, **k))
    monkeypatch.setattr(M, "rms_norm_split", lambda *a, **k: splits.append(1) or fused_split(*a, **k))
    t = tokens(B=2, S=64).to(device)
    runs = []
    for fused in (False, True):
        m = build("bf16", replace(TINY, fused_norm=fused)).to(device)  # (the norms are the recipe's either way)
        loss = m(t[:, :-1], t[:, 1:]).out
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    assert len(calls) == len(splits) == TINY.n_layers  # each block's input: its norm and the residual in one
    (l0, g0), (l1, g1) = runs
    assert g0.keys() == g1.keys() and any("norm" in n for n in g0)
    if device == "cpu":
        assert torch.equal(l0, l1) and all(torch.equal(g0[n], g1[n]) for n in g0)
    else:
        assert torch.isfinite(l1) and abs(float(l1 - l0)) <= 1e-3 * abs(float(l0))
        for n in g0:
            err = float((g1[n].float() - g0[n].float()).norm() / (g0[n].float().norm() + 1e-30))
            assert err < 2e-2, (n, err)


@pytest.mark.gpu
def test_gpu_fp8_norm_in_the_qkv_function_is_the_unfused_path(monkeypatch):
    """FP8 with fused norms: each block's attention norm runs inside its QKV function
    (`Fp8NormQKVRopeFunction`: the normed rows quantized in the norm's pass): loss and every gradient those
    of the unfused path (the norm's split, then the QKV function), up to the fused kernel's r one fp32 step
    apart in some rows (kernels/norm.py `_normed`): loss within 1e-4, each gradient within 2^-7, relative."""
    import moefp8.model as M

    t = tokens(B=2, S=64).to("cuda")
    fused_apply, fuses = M.Fp8NormQKVRopeFunction.apply, M.fuses_norm
    calls, runs = [], []
    monkeypatch.setattr(M.Fp8NormQKVRopeFunction, "apply", lambda *a: calls.append(1) or fused_apply(*a))
    for fuse in (True, False):
        monkeypatch.setattr(M, "fuses_norm", lambda *a: fuse and fuses(*a))
        m = build("fp8", replace(TINY, fused_norm=True, head_dim=128)).cuda()  # (the FP8 QKV function: 128-wide heads)
        loss = m(t[:, :-1], t[:, 1:]).out
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = runs
    assert len(calls) == TINY.n_layers  # the fused run's blocks, each once
    assert torch.isfinite(l0) and abs(float(l1 - l0)) <= 1e-4 * abs(float(l0)) and g0.keys() == g1.keys()
    for n in g0:
        err = float((g1[n].float() - g0[n].float()).norm() / (g0[n].float().norm() + 1e-30))
        assert err <= 2.0**-7, (n, err)


@pytest.mark.parametrize("recipe", ["fp8", "bf16"])
def test_dense_mlp_is_the_shared_experts_mlp(recipe):
    """The dense layers' MLP and the shared experts are one `MLP`: under FP8 the dense MLP keeps its
    SwiGLU input h [T, 2I] in FP8 for backward (recomputing the SwiGLU) and its x col-wise in FP8;
    under BF16 both in BF16. Its input gradient and output match the fp32 autograd of the same MLP."""
    from moefp8.mlp import MLP

    m = build(recipe)
    mlp = m.layers[0].mlp
    assert type(mlp) is MLP and type(m.layers[1].mlp.shared) is MLP and mlp.fp8 == (recipe == "fp8")
    T, Id = 2 * 40, TINY.dense_inter
    x = torch.randn(2, 40, TINY.hidden).bfloat16().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = mlp(x)
    want = torch.float8_e4m3fn if recipe == "fp8" else torch.bfloat16
    assert any(t.shape == (T, 2 * Id) and t.dtype == want for t in saved), [(t.shape, t.dtype) for t in saved]
    assert any(sorted(t.shape) == sorted((T, TINY.hidden)) and t.dtype == want for t in saved)  # x (FP8: col-wise, [H, T])
    y.backward(torch.ones_like(y))
    xr = x.detach().float().requires_grad_()
    gate, up = (xr @ mlp.w1.detach().t()).chunk(2, dim=-1)
    yr = (torch.nn.functional.silu(gate) * up) @ mlp.w2.detach().t()
    yr.backward(torch.ones_like(yr))
    floor = 20 if recipe == "fp8" else 40  # as test_moe.test_shared_experts_match_autograd_mlp
    assert y.shape == x.shape and sqnr(y.float(), yr) > floor and sqnr(x.grad.float(), xr.grad) > floor


@pytest.mark.parametrize("recipe", ["fp8", "bf16"])
def test_attention_recompute_gives_the_same_gradients_and_keeps_less(recipe):
    """train.recompute=[attention]: bit-identical loss and gradients on CPU (the same ops run again),
    fewer bytes kept for the backward, and the FP8 tile statistics of the step counted once."""
    t = tokens(B=2, S=64)
    x, y = t[:, :-1], t[:, 1:]
    runs = []
    for recompute in ((), ("attention",)):
        m = build(recipe, recompute=recompute)
        m.scale_stats.on = True
        kept, loss = saved_bytes(lambda: m(x, y).out)
        loss.backward()
        runs.append((loss.detach(), kept, {n: p.grad for n, p in m.named_parameters()}, m.scale_stats.report()))
    (l0, k0, g0, s0), (l1, k1, g1, s1) = runs
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[n], g1[n]) for n in g0)
    assert k1 < 0.85 * k0, (k1, k0)
    assert s0 == s1  # (empty for bf16)


def test_recompute_config():
    with pytest.raises(ValueError, match=r"train.recompute entry='mlp': expected one of 'attention', 'expert_out'"):
        validate(replace(Config(), train=replace(Config().train, recompute=["mlp"])))
    cfg = Config()
    cfg = replace(cfg, train=replace(cfg.train, recompute=["attention"]),
                  dispatch=replace(cfg.dispatch, overlap=True, backend="all_to_all", ep_size=2))
    with pytest.raises(ValueError, match=r"attention not with dispatch.overlap=true"):
        validate(cfg)
    validate(replace(cfg, train=replace(cfg.train, recompute=["expert_out"])))  # the overlap's stages do it too


def test_expert_out_recompute_reaches_every_moe_layer():
    m = build("fp8", recompute=("expert_out",))
    moe = [b.mlp for b in m.layers if b.is_moe]
    assert moe and all(x.recompute_out for x in moe) and not any(b.recompute_attention for b in m.layers)
    assert not any(b.mlp.recompute_out for b in build("fp8").layers if b.is_moe)


def test_embed_init_std_and_the_routing_of_an_untrained_model():
    """model.embed_init_std draws the token embeddings at that std (0: init_std, every other weight
    unchanged). At the default an untrained 8-layer model routes nearly every token of a 512-token
    sequence to the same experts in its deep MoE layers (the attention's shared context average
    outweighs each token's embedding); with N(0, 1) embeddings (torchtitan's init) they spread."""
    from moefp8.router import load_stats

    cfg = ModelConfig(vocab_size=1024, hidden=256, n_layers=8, n_heads=2, head_dim=128, dense_inter=512, moe_inter=128,
                      n_experts=32, topk=4, n_dense_layers=1)
    x = torch.randint(0, 1024, (1, 512), generator=torch.Generator().manual_seed(0))
    worst = {}
    for std in (0.0, 1.0):
        m = Transformer(replace(cfg, embed_init_std=std), Recipe("bf16"), seed=0)
        if std:
            assert abs(float(m.embed.weight.detach().std()) - std) < 0.01
            ref = Transformer(cfg, Recipe("bf16"), seed=0)
            assert all(torch.equal(p, ref.state_dict()[n]) for n, p in m.state_dict().items() if n != "embed.weight")
        else:
            assert abs(float(m.embed.weight.detach().std()) - cfg.init_std) < 1e-3
        with torch.no_grad():
            load_LE = m(x, x).load_LE
        worst[std] = max(load_stats(l)["load_max_over_mean"] for l in load_LE[3:])  # the deeper MoE layers
    assert worst[0.0] > 4 and worst[1.0] < 2.5, worst  # max possible: E / K = 8
