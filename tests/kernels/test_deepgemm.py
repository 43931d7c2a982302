"""kernels/deepgemm.py: moefp8's group offsets as DeepGEMM's per-row expert indices, and the
m-grouped GEMM handed to DeepGEMM with moefp8's operands. On CPU a stand-in module with DeepGEMM's
call signature checks the wiring; on a GPU with `deep_gemm` built, the outputs must equal moefp8's
m-grouped GEMM bit for bit (the issue's premise: same numerics)."""

import types

import pytest
import torch

from moefp8.fp8 import Fp8Tensor
from moefp8.kernels import deepgemm
from moefp8.kernels.grouped_gemm import fp8_grouped_gemm, fp8_grouped_gemm_ref
from moefp8.kernels.quant import quant_rowwise, quant_weight


def test_m_indices():
    off = [0, 128, 128, 384, 512]  # expert 1 empty
    got = deepgemm.m_indices(off, 640)
    want = [0] * 128 + [2] * 256 + [3] * 128 + [-1] * 128
    assert got.dtype == torch.int32 and got.tolist() == want
    assert deepgemm.m_indices(torch.tensor([0, 0, 0]), 0).numel() == 0
    assert deepgemm.m_indices(torch.tensor([0, 0, 0], dtype=torch.int32), 3).tolist() == [-1] * 3  # all empty


def _operands(counts, K=256, N=384, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    off = [0]
    for c in counts:
        off.append(off[-1] + -(-c // 128) * 128)
    M = off[-1]
    x = torch.randn(M, K, generator=g, device=device) * 3
    for e, c in enumerate(counts):  # the permute's padding rows: zeros
        x[off[e] + c:off[e + 1]] = 0
    w = torch.randn(len(counts), N, K, generator=g, device=device) / K**0.5
    return quant_rowwise(x.bfloat16()), quant_weight(w), off


def fake_deep_gemm():
    """DeepGEMM's m_grouped_fp8_gemm_nt_contiguous signature over dequantized fp32 math."""
    def m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices):
        (ad, asf), (bd, bsf) = a, b
        assert ad.dtype == bd.dtype == torch.float8_e4m3fn and asf.dtype == bsf.dtype == torch.float32
        assert d.dtype == torch.bfloat16 and m_indices.dtype == torch.int32 and m_indices.is_contiguous()
        A = ad.float() * asf.repeat_interleave(128, dim=1)[:, :ad.shape[1]]
        B = bd.float() * bsf.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)[:, :bd.shape[1], :bd.shape[2]]
        d.zero_()
        for e in range(bd.shape[0]):
            rows = (m_indices == e).nonzero().flatten()
            if rows.numel():
                s, t = rows[0].item(), rows[-1].item() + 1
                assert rows.numel() == t - s  # contiguous segments
                d[s:t] = (A[s:t] @ B[e].t()).bfloat16()
    return types.SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=m_grouped_fp8_gemm_nt_contiguous)


@pytest.mark.parametrize("counts", [[130, 0, 7, 256], [1], [0, 0, 5]])
def test_m_grouped_wiring_matches_the_reference(counts):
    a8, w8, off = _operands(counts)
    got = deepgemm.m_grouped(a8, w8, deepgemm.m_indices(off, a8.data.shape[0]), fake_deep_gemm())
    assert torch.equal(got, fp8_grouped_gemm_ref(a8, w8, off))
    with pytest.raises(ValueError, match="need equal K and int32"):
        deepgemm.m_grouped(a8, w8, deepgemm.m_indices(off, a8.data.shape[0]).long(), fake_deep_gemm())


@pytest.mark.gpu
def test_gpu_deep_gemm_equals_moefp8_bit_for_bit():
    dg = deepgemm.load()
    if dg is None or not torch.cuda.is_available():
        pytest.skip("deep_gemm not installed")
    for counts, N, K in (([1000, 0, 37, 4096], 4096, 7168), ([2048] * 8, 7168, 2048)):
        a8, w8, off = _operands(counts, K, N, device="cuda")
        off_t = torch.tensor(off, dtype=torch.int32, device="cuda")
        want = fp8_grouped_gemm(a8, w8, off_t)
        got = deepgemm.m_grouped(a8, w8, deepgemm.m_indices(off_t, a8.data.shape[0]), dg)
        assert torch.equal(got, want), (counts, (got.float() - want.float()).abs().max().item())


