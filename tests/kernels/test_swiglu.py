"""SwiGLU backward fused with both FP8 quantizations, and the BF16 recipe's SwiGLU kernels."""

import pytest
import torch

from moefp8.kernels import swiglu as S
from moefp8.kernels.quant import quant_rowwise_ref, swiglu_ref
from moefp8.fp8 import col_major
from moefp8.testing import assert_fp8_equal, scale_storage


def inputs(M, I, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(M, 2 * I, generator=g) * 3).bfloat16()
    h[0] = 0  # a zero row
    da = torch.randn(M, I, generator=g).bfloat16()
    return h.to(device), da.to(device)


def check_scale_layouts(h8, da, device, impl="triton"):
    """h8's scales read in either order; dh's "1x128" scales column-major on request (the fc1 dgrad
    operand), its "128x1" scales always: the same values either way (same kernel)."""
    row, col = S.swiglu_backward_quant(h8, da, impl=impl)
    h8c = h8._replace(scale=col_major(h8.scale))
    row_c, col_c = S.swiglu_backward_quant(h8c, da, impl=impl, colmajor_scale=True)
    assert row_c.scale.stride(0) == 1 and col.scale.stride(0) == 1 and col_c.scale.stride(0) == 1
    assert torch.equal(row.scale, row_c.scale) and torch.equal(row.data.view(torch.uint8), row_c.data.view(torch.uint8))
    assert torch.equal(col.scale, col_c.scale) and torch.equal(col.data.view(torch.uint8), col_c.data.view(torch.uint8))
    assert scale_storage(row_c.scale) == scale_storage(S.swiglu_backward_quant_ref(h8, da, colmajor_scale=True)[0].scale)


def test_backward_ref_matches_float64_autograd():
    h, da = inputs(70, 256)
    h64 = h.double().requires_grad_()
    g, u = h64.chunk(2, -1)
    (torch.nn.functional.silu(g) * u).backward(da.double())
    got = S.swiglu_backward_ref(h.float(), da).double()
    # fp32 evaluation of a few products: relative error ~1e-6 of the magnitudes involved
    assert torch.allclose(got, h64.grad, rtol=1e-5, atol=1e-5 * float(h64.grad.abs().max()))


def test_backward_quant_ref_is_the_quantized_gradient():
    h, da = inputs(150, 256)
    h8 = quant_rowwise_ref(h)
    row, col = S.swiglu_backward_quant_ref(h8, da)
    dh = S.swiglu_backward_ref(h8.dequantize(), da)
    assert row.layout == "1x128" and row.shape == (150, 512) and col.layout == "128x1" and col.shape == (150, 512)
    err_r, err_c = (row.dequantize() - dh).abs(), (col.dequantize() - dh).abs()
    sr = row.scale.repeat_interleave(128, 1)
    sc = col.scale.repeat_interleave(128, 1)[:, :150].t()
    assert torch.all(err_r <= torch.maximum(dh.abs() * 2**-4, sr * 2**-10))  # half an FP8 ulp
    assert torch.all(err_c <= torch.maximum(dh.abs() * 2**-4, sc * 2**-10))


@pytest.mark.interp
@pytest.mark.parametrize("M,I", [(1, 128), (200, 256), (144, 128), (256, 256)])  # M % 16 == 0: packed col-wise store
def test_interpreter_vs_ref(M, I):
    h, da = inputs(M, I, seed=M)
    h8 = quant_rowwise_ref(h)
    for got, want in zip(S.swiglu_backward_quant(h8, da, impl="triton"), S.swiglu_backward_quant_ref(h8, da)):
        assert_fp8_equal(got, want, exact=False, scale_rtol=1e-6)  # numpy exp vs torch exp: last-bit amaxes
    check_scale_layouts(h8, da, "cpu")
    for got, want in ((S.swiglu_bf16(h, impl="triton"), S.swiglu_bf16(h, impl="ref")),
                      (S.swiglu_backward_bf16(h, da, impl="triton"), S.swiglu_backward_bf16(h, da, impl="ref"))):
        # the interpreter truncates fp32 -> bf16: one bf16 ulp
        assert torch.all((got.float() - want.float()).abs() <= want.float().abs() * 2**-7)


