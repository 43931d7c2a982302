"""SwiGLU backward fused with both FP8 quantizations, and the BF16 recipe's SwiGLU kernels."""

import pytest
import torch

from moefp8.kernels import swiglu as S
from moefp8.kernels.quant import quant_colwise_ref, quant_rowwise_ref, requant_colwise_ref, swiglu_ref
from moefp8.fp8 import col_major
from moefp8.testing import assert_fp8_equal, scale_storage


def inputs(M, I, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(M, 2 * I, generator=g) * 3).bfloat16()
    h[0] = 0  # a zero row
    da = torch.randn(M, I, generator=g).bfloat16()
    return h.to(device), da.to(device)


def check_scale_layouts(h8, da, device):
    """h8's scales read in either order; dh's "1x128" scales column-major on request (the fc1 dgrad
    operand), its "128x1" scales always: the same values either way (same kernel)."""
    row, col = S.swiglu_backward_quant(h8, da, impl="triton")
    h8c = h8._replace(scale=col_major(h8.scale))
    row_c, col_c = S.swiglu_backward_quant(h8c, da, impl="triton", colmajor_scale=True)
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
    """"1x128": dh quantized (half an FP8 ulp); "128x1": requantized from those codes (DeepSeek-V3's
    transposing requantization), so within the row codes' error plus half an ulp at the column's
    scale, where a direct col-wise quantization of dh would be within the latter alone. The codes
    equal the direct ones wherever the column's scale is the same and no rounding is subnormal."""
    h, da = inputs(150, 256)
    h8 = quant_rowwise_ref(h)
    row, col = S.swiglu_backward_quant_ref(h8, da)
    dh = S.swiglu_backward_ref(h8.dequantize(), da)
    assert row.layout == "1x128" and row.shape == (150, 512) and col.layout == "128x1" and col.shape == (150, 512)
    assert_fp8_equal(col, requant_colwise_ref(row), exact=True)
    r = row.dequantize()
    sr = row.scale.repeat_interleave(128, 1)
    sc = col.scale.repeat_interleave(128, 1)[:, :150].t()
    err_r = (r - dh).abs()
    assert torch.all(err_r <= torch.maximum(dh.abs() * 2**-4, sr * 2**-10))  # half an FP8 ulp
    assert torch.all((col.dequantize() - dh).abs() <= err_r + torch.maximum(r.abs() * 2**-4, sc * 2**-10))
    direct = quant_colwise_ref(dh)
    same = (direct.scale.repeat_interleave(128, 1)[:, :150].t() == sc)  # the row codes can lower a column's amax
    normal = (dh.abs() >= sr * 2**-6) & (dh.abs() >= sc * 2**-6)  # E4M3's smallest normal is 2^-6
    assert (same & normal).float().mean() > 0.8  # the comparison below covers most values
    assert torch.equal(col.dequantize()[same & normal], direct.dequantize()[same & normal])


@pytest.mark.interp
@pytest.mark.parametrize("M,I", [(1, 128), (200, 256), (144, 128), (256, 256)])  # M % 16 == 0: packed col-wise store
def test_interpreter_vs_ref(M, I):
    h, da = inputs(M, I, seed=M)
    h8 = quant_rowwise_ref(h)
    row, col = S.swiglu_backward_quant(h8, da, impl="triton")
    assert_fp8_equal(row, S.swiglu_backward_quant_ref(h8, da)[0], exact=False,
                     scale_rtol=1e-6)  # numpy exp vs torch exp: last-bit amaxes
    # the col-wise copy from the codes the interpreter made (its cast bugs can move a column's amax)
    assert_fp8_equal(col, requant_colwise_ref(row), exact=False)
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
