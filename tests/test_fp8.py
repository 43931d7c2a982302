"""The FP8 tensor type and the UE8M0 scale bytes."""

import pytest
import torch

from moefp8.fp8 import Fp8Tensor, ScaleStats, pack_ue8m0, unpack_ue8m0
from moefp8.kernels.quant import quant_rowwise_ref, quant_weight_ref


def test_ue8m0_round_trip_all_exponents():
    s = torch.exp2(torch.arange(-126, 128, dtype=torch.float32))
    b = pack_ue8m0(s)
    assert b.dtype == torch.uint8 and torch.equal(b.int(), torch.arange(1, 255, dtype=torch.int32))
    assert torch.equal(unpack_ue8m0(b), s)
    assert torch.isinf(unpack_ue8m0(pack_ue8m0(torch.tensor([float("inf")])))).all()


def test_ue8m0_of_real_scales():
    q = quant_rowwise_ref(torch.randn(33, 512) * 100)
    assert torch.equal(unpack_ue8m0(pack_ue8m0(q.scale)), q.scale)


@pytest.mark.parametrize("bad", [3.0, -2.0, 0.75])
def test_ue8m0_refuses_non_powers_of_two(bad):
    with pytest.raises(ValueError, match=f"scale {bad!r} is not a positive power of two"):
        pack_ue8m0(torch.tensor([1.0, bad]))


def test_block_dequantize_uses_each_block_scale():
    w = torch.ones(256, 256)
    w[128:, 128:] = 1024.0  # exactly representable at its block scale 4
    q = quant_weight_ref(w)
    assert q.scale.shape == (2, 2)
    assert torch.equal(q.dequantize(), w)


def test_unknown_layout():
    with pytest.raises(ValueError, match="unknown FP8 layout '2x2'"):
        Fp8Tensor(torch.zeros(1, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1), "2x2").dequantize()


def test_scale_stats_counts_floor_tiles_and_averages_the_others():
    st = ScaleStats()
    x = torch.zeros(4, 256)
    x[0] = 448.0 * 2**-20  # scale 2**-20
    x[1, :128] = 448.0 * 2**-30  # scale 2**-30; its second tile and rows 2, 3 are zero: at the floor
    st.record("grad", quant_rowwise_ref(x))  # off: ignored
    assert st.report() == {}
    st.on = True
    st.record("grad", quant_rowwise_ref(x))
    st.record("act", quant_rowwise_ref(torch.ones(1, 128)))  # scale 2**-8
    r = st.report()
    assert r["fp8/grad_tiles"] == 8 and r["fp8/grad_at_floor"] == 5 / 8
    assert r["fp8/grad_log2_scale_mean"] == (-20 - 20 - 30) / 3 and r["fp8/grad_log2_scale_min"] == -30
    assert r["fp8/act_tiles"] == 1 and r["fp8/act_at_floor"] == 0 and r["fp8/act_log2_scale_mean"] == -8
    assert st.report() == {}  # reset by the report