def fake_deep_gemm_k_grouped():
    """DeepGEMM's k_grouped_fp8_gemm_nt_contiguous (SM90) over dequantized fp32 math: a and b flat, each
    group's [m, k_g] (and [n, k_g]) block contiguous; scales [m, sum_k/128]; d = c + aᵀ·b per group."""
    def k_grouped_fp8_gemm_nt_contiguous(a, b, d, ks_cpu, grouped_layout, c):
        (ad, asf), (bd, bsf) = a, b
        assert ad.dim() == bd.dim() == 1 and ad.dtype == bd.dtype == torch.float8_e4m3fn
        assert grouped_layout.dtype == torch.int32 and grouped_layout.tolist() == list(ks_cpu)
        m, n, pa, pb, kb = asf.shape[0], bsf.shape[0], 0, 0, 0
        for g, k in enumerate(ks_cpu):
            A = ad[pa:pa + m * k].view(m, k).float() * asf[:, kb:kb + k // 128].repeat_interleave(128, dim=1)
            B = bd[pb:pb + n * k].view(n, k).float() * bsf[:, kb:kb + k // 128].repeat_interleave(128, dim=1)
            d[g] = c[g] + A @ B.t()
            pa, pb, kb = pa + m * k, pb + n * k, kb + k // 128
    return types.SimpleNamespace(k_grouped_fp8_gemm_nt_contiguous=k_grouped_fp8_gemm_nt_contiguous)


def _wgrad_operands(counts, N=256, K=384, device="cpu", seed=0):
    from moefp8.kernels.quant import quant_colwise

    g = torch.Generator(device=device).manual_seed(seed)
    ks = [-(-c // 128) * 128 for c in counts]
    M = sum(ks)
    dy = torch.randn(M, N, generator=g, device=device) * 3
    x = torch.randn(M, K, generator=g, device=device)
    dy[:7] *= 1000  # an outlier block
    return quant_colwise(dy.bfloat16()), quant_colwise(x.bfloat16()), ks


@pytest.mark.parametrize("counts", [[130, 0, 7, 256], [1], [300, 5]])
def test_k_grouped_wiring_matches_the_reference(counts):
    """k_grouped_operand lays out each expert's tokens as DeepGEMM reads them: the stand-in's dW
    (dequantized math, accumulated into out) equals moefp8's wgrad reference within fp32 rounding."""
    from moefp8.kernels.grouped_gemm import fp8_grouped_gemm_wgrad_ref

    dyc, xc, ks = _wgrad_operands(counts)
    off = [0]
    for k in ks:
        off.append(off[-1] + k)
    acc = torch.randn(len(ks), 256, 384)
    want = fp8_grouped_gemm_wgrad_ref(dyc, xc, off, acc.clone())
    got = deepgemm.k_grouped(deepgemm.k_grouped_operand(dyc, ks), deepgemm.k_grouped_operand(xc, ks), ks,
                             fake_deep_gemm_k_grouped(), out=acc)
    assert got is acc and not got.isnan().any()
    assert (got - want).norm() / want.norm() < 1e-6  # same products, fp32 sums in another order
    with pytest.raises(ValueError, match=r"must be multiples of 128 summing to the"):
        deepgemm.k_grouped_operand(dyc, ks + [128])


@pytest.mark.gpu
def test_gpu_deep_gemm_k_grouped_matches_moefp8():
    """DeepGEMM's k-grouped wgrad on moefp8's "128x1" operands against moefp8's kernel: relative
    error at fp32 rounding (same products and promotion per 128 tokens; the order of the fp32 adds may
    differ), no NaN; an empty expert leaves its dW as it was."""
    from moefp8.kernels.grouped_gemm import fp8_grouped_gemm_wgrad

    dg = deepgemm.load()
    if dg is None or not torch.cuda.is_available():
        pytest.skip("deep_gemm not installed")
    for counts, N, K in (([1000, 37, 4096, 200], 4096, 7168), ([2048] * 8, 7168, 2048)):
        dyc, xc, ks = _wgrad_operands(counts, N, K, device="cuda")
        off = torch.tensor([0] + [sum(ks[:i + 1]) for i in range(len(ks))], dtype=torch.int32, device="cuda")
        want = fp8_grouped_gemm_wgrad(dyc, xc, off)
        got = deepgemm.k_grouped(deepgemm.k_grouped_operand(dyc, ks), deepgemm.k_grouped_operand(xc, ks), ks, dg)
        assert not got.isnan().any()
        assert ((got - want).norm() / want.norm()).item() < 1e-6, counts


def test_recipe_gemm_is_checked_before_anything_runs():
    """recipe.gemm: a value of GEMM_LIBS (the config's are the GemmPolicy's and auto); deepgemm
    needs a CUDA GPU, the fp8 recipe and `deep_gemm` importable, else one line naming the fix."""
    from moefp8.config import GEMM_LIBS, Config, validate
    from moefp8.kernels.grouped_gemm import GEMM_LIBS as POLICY_LIBS
    from moefp8.kernels.grouped_gemm import GemmPolicy
    from moefp8.launch import check_launch

    assert GEMM_LIBS == (*POLICY_LIBS, "auto") and GemmPolicy().mgrouped_lib == "moefp8"
    c = Config()
    c.recipe.gemm = "cutlass"
    with pytest.raises(ValueError, match=r"recipe.gemm='cutlass': expected one of 'moefp8', 'deepgemm', 'auto'"):
        validate(c)
    with pytest.raises(ValueError, match=r"mgrouped_lib='cutlass'"):
        GemmPolicy(mgrouped_lib="cutlass")
    c.recipe.gemm, c.train.device = "deepgemm", "cpu"
    validate(c)
    with pytest.raises(ValueError, match=r"recipe.gemm=deepgemm: DeepGEMM's FP8 GEMMs run on CUDA GPUs .*"
                                         r"use recipe.gemm=moefp8"):
        check_launch(c)



def _stand_in(identical: bool):
    """deep_gemm's m-grouped call computing moefp8's reference (bit-identical), or off by one ulp."""
    from moefp8.kernels.grouped_gemm import fp8_grouped_gemm_ref

    def m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices):
        (ad, asf), (bd, bsf) = a, b
        ends = [int((m_indices == e).nonzero().max()) + 1 for e in range(bd.shape[0])]
        ref = fp8_grouped_gemm_ref(Fp8Tensor(ad, asf, "1x128"), Fp8Tensor(bd, bsf, "128x128"), [0, *ends])
        d.copy_(ref)
        if not identical:
            d.view(torch.int16)[0, 0] += 1  # one BF16 ulp on one element
    return types.SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=m_grouped_fp8_gemm_nt_contiguous)


@pytest.mark.parametrize("identical, deepgemm_ms, want", [(True, 1.0, "deepgemm"), (True, 3.0, "moefp8"),
                                                          (False, 1.0, "moefp8")])
def test_auto_picks_deepgemm_only_when_bit_identical_and_faster(identical, deepgemm_ms, want):
    """choose_mgrouped_lib (recipe.gemm=auto) on CPU with a stand-in: fprop and dgrad of each shape
    compared bit for bit and timed (the timer tells moefp8's calls from DeepGEMM's)."""
    from moefp8.kernels.grouped_gemm import choose_mgrouped_lib

    def timer(fn):
        return deepgemm_ms if "m_grouped" in fn.__code__.co_names else 2.0
    lib, why = choose_mgrouped_lib(3, 130, [(256, 128), (128, 256)], torch.device("cpu"), dg=_stand_in(identical),
                                   timer=timer)
    assert lib == want and why["identical"] == identical
    assert why["ms"] == {"moefp8": 8.0, "deepgemm": 4 * deepgemm_ms}  # 2 shapes x (fprop, dgrad)


def test_auto_without_deep_gemm_or_a_gpu_is_moefp8_and_says_why():
    """auto is the default (the config's and the recipe preset's); without a GPU it is moefp8, said in one line;
    a recipe with no FP8 GEMMs says nothing."""
    from moefp8.build import gemm_policy
    from moefp8.config import Config
    from moefp8.hydra_config import compose_config

    c, said = Config(), []
    assert c.recipe.gemm == "auto" and compose_config(["recipe=fp8"]).recipe.gemm == "auto"
    assert gemm_policy(c, torch.device("cpu"), say=said.append).mgrouped_lib == "moefp8"
    c.recipe.recipe = "bf16"
    assert gemm_policy(c, torch.device("cpu"), say=said.append).mgrouped_lib == "moefp8"
    assert said == ["recipe.gemm=auto: moefp8 (not a CUDA device (cpu))"]


def test_auto_keeps_moefp8_where_deep_gemm_fails_on_the_trial():
    """A DeepGEMM build that raises on the trial (its JIT failing, a shape it refuses) leaves moefp8's kernels and
    says what failed, instead of stopping the run at start."""
    from moefp8.kernels.grouped_gemm import choose_mgrouped_lib

    def m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices):
        raise RuntimeError("NVRTC compilation failed\n(the rest of the log)")
    dg = types.SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=m_grouped_fp8_gemm_nt_contiguous)
    lib, why = choose_mgrouped_lib(3, 130, [(256, 128)], torch.device("cpu"), dg=dg, timer=lambda fn: 1.0)
    assert lib == "moefp8"
    assert why["why"] == "DeepGEMM failed on [768, 128] x [3, 256, 128]: RuntimeError: NVRTC compilation failed"

