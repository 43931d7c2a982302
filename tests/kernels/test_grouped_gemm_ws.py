"""The warp-specialized Gluon grouped GEMMs (kernels/grouped_gemm_ws.py).

CPU: the kernel compiled for sm_90 (no GPU needed: Triton's own ptxas) must not have its wgmma
serialized by ptxas (advisory C7514), the failure that kept the earlier warp-specialized kernels
slower than the plain Triton one. GPU (marked): bit-exact against the Triton TMA kernel (same
per-128-K promotion order) and close to the float64 product, ragged and empty experts, odd K
blocks, the zero tail, dgrad, the dense path.
"""
import os
import subprocess
import sys

import pytest
import torch

from moefp8.kernels import grouped_gemm, grouped_gemm_ws as ws
from moefp8.kernels.grouped_gemm import (GemmPolicy, fp8_grouped_gemm, fp8_grouped_gemm_wgrad, launch_kgrouped,
                                         launch_mgrouped)
from moefp8.kernels.permute import segment_offsets
from moefp8.kernels.quant import quant_colwise_ref, quant_rowwise_ref, quant_weight_ref
from moefp8.testing import rel_err

BF16_TOL = 4e-3  # BF16 output rounding (2^-9 relative per element) dominates, as test_gemm.py
FP32_TOL = 1e-3  # fp32 out vs float64: the tensor cores' FP8 partial sums (measured 3.5-4.1e-4), as test_gemm.py


def _compile_sm90(which: str):
    """Compiles the m-grouped ("m") or k-grouped ("k") kernel for sm_90 without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    f8 = torch.float8_e4m3fn
    if which == "m":
        E, M, N, K = 8, 4096, 4096, 7168
        descs = ws.descriptors(torch.empty(M, K, dtype=f8), torch.empty(E, N, K, dtype=f8),
                               torch.empty(M, N, dtype=torch.bfloat16))
        fn, ptrs = ws._mgrouped_ws_kernel, ["ast_ptr", "bs_ptr", "off_ptr"]
        scalars = ["M", "N", "K", "E", "stride_bse", "stride_bsn"]
        consts = dict(E_POW2=E, GROUP_M=ws.GROUP_M, STAGES=ws.STAGES, CONSUMER_REGS=ws.CONSUMER_REGS,
                      PRODUCER_REGS=ws.PRODUCER_REGS, num_warps=4)
    else:
        E, M, N, K = 8, 4096, 4096, 7168
        descs = ws.kg_descriptors(torch.empty(N, M, dtype=f8), torch.empty(K, M, dtype=f8),
                                  torch.empty(E, N, K, dtype=torch.float32))
        fn, ptrs = ws._kgrouped_ws_kernel, ["ast_ptr", "bst_ptr", "off_ptr"]
        scalars = ["N", "K", "E"]
        consts = dict(ACCUMULATE=True, GROUP_M=ws.GROUP_M, STAGES=ws.KG_STAGES,
                      CONSUMER_REGS=ws.KG_CONSUMER_REGS,
                      PRODUCER_REGS=ws.KG_PRODUCER_REGS, num_warps=4)
    sig = {"a_desc": mangle_type(descs[0]), "b_desc": mangle_type(descs[1]), "c_desc": mangle_type(descs[2]),
           **{p: ("*i32" if p == "off_ptr" else "*fp32") for p in ptrs}, **{n: "i32" for n in scalars},
           **{k: "constexpr" for k in consts}}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs={})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": ws.MAXNREG})


def _ptxas_log(ptx: str, tmp_path) -> str:
    try:  # the ptxas Triton itself runs for sm_90 (3.9: ptxas-blackwell, the one that reads its PTX version)
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except Exception:  # noqa: BLE001 (an older Triton)
        import triton

        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not ptxas or not os.path.exists(ptxas):
        pytest.skip("Triton ships no ptxas here")
    src = tmp_path / "k.ptx"
    src.write_text(ptx)
    res = subprocess.run([ptxas, "-arch=sm_90a", "-v", f"--maxrregcount={ws.MAXNREG}", str(src), "-o",
                          str(tmp_path / "k.cubin")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return res.stdout + res.stderr


@pytest.mark.skipif(not ws.HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("which", ["m", "k"])
def test_compiles_for_sm90_without_wgmma_serialization(which, tmp_path):
    # In a fresh process without TRITON_INTERPRET (under it, gluon.jit gives interpreted functions).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, __file__, which, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    ptx = (tmp_path / "k.ptx").read_text()
    shared = int((tmp_path / "shared").read_text())
    log = _ptxas_log(ptx, tmp_path)
    # C7514: wgmma serialized; C7517: a wait injected because an in-flight accumulator is read
    assert "C7514" not in log and "C7517" not in log and "serialized" not in log, log
    assert "0 bytes spill stores, 0 bytes spill loads" in log, log
    assert ptx.count("wgmma.wait_group.sync.aligned 1;") >= 1  # the pair overlap survived
    assert shared <= 227 * 1024


def test_ptxas_check_can_fail(tmp_path):
    """The advisories the test above looks for are real: PTX that reads a wgmma accumulator while it
    is in flight gets one (a hand-written kernel, so the check does not depend on Gluon)."""
    regs = ",".join(f"%f{i}" for i in range(64))
    ptx = f"""
