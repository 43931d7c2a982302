"""FP8 blockwise GEMMs: references vs float64, Triton (interpreter on CPU, GPU) vs the same FP8
inputs upcast to float64, contract checks (empty experts, ragged segments, zero rows, errors).

Tolerances (relative Frobenius error, `rel_err`):
* FP32 results (wgrad, or the m-grouped kernel writing fp32): on CPU the only error is fp32
  summation of exact FP8 products, ~1e-7; bound 1e-5. On Hopper the FP8 MMA adds the products
  of each 128-wide block with a reduced-precision internal accumulator: measured rel. error
  2.5e-5 to 4.6e-5 for our kernels and 1.3e-4 for cuBLAS blockwise on Gaussian data, up to
  3.7e-4 with x1e3 outliers (they set the block's alignment exponent); GPU bound 1e-3.
* BF16 results: one rounding to bf16 (unit roundoff 2**-9 = 0.00195, rms ~0.0011 relative for
  round-to-nearest); bound 4e-3. The Triton interpreter truncates fp32 -> bf16 instead (max
  2**-8 = 0.0039 per element, rms ~0.0023), so interpreter runs of BF16 outputs get 8e-3.
FP8 inputs are built with the `_ref` quantizers (the interpreter's own fp8 casts round wrongly).
"""

import pytest
import torch

from moefp8.fp8 import Fp8Tensor
from moefp8.kernels.gemm import (fp8_gemm, fp8_gemm_dgrad, fp8_gemm_dgrad_ref, fp8_gemm_ref,
                                 fp8_gemm_wgrad_ref, transpose_weight)
from moefp8.kernels.grouped_gemm import (GemmPolicy, fp8_grouped_gemm, fp8_grouped_gemm_ref, fp8_grouped_gemm_wgrad,
                                         fp8_grouped_gemm_wgrad_ref, launch_mgrouped, prepare_offsets)
from moefp8.kernels.permute import segment_offsets
from moefp8.kernels.quant import quant_colwise_ref, quant_rowwise_ref, quant_weight_ref
from moefp8.testing import rel_err

FP32_TOL = 1e-5
GPU_FP32_TOL = 1e-3
BF16_TOL = 4e-3
BF16_INTERP_TOL = 8e-3