@pytest.mark.gpu
def test_gpu_model_with_deep_gemm_equals_moefp8_bit_for_bit():
    """The issue's training check in small: the same model and batch, the m-grouped GEMMs by
    DeepGEMM or by moefp8: loss and every gradient equal."""
    if deepgemm.load() is None or not torch.cuda.is_available():
        pytest.skip("deep_gemm not installed")
    from moefp8.config import ModelConfig
    from moefp8.kernels.grouped_gemm import GemmPolicy
    from moefp8.model import Transformer
    from moefp8.recipe import Recipe

    torch.backends.cuda.enable_flash_sdp(False)  # deterministic attention backward (train.deterministic)
    x = torch.randint(0, 257, (2, 129), generator=torch.Generator().manual_seed(0)).cuda()
    got = []
    for lib in ("moefp8", "deepgemm"):
        m = Transformer(ModelConfig(), Recipe("fp8"), seed=0, gemm=GemmPolicy(mgrouped_lib=lib)).cuda()
        out = m(x[:, :-1], x[:, 1:])
        (out.out + out.aux_loss).backward()
        got.append([out.out.detach()] + [p.grad for p in m.parameters()])
    for a, b in zip(*got):
        assert torch.equal(a, b)


def _agree_case(rank, world, device, picks):
    """One rank of the agreement test: its own trial says picks[rank]; what the job runs is said once."""
    import moefp8.build as build
    from moefp8.config import Config

    ms = {"moefp8": 3.3, "deepgemm": 3.0 if picks[rank] == "deepgemm" else 3.6}
    build.choose_mgrouped_lib = lambda *a, **k: (picks[rank], {"ms": ms, "identical": True})
    said = []
    lib = build.gemm_policy(Config(), torch.device(device), 2, said.append,
                            types.SimpleNamespace(world=world, device=torch.device(device))).mgrouped_lib
    want = "deepgemm" if all(p == "deepgemm" for p in picks) else "moefp8"
    assert lib == want, (rank, lib, picks)
    n = sum(p == "deepgemm" for p in picks)
    tail = {0: ")", 1: "; DeepGEMM chosen on 1 of 2 ranks only: moefp8 on every rank)", 2: "; on all 2 ranks)"}[n]
    assert len(said) == 1 and said[0].startswith(f"recipe.gemm=auto: {want} (") and said[0].endswith(tail), said


@pytest.mark.parametrize("picks", [("deepgemm", "moefp8"), ("moefp8", "deepgemm"), ("deepgemm", "deepgemm"),
                                   ("moefp8", "moefp8")])
def test_auto_under_torchrun_runs_one_library_on_every_rank(picks):
    """2 gloo ranks whose trials disagree (a node without DeepGEMM, or a trial that read it slower) run moefp8's
    kernels on both; DeepGEMM only where every rank chose it."""
    from moefp8.testing import spawn_group

    spawn_group(_agree_case, 2, picks, timeout_s=120)


def test_auto_on_a_gpu_without_deep_gemm_says_it_is_optional(monkeypatch):
    """Where `deep_gemm` does not import, auto's line says so and where to read how to build it."""
    from moefp8.kernels.grouped_gemm import choose_mgrouped_lib

    monkeypatch.setattr(deepgemm, "load", lambda: None)
    lib, why = choose_mgrouped_lib(3, 130, [(256, 128)], torch.device("cuda"))
    assert lib == "moefp8" and why == {"why": "deep_gemm does not import: optional, the README says how to build it"}