.version 8.0
.target sm_90a
.address_size 64
.visible .entry k(.param .u64 p, .param .u64 da, .param .u64 db) {{
  .reg .f32 %f<130>;
  .reg .b64 %rd<4>;
  ld.param.u64 %rd1, [p];
  ld.param.u64 %rd2, [da];
  ld.param.u64 %rd3, [db];
  wgmma.fence.sync.aligned;
  wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {{{regs}}}, %rd2, %rd3, 0, 1, 1;
  wgmma.commit_group.sync.aligned;
  add.f32 %f100, %f0, %f1;
  st.global.f32 [%rd1], %f100;
  wgmma.wait_group.sync.aligned 0;
  st.global.f32 [%rd1+4], %f2;
  ret;
}}
"""
    log = _ptxas_log(ptx, tmp_path)
    assert "C7517" in log, log


def test_reserve_sms_shrinks_the_persistent_grid():
    cpu = torch.device("cpu")  # num_sms: 4 off the GPU
    assert ws._grid_sms(cpu, GemmPolicy().sm_reserve) == 4  # the default leaves every SM to the GEMMs
    assert ws._grid_sms(cpu, 2) == 2
    assert ws._grid_sms(cpu, 10) == 1  # never below one program
    with pytest.raises(ValueError, match="sm_reserve=-1"):
        GemmPolicy(sm_reserve=-1)


# ----------------------------------------------------------------------------------------------
# GPU

def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4096, 7168), (7168, 2048), (4096, 384), (256, 640), (96, 256), (200, 128)])
@pytest.mark.parametrize("counts", [[512, 512, 512, 512], [0, 1000, 3, 0, 2100, 128], [0, 0, 0]])
def test_gpu_ws_bitexact_vs_triton(N, K, counts):
    if not (_hopper() and ws.HAVE_GLUON):
        pytest.skip("needs a Hopper GPU and Gluon")
    torch.manual_seed(N + K + len(counts))
    off = segment_offsets(counts)
    E, M = len(counts), off[-1] + 256  # spare tiles past the segments: zeros
    x = torch.randn(M, K, device="cuda")
    x[3, :5] = torch.tensor([1e4, -1e4, 0.0, 3e-6, 448.0])  # outliers, a zero, a tiny value
    a = quant_rowwise_ref(x)
    b = quant_weight_ref(torch.randn(E, N, K, device="cuda") / K**0.5)
    off_t = torch.tensor(off, dtype=torch.int32, device="cuda")
    got = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert ws.supported(a, b, got)
    ws.launch_mgrouped_ws(a, b, off_t, got)
    want = torch.full_like(got, float("nan"))
    launch_mgrouped(a, b, off_t, want, variant="tma")
    assert torch.equal(got, want)
    assert torch.equal(got[off[-1]:], torch.zeros_like(got[off[-1]:]))
    exact = torch.zeros(M, N, dtype=torch.float64, device="cuda")
    A, B = a.dequantize().double(), b.dequantize().double()
    for e in range(E):
        exact[off[e]:off[e + 1]] = A[off[e]:off[e + 1]] @ B[e].t()
    if off[-1]:
        assert rel_err(got, exact) < BF16_TOL


@pytest.mark.gpu
def test_gpu_ws_is_the_default_and_dgrad():
    if not (_hopper() and ws.HAVE_GLUON):
        pytest.skip("needs a Hopper GPU and Gluon")
    assert GemmPolicy().variant == "ws"
    off = segment_offsets([700, 0, 1300])
    M, N, K = off[-1] + 128, 1024, 768
    a = quant_rowwise_ref(torch.randn(M, K, device="cuda"))
    b = quant_weight_ref(torch.randn(3, N, K, device="cuda"))
    out = fp8_grouped_gemm(a, b, off)
    ref = torch.empty_like(out)
    launch_mgrouped(a, b, torch.tensor(off, dtype=torch.int32, device="cuda"), ref, variant="tma")
    assert torch.equal(out, ref)
    d8 = quant_rowwise_ref(torch.randn(M, N, device="cuda"))
    dx = fp8_grouped_gemm(d8, b, off, transpose_b=True)
    dref = torch.empty_like(dx)
    launch_mgrouped(d8, grouped_gemm.transpose_weight(b), torch.tensor(off, dtype=torch.int32, device="cuda"), dref,
                    variant="tma")
    assert torch.equal(dx, dref)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4096, 7168), (2048, 7168), (256, 384), (128, 640)])
@pytest.mark.parametrize("counts", [[512, 512, 512, 512], [0, 1000, 3, 0, 2100, 128], [0, 0]])
def test_gpu_kgrouped_ws_bitexact_vs_triton(N, K, counts):
    if not (_hopper() and ws.HAVE_GLUON):
        pytest.skip("needs a Hopper GPU and Gluon")
    torch.manual_seed(N + K + len(counts))
    off = segment_offsets(counts)
    E, M = len(counts), off[-1] + 128  # tokens past the last segment are ignored
    dy = torch.randn(M, N, device="cuda")
    dy[7, :3] = torch.tensor([1e4, 0.0, -3e-6])
    dyc, xc = quant_colwise_ref(dy), quant_colwise_ref(torch.randn(M, K, device="cuda"))
    off_t = torch.tensor(off, dtype=torch.int32, device="cuda")
    got = torch.full((E, N, K), float("nan"), device="cuda")
    assert ws.kgrouped_supported(dyc, xc, got)
    ws.launch_kgrouped_ws(dyc, xc, off_t, got, accumulate=False)
    want = torch.full_like(got, float("nan"))
    launch_kgrouped(dyc, xc, off_t, want, False, variant="tma")
    assert torch.equal(got, want)
    D, X = dyc.dequantize().double(), xc.dequantize().double()
    for e in range(E):
        exact = D[off[e]:off[e + 1]].t() @ X[off[e]:off[e + 1]]
        if off[e + 1] > off[e]:
            assert rel_err(got[e], exact) < FP32_TOL
        else:
            assert torch.equal(got[e], torch.zeros_like(got[e]))
    base = torch.randn(E, N, K, device="cuda")
    acc_ws, acc_tma = base.clone(), base.clone()
    ws.launch_kgrouped_ws(dyc, xc, off_t, acc_ws, accumulate=True)
    launch_kgrouped(dyc, xc, off_t, acc_tma, True, variant="tma")
    assert torch.equal(acc_ws, acc_tma)
    for e, c in enumerate(counts):
        if c == 0:  # no tokens: the main grad is left as it was
            assert torch.equal(acc_ws[e], base[e])
    assert torch.equal(fp8_grouped_gemm_wgrad(dyc, xc, off_t, validate=False), got)  # the default path


@pytest.mark.gpu
def test_gpu_wgrad_no_tokens_at_all():
    """A rank that receives no tokens (EP): M = 0. The descriptors of an empty tensor are refused by
    TMA, so the default path must not take the warp-specialized kernel there (found by the EP
    layer tests on 2 and 4 GPUs)."""
    dyc, xc = quant_colwise_ref(torch.empty(0, 256, device="cuda")), quant_colwise_ref(torch.empty(0, 384, device="cuda"))
    assert not ws.kgrouped_supported(dyc, xc, torch.empty(3, 256, 384, device="cuda"))
    dw = fp8_grouped_gemm_wgrad(dyc, xc, [0, 0, 0, 0], validate=False)
    assert torch.equal(dw, torch.zeros(3, 256, 384, device="cuda"))
    main = torch.randn(3, 256, 384, device="cuda")
    out = main.clone()
    fp8_grouped_gemm_wgrad(dyc, xc, [0, 0, 0, 0], out=out, validate=False)
    assert torch.equal(out, main)
    a = quant_rowwise_ref(torch.empty(0, 384, device="cuda"))
    b = quant_weight_ref(torch.randn(3, 256, 384, device="cuda"))
    assert fp8_grouped_gemm(a, b, [0, 0, 0, 0], validate=False).shape == (0, 256)


if __name__ == "__main__":  # the compile step of test_compiles_for_sm90_without_wgmma_serialization
    from pathlib import Path

    kernel = _compile_sm90(sys.argv[1])
    Path(sys.argv[2], "k.ptx").write_text(kernel.asm["ptx"])
    Path(sys.argv[2], "shared").write_text(str(kernel.metadata.shared))