def test_bf16_any_width_and_errors():
    h, da = inputs(5, 100)
    assert torch.equal(S.swiglu_bf16(h), swiglu_ref(h).bfloat16())
    with pytest.raises(ValueError, match="h has 200 columns, expected 2I with I % 128 == 0"):
        S.swiglu_backward_quant(quant_rowwise_ref(torch.zeros(4, 256))._replace(
            data=torch.zeros(4, 200, dtype=torch.float8_e4m3fn)), torch.zeros(4, 100))
    with pytest.raises(ValueError, match=r"da has shape \(4, 64\), expected \(4, 128\)"):
        S.swiglu_backward_quant(quant_rowwise_ref(torch.zeros(4, 256)), torch.zeros(4, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("M,I", [(1, 128), (127, 256), (1040, 384), (4113, 2048), (16384, 1024)])
@pytest.mark.parametrize("fmt", ["pow2", "fp32"])
def test_gpu_bit_exact(M, I, fmt):
    h, da = inputs(M, I, seed=M + I, device="cuda")
    h8 = quant_rowwise_ref(h, fmt)
    for got, want in zip(S.swiglu_backward_quant(h8, da, fmt), S.swiglu_backward_quant_ref(h8, da, fmt)):
        assert_fp8_equal(got, want, exact=True)
    check_scale_layouts(h8, da, "cuda")
    assert torch.equal(S.swiglu_bf16(h), S.swiglu_bf16(h, impl="ref"))
    assert torch.equal(S.swiglu_backward_bf16(h, da), S.swiglu_backward_bf16(h, da, impl="ref"))


# ----------------------------------------------------------------------------------------------
# The Gluon kernel (kernels/swiglu_gl.py), the Hopper default: the Triton kernel's bits


def _compile_gluon_sm90():
    """The Gluon kernel compiled for sm_90 without a GPU (run in a process without TRITON_INTERPRET,
    under which gluon.jit gives interpreted functions)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from moefp8.kernels import swiglu_gl as SG
    ptrs = dict(h_ptr="*fp8e4nv", hs_ptr="*fp32", da_ptr="*bf16", q_ptr="*fp8e4nv", qs_ptr="*fp32",
                c_ptr="*fp8e4nv", cs_ptr="*fp32")
    ints = ["M", "I", "stride_hm", "stride_hsm", "stride_hsg", "stride_dam", "stride_qm", "stride_qsm", "stride_qsg",
            "stride_ck", "stride_csk", "stride_csm"]
    consts = dict(POW2=True, num_warps=8)
    sig = {**ptrs, **{n: "i32" for n in ints}, **{k: "constexpr" for k in consts}}
    src = GluonASTSource(fn=SG._swiglu_bwd_quant_gl_kernel, signature=sig, constexprs=consts, attrs={})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "enable_fp_fusion": False})


def test_gluon_kernel_fits_three_programs_per_sm(tmp_path):
    """The point of the Gluon kernel is occupancy: 8 warps at <= 80 registers (65536 / (80 x 256) = 3
    programs per SM), no spill, and its parked tile + scales within a third of an SM's 227 KB."""
    import os
    import re
    import subprocess
    import sys

    import triton

    from moefp8.kernels import swiglu_gl as SG
    if not SG.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas(90).path
    except Exception:  # noqa: BLE001 (an older Triton)
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not ptxas or not os.path.exists(ptxas):
        pytest.skip("Triton ships no ptxas here")
    log = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True)
    assert log.returncode == 0, log.stderr
    log = log.stdout + log.stderr
    assert int(re.search(r"Used (\d+) registers", log).group(1)) <= 80, log
    assert "0 bytes spill stores" in log, log
    assert int((tmp_path / "shared").read_text()) <= 227 * 1024 // 3


@pytest.mark.gpu
@pytest.mark.parametrize("M,I", [(1, 128), (127, 256), (1040, 384), (4113, 2048), (135168, 1024)])
@pytest.mark.parametrize("fmt", ["pow2", "fp32"])
def test_gpu_gluon_equals_triton(M, I, fmt):
    """Bit for bit the Triton kernel (and so the reference), outliers, zero rows and a partial last
    row block included, both scale layouts in and out."""
    from moefp8.kernels import swiglu_gl as SG
    if not SG.available(torch.device("cuda")):
        pytest.skip("needs Gluon and a Hopper GPU")
    h, da = inputs(M, I, seed=7 * M + I, device="cuda")
    h[M // 2, :5] *= 300.0  # outliers: their rows' and columns' scales
    da[M // 3, -3:] *= 1000.0
    da[-1] = 0
    h8 = quant_rowwise_ref(h, fmt)
    got = S.swiglu_backward_quant(h8, da, fmt, impl="gluon")
    for g, t in zip(got, S.swiglu_backward_quant(h8, da, fmt, impl="triton")):
        assert not torch.isnan(g.data.float()).any() and not torch.isnan(g.scale).any()
        assert_fp8_equal(g, t, exact=True)
    for g, r in zip(got, S.swiglu_backward_quant(h8, da, fmt)):  # the default is the Gluon kernel
        assert_fp8_equal(g, r, exact=True)
    check_scale_layouts(h8, da, "cuda", impl="gluon")


if __name__ == "__main__":  # the compile step of test_gluon_kernel_fits_three_programs_per_sm
    import sys
    from pathlib import Path

    kernel = _compile_gluon_sm90()
    Path(sys.argv[1], "k.ptx").write_text(kernel.asm["ptx"])
    Path(sys.argv[1], "shared").write_text(str(kernel.metadata.shared))