def _rand(*shape, outliers: bool = False, device="cpu", seed=None):
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else torch.randint(0, 2**30, ()).item())
    x = torch.randn(*shape, generator=g)
    if outliers:  # a few values x1e3: they set their tiles' scales, the rest of the tile loses bits
        idx = torch.randint(0, x.numel(), (max(1, x.numel() // 5000),), generator=g)
        x.view(-1)[idx] *= 1e3
    return x.to(device)


def _ref64_grouped(a, b, off, transpose_b=False):
    A, B = a.dequantize().double(), b.dequantize().double()
    n_out = B.shape[2] if transpose_b else B.shape[1]
    out = torch.zeros(A.shape[0], n_out, dtype=torch.float64, device=A.device)
    for e in range(len(off) - 1):
        s, t = off[e], off[e + 1]
        out[s:t] = A[s:t] @ (B[e] if transpose_b else B[e].t())
    return out


def _ref64_wgrad(dy, x, off):
    DY, X = dy.dequantize().double(), x.dequantize().double()
    return torch.stack([DY[off[e]:off[e + 1]].t() @ X[off[e]:off[e + 1]] for e in range(len(off) - 1)])


# ----------------------------------------------------------------------------------------------
# References vs float64 (CPU, fast)


@pytest.mark.parametrize("M,N,K", [(6, 128, 128), (200, 256, 384), (131, 96, 640)])
def test_dense_refs_vs_fp64(M, N, K):
    x, w, dy = _rand(M, K), _rand(N, K), _rand(M, N)
    a, b = quant_rowwise_ref(x), quant_weight_ref(w)
    exact = a.dequantize().double() @ b.dequantize().double().t()
    assert rel_err(fp8_gemm_ref(a, b), exact) < BF16_TOL
    assert rel_err(fp8_gemm(a, b), exact) < BF16_TOL  # CPU default is the reference
    xc, dyc = quant_colwise_ref(x), quant_colwise_ref(dy)
    exact_w = dyc.dequantize().double().t() @ xc.dequantize().double()
    assert rel_err(fp8_gemm_wgrad_ref(dyc, xc), exact_w) < FP32_TOL
    if N % 128 == 0:
        d8 = quant_rowwise_ref(dy)
        exact_d = d8.dequantize().double() @ b.dequantize().double()
        assert rel_err(fp8_gemm_dgrad_ref(d8, b), exact_d) < BF16_TOL
        # dgrad by the transposed 128x128 grid is the same numbers (no requantization)
        assert torch.equal(transpose_weight(b).dequantize(), b.dequantize().t())


def test_grouped_refs_vs_fp64():
    off = [0, 128, 128, 512, 640]  # expert 1 empty
    a = quant_rowwise_ref(_rand(700, 256))
    b = quant_weight_ref(_rand(4, 192, 256))
    out = fp8_grouped_gemm_ref(a, b, off)
    assert rel_err(out, _ref64_grouped(a, b, off)) < BF16_TOL
    assert torch.equal(out[640:], torch.zeros_like(out[640:]))
    dyc, xc = quant_colwise_ref(_rand(700, 128)), quant_colwise_ref(_rand(700, 256))
    dw = fp8_grouped_gemm_wgrad_ref(dyc, xc, off)
    assert rel_err(dw, _ref64_wgrad(dyc, xc, off)) < FP32_TOL
    assert torch.equal(dw[1], torch.zeros_like(dw[1]))


# ----------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (tiny shapes; BLOCK 32)


@pytest.mark.interp
@pytest.mark.parametrize("off,M", [([0, 128, 128, 384], 416), ([0, 0, 0], 128), ([0, 256, 384, 384], 384)])
def test_interp_mgrouped_fp32_exact(off, M):
    """Kernel writing fp32: checks indexing and promotion to 1e-5 of the fp64 product."""
    E = len(off) - 1
    a, b = quant_rowwise_ref(_rand(M, 256, outliers=True)), quant_weight_ref(_rand(E, 96, 256))
    o = prepare_offsets(off, E, M, "cpu", validate=True)
    out = torch.full((M, 96), float("nan"))
    launch_mgrouped(a, b, o, out)
    exact = _ref64_grouped(a, b, off)
    assert rel_err(out, exact) < FP32_TOL
    assert torch.equal(out[off[-1]:], torch.zeros_like(out[off[-1]:]))  # rows past the segments: 0


@pytest.mark.interp
def test_interp_mgrouped_bf16_and_dgrad():
    off = [0, 128, 128, 384]
    a, b = quant_rowwise_ref(_rand(400, 256)), quant_weight_ref(_rand(3, 128, 256))
    out = fp8_grouped_gemm(a, b, off, impl="triton")
    assert out.dtype == torch.bfloat16 and out.shape == (400, 128)
    assert rel_err(out, _ref64_grouped(a, b, off)) < BF16_INTERP_TOL
    # dgrad: a [M, N=128] times b[e] [N, K=256], through the transposed FP8 copy
    d8 = quant_rowwise_ref(_rand(400, 128))
    dx = fp8_grouped_gemm(d8, b, off, transpose_b=True, impl="triton")
    assert dx.shape == (400, 256)
    assert rel_err(dx, _ref64_grouped(d8, b, off, transpose_b=True)) < BF16_INTERP_TOL
    wt = transpose_weight(b, impl="triton")
    assert torch.equal(wt.data.view(torch.uint8), b.data.transpose(1, 2).contiguous().view(torch.uint8))
    assert torch.equal(wt.scale, b.scale.transpose(1, 2))


@pytest.mark.interp
def test_interp_kgrouped_empty_ragged_accumulate():
    off = [0, 0, 256, 384, 384]  # experts 0 and 3 empty
    M = 416  # tokens past offsets[E] are ignored
    dyc, xc = quant_colwise_ref(_rand(M, 64, outliers=True)), quant_colwise_ref(_rand(M, 96))
    dw = fp8_grouped_gemm_wgrad(dyc, xc, off, impl="triton")
    exact = _ref64_wgrad(dyc, xc, off)
    assert rel_err(dw, exact) < FP32_TOL
    assert torch.equal(dw[0], torch.zeros_like(dw[0])) and torch.equal(dw[3], torch.zeros_like(dw[3]))
    base = _rand(4, 64, 96)
    acc = base.clone()
    fp8_grouped_gemm_wgrad(dyc, xc, off, out=acc, impl="triton")
    assert rel_err(acc, exact + base.double()) < FP32_TOL
    assert torch.equal(acc[0], base[0])


@pytest.mark.interp
@pytest.mark.parametrize("M", [1, 100, 130])
def test_interp_dense_any_m(M):
    """Dense GEMMs reuse the grouped kernels with one group; M need not be a multiple of 128."""
    x, w, dy = _rand(M, 256), _rand(96, 256), _rand(M, 128)
    a, b = quant_rowwise_ref(x), quant_weight_ref(w)
    exact = a.dequantize().double() @ b.dequantize().double().t()
    assert rel_err(fp8_gemm(a, b, impl="triton"), exact) < BF16_INTERP_TOL
    w2 = quant_weight_ref(_rand(128, 256))
    d8 = quant_rowwise_ref(dy)
    exact_d = d8.dequantize().double() @ w2.dequantize().double()
    assert rel_err(fp8_gemm_dgrad(d8, w2, impl="triton"), exact_d) < BF16_INTERP_TOL
    xc, dyc = quant_colwise_ref(x), quant_colwise_ref(dy)
    exact_w = dyc.dequantize().double().t() @ xc.dequantize().double()
    assert rel_err(fp8_gemm(dyc, xc, impl="triton"), exact_w) < FP32_TOL
    main = _rand(128, 256)
    out = main.clone()
    fp8_gemm(dyc, xc, out=out, impl="triton")
    assert rel_err(out, exact_w + main.double()) < FP32_TOL


# ----------------------------------------------------------------------------------------------
# Bad input: a clear ValueError naming the value


def test_errors():
    a = quant_rowwise_ref(_rand(256, 256))
    b3 = quant_weight_ref(_rand(2, 128, 256))
    with pytest.raises(ValueError, match="not a multiple of 128"):
        fp8_grouped_gemm(a, b3, [0, 100, 256])
    with pytest.raises(ValueError, match="exceeds"):
        fp8_grouped_gemm(a, b3, [0, 128, 384])
    with pytest.raises(ValueError, match="non-decreasing"):
        fp8_grouped_gemm(a, b3, [0, 256, 128])
    with pytest.raises(ValueError, match=r"shape \[3\]"):
        fp8_grouped_gemm(a, b3, [0, 256])
    with pytest.raises(ValueError, match="layout '1x128'"):
        fp8_grouped_gemm(b3, b3, [0, 128, 256])
    with pytest.raises(ValueError, match="K=128"):
        fp8_grouped_gemm(quant_rowwise_ref(_rand(256, 128)), b3, [0, 128, 256])
    with pytest.raises(ValueError, match="K=256"):
        fp8_gemm(a, quant_weight_ref(_rand(128, 384)))
    bad = Fp8Tensor(torch.zeros(4, 100, dtype=a.data.dtype), torch.ones(4, 1), "1x128")
    with pytest.raises(ValueError, match="100 is not divisible by 128"):
        fp8_gemm(bad, quant_weight_ref(_rand(128, 128)))
    with pytest.raises(ValueError, match="tokens"):
        fp8_gemm(quant_colwise_ref(_rand(128, 128)), quant_colwise_ref(_rand(256, 128)))
    with pytest.raises(ValueError, match="out must be float32"):
        fp8_gemm(quant_colwise_ref(_rand(128, 128)), quant_colwise_ref(_rand(128, 128)),
                 out=torch.zeros(128, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="impl="):
        fp8_gemm(a, quant_weight_ref(_rand(128, 256)), impl="cutlass")


# ----------------------------------------------------------------------------------------------
# GPU: every kernel vs the reference on fresh random inputs with outliers, DeepSeek-V3 shapes


def _gpu_ref_check(out, exact, tol):
    err = rel_err(out, exact)
    assert err < tol, f"rel_err {err:.3g} >= {tol}"


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(256, 4096, 384), (512, 4096, 640), (1024, 7168, 2048),
                                   (2048, 4096, 7168), (96, 7168, 7168), (200, 4096, 2048)])
@pytest.mark.parametrize("impl", ["cublas", "triton-tma", "triton-ptr"])
def test_gpu_dense(M, N, K, impl):
    if impl == "cublas" and (M % 16 or (K // 128) % 4):
        pytest.skip("cuBLAS blockwise is used only for M % 16 == 0 and K/128 % 4 == 0")
    policy = GemmPolicy()
    if impl.startswith("triton"):
        impl, variant = impl.split("-")
        policy = GemmPolicy(variant=variant)
    x, w, dy = _rand(M, K, outliers=True).cuda(), _rand(N, K).cuda(), _rand(M, N, outliers=True).cuda()
    a, b, d8 = quant_rowwise_ref(x), quant_weight_ref(w), quant_rowwise_ref(dy)
    exact = a.dequantize().double() @ b.dequantize().double().t()
    _gpu_ref_check(fp8_gemm(a, b, impl=impl, policy=policy), exact, BF16_TOL)
    exact_d = d8.dequantize().double() @ b.dequantize().double()
    _gpu_ref_check(fp8_gemm_dgrad(d8, b, impl=impl, policy=policy), exact_d, BF16_TOL)
    if impl == "cublas" and M % 128:
        return
    xc, dyc = quant_colwise_ref(x), quant_colwise_ref(dy)
    exact_w = dyc.dequantize().double().t() @ xc.dequantize().double()
    _gpu_ref_check(fp8_gemm(dyc, xc, impl=impl, policy=policy), exact_w, GPU_FP32_TOL)
    main = torch.randn(N, K, device="cuda")
    out = main.clone()
    fp8_gemm(dyc, xc, out=out, impl=impl, policy=policy)
    _gpu_ref_check(out, exact_w + main.double(), GPU_FP32_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4096, 7168), (7168, 2048), (4096, 384), (256, 640), (96, 256)])
@pytest.mark.parametrize("counts", [[512, 512, 512, 512], [0, 1000, 3, 0, 2100, 128]])
@pytest.mark.parametrize("variant", ["tma", "ptr"])
def test_gpu_grouped(N, K, counts, variant):
    """Variants of the Triton kernels; the wgrad is also checked through its cuBLAS loop."""
    policy = GemmPolicy(variant=variant)
    off = segment_offsets(counts)
    E, M = len(counts), off[-1] + 128  # one spare tile past the segments
    a = quant_rowwise_ref(_rand(M, K, outliers=True).cuda())
    b = quant_weight_ref(_rand(E, N, K).cuda())
    out = fp8_grouped_gemm(a, b, torch.tensor(off, dtype=torch.int32, device="cuda"), policy=policy)
    _gpu_ref_check(out, _ref64_grouped(a, b, off), BF16_TOL)
    assert torch.equal(out[off[-1]:], torch.zeros_like(out[off[-1]:]))
    if N % 128 == 0:  # dgrad contracts over N
        d8 = quant_rowwise_ref(_rand(M, N, outliers=True).cuda())
        dx = fp8_grouped_gemm(d8, b, off, transpose_b=True, policy=policy)
        _gpu_ref_check(dx, _ref64_grouped(d8, b, off, transpose_b=True), BF16_TOL)
    dyc = quant_colwise_ref(_rand(M, N, outliers=True).cuda())
    xc = quant_colwise_ref(_rand(M, K).cuda())
    dw = fp8_grouped_gemm_wgrad(dyc, xc, off, policy=policy)
    exact = _ref64_wgrad(dyc, xc, off)
    _gpu_ref_check(dw, exact, GPU_FP32_TOL)
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(dw[e], torch.zeros_like(dw[e]))
    acc = torch.randn_like(dw)
    base = acc.clone()
    fp8_grouped_gemm_wgrad(dyc, xc, off, out=acc, policy=policy)
    _gpu_ref_check(acc, exact + base.double(), GPU_FP32_TOL)
    dw_cublas = fp8_grouped_gemm_wgrad(dyc, xc, off, impl="cublas")
    _gpu_ref_check(dw_cublas, exact, GPU_FP32_TOL)
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(dw_cublas[e], torch.zeros_like(dw_cublas[e]))
    if N % 128 == 0:
        wt = transpose_weight(b)
        assert torch.equal(wt.data.view(torch.uint8), b.data.transpose(1, 2).contiguous().view(torch.uint8))


@pytest.mark.gpu
def test_gpu_all_experts_empty():
    """No tokens at all: zeros out, zeros dW, no hang (pytorch#152668)."""
    a = quant_rowwise_ref(torch.randn(256, 384, device="cuda"))
    b = quant_weight_ref(torch.randn(3, 256, 384, device="cuda"))
    off = [0, 0, 0, 0]
    assert torch.equal(fp8_grouped_gemm(a, b, off), torch.zeros(256, 256, dtype=torch.bfloat16, device="cuda"))
    dyc, xc = quant_colwise_ref(torch.randn(256, 256, device="cuda")), quant_colwise_ref(torch.randn(256, 384, device="cuda"))
    assert torch.equal(fp8_grouped_gemm_wgrad(dyc, xc, off), torch.zeros(3, 256, 384, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4096, 7168), (7168, 2048), (256, 640)])
@pytest.mark.parametrize("counts", [[512, 512, 512, 512], [0, 1000, 3, 0, 2100, 128]])
def test_gpu_grouped_cublas_loop_with_host_offsets(N, K, counts):
    """The per-expert cuBLAS loops the MoE layer picks when it passes host offsets: fprop,
    dgrad (through the transposed weight) and wgrad, with empty and ragged experts."""
    off = segment_offsets(counts)
    E, M = len(counts), off[-1] + 128
    a = quant_rowwise_ref(_rand(M, K, outliers=True).cuda())
    b = quant_weight_ref(_rand(E, N, K).cuda())
    off_dev = torch.tensor(off, dtype=torch.int32, device="cuda")
    out = fp8_grouped_gemm(a, b, off_dev, host_offsets=off)
    _gpu_ref_check(out, _ref64_grouped(a, b, off), BF16_TOL)
    assert torch.equal(out[off[-1]:], torch.zeros_like(out[off[-1]:]))
    d8 = quant_rowwise_ref(_rand(M, N, outliers=True).cuda())
    dx = fp8_grouped_gemm(d8, b, off_dev, transpose_b=True, host_offsets=off)  # cuBLAS where it applies
    _gpu_ref_check(dx, _ref64_grouped(d8, b, off, transpose_b=True), BF16_TOL)
    dyc = quant_colwise_ref(_rand(M, N, outliers=True).cuda())
    xc = quant_colwise_ref(_rand(M, K).cuda())
    dw = fp8_grouped_gemm_wgrad(dyc, xc, off_dev, host_offsets=off)
    _gpu_ref_check(dw, _ref64_wgrad(dyc, xc, off), GPU_FP32_TOL)
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(dw[e], torch.zeros_like(dw[e]))


def test_cublas_loop_refuses_unsupported_shapes():
    a = quant_rowwise_ref(torch.randn(128, 384))
    b = quant_weight_ref(torch.randn(2, 256, 384))
    with pytest.raises(ValueError, match=r"impl='cublas' needs CUDA, K/128 % 4 == 0"):
        fp8_grouped_gemm(a, b, [0, 128, 128], impl="cublas")


def test_cublas_loop_only_where_it_pays():
    loop_pays = GemmPolicy().loop_pays  # the default threshold

    small = [2048 * e for e in range(33)]  # the small preset: 32 experts x 2048 rows, N = K = 1024
    assert not loop_pays(small, 1024, 1024)
    assert not loop_pays([4096 * e for e in range(9)], 2048, 2048)  # the small preset's fc1: Triton (measured)
    assert loop_pays([1024 * e for e in range(33)], 4096, 7168)  # DeepSeek-V3 at 1024 rows per expert: the loop
    dsv3 = [4096 * e for e in range(33)]  # DeepSeek-V3 fc1: 4096 rows x 4096 x 7168
    assert loop_pays(dsv3, 4096, 7168) and loop_pays(dsv3, 4096, 7168, min_rows=2048)
    assert not loop_pays([1024 * e for e in range(33)], 4096, 7168, min_rows=2048)  # wgrad below 2048 rows
    assert not loop_pays([0] * 9, 4096, 7168)  # no tokens at all


@pytest.mark.gpu
def test_gpu_dense_triton_fallback_makes_no_host_sync():
    """K = 2816 (K/128 % 4 != 0: the 16B preset's shared experts' down projection) runs the Triton
    kernel as one group; its offsets were a pageable host copy, a stream sync per GEMM that made the
    16B step host-paced (bench/notes/scale.md). Forward, dgrad and the Triton wgrad: no sync."""
    M, N, K = 512, 2048, 2816
    x, w, dy = _rand(M, K, outliers=True).cuda(), _rand(N, K).cuda(), _rand(M, N).cuda()
    a, b, d8, xc, dyc = (quant_rowwise_ref(x), quant_weight_ref(w), quant_rowwise_ref(dy), quant_colwise_ref(x),
                         quant_colwise_ref(dy))
    triton_wgrad = GemmPolicy(dense_wgrad_cublas=False)
    for _ in range(2):  # warm-up: compilation, the offsets made once per M
        fp8_gemm(a, b), fp8_gemm_dgrad(d8, b), fp8_gemm(dyc, xc, policy=triton_wgrad)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [fp8_gemm(a, b), fp8_gemm_dgrad(d8, b), fp8_gemm(dyc, xc, policy=triton_wgrad)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _gpu_ref_check(outs[0], a.dequantize().double() @ b.dequantize().double().t(), BF16_TOL)
    _gpu_ref_check(outs[2], dyc.dequantize().double().t() @ xc.dequantize().double(), GPU_FP32_TOL)
